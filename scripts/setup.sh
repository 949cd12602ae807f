#!/usr/bin/env bash
# Creates .venv and installs gossipnet with its test, fast and docs extras.
# Why explicit torch: a loose "torch" requirement pulls a multi-GB CUDA build;
# on a machine without an NVIDIA GPU we install the CPU build of the pinned release.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
VENV=${VENV:-.venv}
stamp="$VENV/.gossipnet-setup"
if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ] && [ "$stamp" -nt scripts/setup.sh ]; then
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    "${pip[@]}" "torch==${TORCH_VERSION}"
  else
    # CPU machine: the +cpu local build (present in local wheel caches), else PyTorch's CPU index.
    "${pip[@]}" "torch==${TORCH_VERSION}+cpu" 2>/dev/null \
      || "${pip[@]}" "torch==${TORCH_VERSION}" \
           --index-url "${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"
  fi
fi
"${pip[@]}" -e ".[test,fast,docs]"
# The network-namespace testbed needs nftables and iproute2 (root only); its tests skip
# with a reason where they cannot run, so a failure here is not fatal.
bash scripts/install-testbed-deps.sh || echo "testbed tools not installed; its tests will skip"
touch "$stamp"
