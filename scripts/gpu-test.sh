#!/usr/bin/env bash
# The whole GPU suite in one call, for the GPU test machine (shared/docs/gpu-machine.md).
# Runs from the source tree without installing. Logs go to $OUT when it is set.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-$PWD/gpu-out}"
mkdir -p "$out"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 -c 'import torch, cupy, numpy; print("torch", torch.__version__, "cupy", cupy.__version__, "numpy", numpy.__version__, "gpu", torch.cuda.get_device_name(0))' | tee "$out/versions.txt"
python3 -X faulthandler -m pytest -m gpu tests/gpu -p no:cacheprovider -rA -s ${GPU_TEST_ARGS:-} 2>&1 | tee "$out/gpu-tests.log"
status=${PIPESTATUS[0]}
if [ "${GPU_BENCH:-1}" = 1 ] && [ -f scripts/bench_compare.py ]; then
  python3 -X faulthandler scripts/bench_compare.py --device cuda --output "$out/bench-gpu.json" 2>&1 | tee "$out/bench-gpu.log"
fi
exit "$status"
