#!/usr/bin/env bash
# One call on a lent GPU machine: environment facts, the GPU tests under a time budget
# (real shapes, graph capture and replay, no device sync on the default path),
# `dflash-rocm bench --host` (host microseconds per call, this GPU's launch costs),
# `dflash-rocm bench --assumptions` (the model's assumptions measured: the per-rank precompute at TP8
# under the table's and what-if launches, the TP1 precompute at N=256 against the model's L2, the
# launch gap under a replayed CUDA graph; measured beside modelled),
# `dflash-rocm bench --vllm` (vLLM with and without the plugin, when vLLM is importable),
# then `dflash-rocm bench --quick` at real shapes. Logs, JSON, CSV and a plot go to $OUT
# (default ./gpu-check-out); a short table is printed last, with `dflash-rocm inspect`'s
# modelled time ("model us") beside every measured one of the modelled backend (rocm on
# AMD, triton on NVIDIA), so the first lent GPU shows how far the model is off. Needs only
# torch, Triton and pip: this checkout is installed without dependencies into a scratch folder
# (the environment itself is left as it is).
#
#   scripts/gpu_check.sh           # on the GPU machine (budget: well under 8 minutes)
#   scripts/gpu_check.sh --dry     # CPU rehearsal (interpreter, tiny shapes): what CI runs
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu-check-out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
# The backends live in the top-level backends/ and install as dflash_rocm.backends: install
# this checkout (no dependencies, no network) into a scratch folder and import it from there.
SITE="$(mktemp -d)"
{ "$PY" -m pip install -q --no-deps --no-build-isolation --no-compile --target "$SITE" . \
    || "$PY" -m pip install -q --no-deps --no-compile --target "$SITE" .; } > "$OUT/install.log" 2>&1 \
    || { echo "pip install of this checkout failed:"; tail -n 20 "$OUT/install.log"; exit 1; }
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
DRY=0
[ "${1:-}" = "--dry" ] && DRY=1
TEST_BUDGET="${TEST_BUDGET:-300}"   # seconds for pytest
BENCH_BUDGET="${BENCH_BUDGET:-150}" # seconds for the benchmark
VLLM_BUDGET="${VLLM_BUDGET:-300}"   # seconds for the end-to-end vLLM comparison (when vLLM is importable)
ASSUME_BUDGET="${ASSUME_BUDGET:-240}" # seconds for bench --assumptions (compiles ~10 launches, models them)

if [ "$DRY" = 1 ]; then
    export TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES="" HIP_VISIBLE_DEVICES=""
    TEST_BUDGET=120 BENCH_BUDGET=120
    BENCH_ARGS=(--device cpu --tokens 4 --batch 1 --context 24 --repeats 1)
    HOST_REPEATS=10  # a rehearsal: every row made, none timed with care
else
    BENCH_ARGS=(--quick)
    HOST_REPEATS=300
fi

echo "== info"
"$PY" -m dflash_rocm info --json > "$OUT/info.json" 2> "$OUT/info.err"
"$PY" -m dflash_rocm info | tee "$OUT/info.txt"

echo "== GPU tests (budget ${TEST_BUDGET}s)"
if "$PY" -c "import torch; raise SystemExit(0 if torch.version.hip else 1)" 2>/dev/null; then
    MARK=rocm
else
    MARK=cuda
fi
timeout "$TEST_BUDGET" "$PY" -m pytest tests/test_gpu.py tests/test_host_path.py -m "$MARK" -q -rs -p no:cacheprovider \
    --junitxml="$OUT/pytest.xml" > "$OUT/pytest.log" 2>&1
TEST_RC=$?
tail -n 25 "$OUT/pytest.log"

echo "== bench --host"
timeout 120 "$PY" -m dflash_rocm bench --host --repeats "$HOST_REPEATS" > "$OUT/bench_host.txt" 2> "$OUT/bench_host.err"
HOST_RC=$?

echo "== bench --assumptions (budget ${ASSUME_BUDGET}s)"
ASSUME_ARGS=()
[ "$DRY" = 1 ] && ASSUME_ARGS=(--device cpu)
timeout "$ASSUME_BUDGET" "$PY" -m dflash_rocm bench --assumptions "${ASSUME_ARGS[@]}" \
    --json "$OUT/bench_assumptions.json" > "$OUT/bench_assumptions.txt" 2> "$OUT/bench_assumptions.err"
ASSUME_RC=$?

echo "== bench (budget ${BENCH_BUDGET}s)"
timeout "$BENCH_BUDGET" "$PY" -m dflash_rocm bench "${BENCH_ARGS[@]}" --quiet --json "$OUT/bench.json" \
    --csv "$OUT/bench.csv" --plot "$OUT/bench.png" > "$OUT/bench.txt" 2> "$OUT/bench.err"
BENCH_RC=$?

echo "== vLLM end to end (budget ${VLLM_BUDGET}s)"
VLLM_RC=skipped
if [ "$DRY" = 1 ]; then
    echo "skipped in --dry (tests/test_bench.py runs bench --vllm --quick on CPU)"
elif "$PY" -c "import vllm" > /dev/null 2>&1; then
    timeout "$VLLM_BUDGET" "$PY" -m dflash_rocm bench --vllm --quiet --json "$OUT/bench_vllm.json" \
        > "$OUT/bench_vllm.txt" 2> "$OUT/bench_vllm.err"
    VLLM_RC=$?
else
    echo "vLLM is not importable: skipped"
fi

echo "== summary"
echo "pytest -m $MARK: exit $TEST_RC ($(grep -Eo '[0-9]+ (passed|failed|skipped|error)' "$OUT/pytest.log" | tr '\n' ' '))"
echo "bench --host: exit $HOST_RC"
cat "$OUT/bench_host.txt"
echo "bench --assumptions: exit $ASSUME_RC"
cat "$OUT/bench_assumptions.txt"
[ "$ASSUME_RC" = 0 ] || tail -n 20 "$OUT/bench_assumptions.err"  # the rows made before it stopped
echo "bench --vllm: $VLLM_RC"
[ -s "$OUT/bench_vllm.txt" ] && cat "$OUT/bench_vllm.txt"
echo "bench: exit $BENCH_RC"
cat "$OUT/bench.txt"
# A dry run passes when the GPU tests were collected (and skipped: no GPU) and the bench ran.
if [ "$DRY" = 1 ]; then
    grep -qE '[0-9]+ skipped' "$OUT/pytest.log" || TEST_RC=1
fi
[ "$TEST_RC" = 0 ] && [ "$BENCH_RC" = 0 ] && [ "$HOST_RC" = 0 ] && [ "$ASSUME_RC" = 0 ]
