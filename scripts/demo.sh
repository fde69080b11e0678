#!/usr/bin/env bash
# Set up a virtual environment and run the demo: compile an example model for the
# device present (CUDA when this machine has a GPU and CuPy, else CPU) and run it.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
extras="torch"
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  cuda_major=$(nvidia-smi | sed -n 's/.*CUDA Version: \([0-9]*\).*/\1/p' | head -n1)
  extras="torch,cuda${cuda_major:-12}"
  .venv/bin/python -m pip install --quiet -e ".[$extras]"
else
  # A CPU-only machine: the CPU build of torch keeps the install small.
  .venv/bin/python -m pip install --quiet "torch==2.13.0" -e ".[$extras]"
fi
exec .venv/bin/python examples/demo.py "${1:-demo-out}"
