#!/usr/bin/env bash
# One call on a lent GPU machine (torch, Triton, pytest, hypothesis; no vLLM, no network,
# 600 s a command, 8 files back): this checkout installed into a scratch folder and imported
# from there only, then, each step under its own timeout inside one budget:
#   1. dflash-rocm bench --assumptions  the model's assumptions measured beside the model: the
#      eager and graph launch gaps, L2 and DRAM read bandwidth, the TP8 per-rank precompute
#      under the table's and what-if launches, the TP1 precompute and the TP1/TP8 ratio
#   2. dflash-rocm bench --quick        both operations at real shapes beside inspect's model
#   3. dflash-rocm bench --peer PATH    with --peer only: vLLM's own TRITON_ATTN kernel timed
#      beside ours at the same shapes, each checked against the reference, beside both models
#   4. dflash-rocm bench --host         host microseconds per call
#   5. pytest -m cuda|rocm              the GPU tests (tests/test_gpu.py, tests/test_host_path.py)
# then python -m dflash_rocm.gpu_report judges and summarises: it exits 1, naming the step,
# when a step failed, timed out or made nothing (an empty table, an ERROR row, no row of the
# backend the model covers, no GPU test run, a peer case that failed). $OUT (default
# ./gpu-check-out) gets summary.txt, figures.json (every figure), bench.png and logs.tar.gz
# (every step's output): 4 files.
#
#   scripts/gpu_check.sh                    # on the GPU machine
#   scripts/gpu_check.sh --peer peer-src    # and vLLM's kernels beside ours (DFLASH_PEER=PATH too)
#   scripts/gpu_check.sh --dry              # CPU rehearsal (interpreter, tiny shapes): what CI runs
# PYTHON=... picks the interpreter (default python3).
#
# The GPU machine has no vLLM and no network: carry vLLM's kernel files with the working tree.
# Here, once:  pip download --no-deps vllm==0.34.0 -d /tmp/w && unzip -q /tmp/w/vllm-0.34.0-*.whl \
#   'vllm/v1/attention/ops/*.py' 'vllm-0.34.0.dist-info/METADATA' -d peer-src   (peer-src/ is ignored
# by git: name it in the device tool's carry, ~1 MB), then run scripts/gpu_check.sh --peer peer-src.
set -uo pipefail
BUDGET=540  # seconds in all: the GPU machine allows 600 a command
fail() { echo "gpu_check: $*"; exit 1; }

DRY=0 PEER="${DFLASH_PEER:-}"
while [ $# -gt 0 ]; do
    case "$1" in
        --dry) DRY=1 ;;
        --peer) [ $# -ge 2 ] || fail "--peer needs a PATH (an unpacked vLLM tree: the folder holding vllm/)"
                PEER=$2; shift ;;
        *) fail "unknown argument $1 (expected --dry, --peer PATH)" ;;
    esac
    shift
done
# seconds per step; they add up to BUDGET (without --peer the peer step's share goes to the tests)
T_INSTALL=30 T_INFO=40 T_ASSUME=110 T_BENCH=95 T_PEER=90 T_HOST=45 T_TESTS=110 T_REPORT=20
[ -n "$PEER" ] || { T_TESTS=$((T_TESTS + T_PEER)); T_PEER=0; }
echo "budget $BUDGET s (install $T_INSTALL, info $T_INFO, assumptions $T_ASSUME, bench $T_BENCH, peer $T_PEER," \
     "host $T_HOST, tests $T_TESTS, report $T_REPORT)"
# A vLLM tree asked for must hold the kernel files bench --peer times (dflash_rocm/peer/source.py's
# FILES "unified" and its sibling "helpers"): refused here, before anything runs.
if [ -n "$PEER" ]; then
    [ -d "$PEER" ] || fail "--peer $PEER: no such folder (give the folder holding vllm/, see this script's header)"
    PEER="$(cd "$PEER" && pwd)"
    for file in triton_unified_attention.py triton_attention_helpers.py; do
        [ -f "$PEER/vllm/v1/attention/ops/$file" ] \
            || fail "--peer $PEER: vllm/v1/attention/ops/$file not found (give the folder holding vllm/)"
    done
fi
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT="${OUT:-$ROOT/gpu-check-out}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
SCRATCH="$(mktemp -d)"
SITE="$SCRATCH/site" LOGS="$SCRATCH/logs" RUN="$SCRATCH/run"
mkdir -p "$SITE" "$LOGS" "$RUN"
STARTED=$SECONDS

# step NAME SECONDS COMMAND...: runs COMMAND under a timeout from a folder outside the checkout
# (SIGINT first, so pytest cut short still writes what it ran, then SIGKILL 5 s later)
# (so `python -m` cannot import the source tree); its output goes to $LOGS/NAME.out and
# $LOGS/NAME.err, its status, time and limit to $LOGS/steps.tsv.
step() {
    local name=$1 limit=$2 begin=$SECONDS status
    shift 2
    echo "== $name (at most $limit s)"
    (cd "$RUN" && timeout -s INT -k 5 "$((limit - 5))" "$@") > "$LOGS/$name.out" 2> "$LOGS/$name.err"
    status=$?
    printf '%s\t%s\t%s\t%s\n' "$name" "$status" "$((SECONDS - begin))" "$limit" >> "$LOGS/steps.tsv"
    [ "$status" = 0 ] || tail -n 15 "$LOGS/$name.out" "$LOGS/$name.err"
    return "$status"
}

# --- prerequisites: said in one line each, before anything runs --------------------------
"$PY" -c "import torch, triton, pytest, hypothesis" 2>/dev/null \
    || fail "$PY lacks one of torch, triton, pytest, hypothesis: $("$PY" -c 'import torch, triton, pytest, hypothesis' 2>&1 | tail -n 1)"
if [ "$DRY" = 1 ]; then
    export TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES="" HIP_VISIBLE_DEVICES=""
    MARK=cuda
else
    "$PY" -c "import torch; raise SystemExit(0 if torch.cuda.is_available() else 1)" \
        || fail "torch sees no GPU (torch.cuda.is_available() is False): nothing to measure; --dry rehearses on a CPU"
    MARK=$("$PY" -c "import torch; print('rocm' if torch.version.hip else 'cuda')")
fi
export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1  # never the working folder on sys.path

# --- this checkout, installed into the scratch folder and imported from there only --------
# pip builds it with the environment's setuptools (no network) when that is new enough for
# pyproject's license string (>= 77); else the package tree is copied in as the wheel lays it
# out (dflash_rocm/ with backends/ at dflash_rocm/backends; no metadata, which nothing here reads).
if "$PY" -c "import setuptools, sys; sys.exit(int(setuptools.__version__.split('.')[0]) < 77)" 2>/dev/null; then
    step install "$T_INSTALL" "$PY" -m pip install -q --no-deps --no-build-isolation --no-compile --target "$SITE" "$ROOT" \
        || fail "pip install of this checkout failed (above)"
else
    echo "setuptools >= 77 not found: copying the package tree instead of pip install" | tee "$LOGS/install.out"
    [ -d "$ROOT/backends" ] || fail "no backends/ in $ROOT: not a complete checkout"
    cp -R "$ROOT/dflash_rocm" "$SITE/" && rm -f "$SITE/dflash_rocm/backends" && cp -R "$ROOT/backends" "$SITE/dflash_rocm/backends" \
        || fail "copying the package tree failed"
    printf 'install\t0\t0\t%s\n' "$T_INSTALL" >> "$LOGS/steps.tsv"
fi
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
FROM=$(cd "$RUN" && "$PY" -c "import dflash_rocm.backends.triton as b; print(b.__file__)" 2>&1)
case "$FROM" in
    "$SITE"/*) echo "imports from the scratch install: $FROM" ;;
    *) fail "dflash_rocm.backends.triton does not come from the scratch install $SITE: $FROM" ;;
esac

step info "$T_INFO" "$PY" -m dflash_rocm info --check-imports --json \
    || fail "info failed or a backend cannot be imported (above): every row after this would be empty"

if [ "$DRY" = 1 ]; then
    BENCH_ARGS=(--device cpu --tokens 4 --batch 1 --context 24 --repeats 1)
    PEER_ARGS=(--device cpu)
    HOST_REPEATS=10  # a rehearsal: every row made, none timed with care
else
    BENCH_ARGS=(--quick)
    PEER_ARGS=(--repeats 10)
    HOST_REPEATS=300
fi
ASSUME_ARGS=()
[ "$DRY" = 1 ] && ASSUME_ARGS=(--device cpu)

step assumptions "$T_ASSUME" "$PY" -m dflash_rocm bench --assumptions "${ASSUME_ARGS[@]}" --json "$LOGS/assumptions.json"
step bench "$T_BENCH" "$PY" -m dflash_rocm bench "${BENCH_ARGS[@]}" --quiet --json "$LOGS/bench.json" \
    --plot "$OUT/bench.png"
if [ -n "$PEER" ]; then
    step peer "$T_PEER" "$PY" -m dflash_rocm bench --peer "$PEER" "${PEER_ARGS[@]}" --quiet --json "$LOGS/peer.json"
else
    echo "no vLLM tree given (--peer PATH or DFLASH_PEER=PATH; see this script's header)" > "$LOGS/peer.none"
fi
step host "$T_HOST" "$PY" -m dflash_rocm bench --host --repeats "$HOST_REPEATS" --json "$LOGS/host.json"
step tests "$T_TESTS" "$PY" -m pytest "$ROOT/tests/test_gpu.py" "$ROOT/tests/test_host_path.py" -m "$MARK" \
    -q -rs -p no:cacheprovider --rootdir "$ROOT" -c "$ROOT/pyproject.toml" --junitxml="$LOGS/pytest.xml"

echo "== report (took $((SECONDS - STARTED)) s of $BUDGET)"
REPORT_ARGS=()
[ "$DRY" = 1 ] && REPORT_ARGS=(--dry)
(cd "$RUN" && timeout "$T_REPORT" "$PY" -m dflash_rocm.gpu_report "$LOGS" "$OUT" "${REPORT_ARGS[@]}")
STATUS=$?
tar -czf "$OUT/logs.tar.gz" -C "$SCRATCH" logs
rm -rf "$SCRATCH"
exit "$STATUS"
