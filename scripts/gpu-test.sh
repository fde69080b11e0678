#!/usr/bin/env bash
# The whole GPU suite in one call, for the GPU test machine (shared/docs/gpu-machine.md):
# the tests marked gpu, a cold-start profile, and the side-by-side GPU benchmark.
# Runs from the source tree without installing. Logs go to $OUT when it is set.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-$PWD/gpu-out}"
mkdir -p "$out"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 -c 'import torch, cupy, numpy, typer; print("torch", torch.__version__, "cupy", cupy.__version__, "numpy", numpy.__version__, "typer", typer.__version__, "gpu", torch.cuda.get_device_name(0))' | tee "$out/versions.txt"
python3 -X faulthandler -m pytest -m gpu tests/gpu -p no:cacheprovider -p no:logging -rA -s ${GPU_TEST_ARGS:-} 2>&1 | tee "$out/gpu-tests.log"
status=${PIPESTATUS[0]}
{
  echo "== import cost (s)"
  for module in numpy typer rich cupy cupy_backends.cuda.api.runtime; do
    python3 -c "import time; t=time.perf_counter(); import $module; print('$module', round(time.perf_counter()-t, 3))"
  done
} 2>&1 | tee "$out/coldstart.txt"
if [ "${GPU_BENCH:-1}" = 1 ]; then
  python3 -X faulthandler scripts/bench_compare.py --device cuda --output "$out/bench-gpu.json" --markdown "$out/bench-gpu.md" ${GPU_BENCH_ARGS:-} 2>&1 | tee "$out/bench-gpu.log"
fi
exit "$status"
