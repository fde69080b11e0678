#!/usr/bin/env bash
# The whole GPU suite in one call, for a machine with a GPU:
# the tests marked gpu, a cold-start profile, the cost of the library's input
# checks and of signature checks, and the side-by-side GPU benchmark.
# Runs from the source tree without installing. Logs go to $OUT when it is set.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -n "${GPU_REQUIRE:-}" ]; then
  # GPU_REQUIRE=H200: run only on a GPU whose name holds this (figures are per card, and a goal may
  # be set for one); on any other, stop before anything is built or run, with status 3.
  gpu_name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)
  case "$gpu_name" in
    *"$GPU_REQUIRE"*) ;;
    *) echo "GPU_REQUIRE=$GPU_REQUIRE: this machine's GPU is ${gpu_name:-not found}; nothing was run"; exit 3 ;;
  esac
fi
out="${OUT:-$PWD/gpu-out}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# cuda-runner's own shim, as pip would build it (the tree is not installed here);
# GPU_BUILD=0 where it is built already and other processes are using it.
if [ "${GPU_BUILD:-1}" = 1 ]; then
  python3 setup.py build_ext --inplace -q > "$out/build-shim.log" 2>&1 || echo "building the shim failed (see build-shim.log)"
fi
# Bytecode for the package, as pip install leaves it: the GPU machines set
# PYTHONDONTWRITEBYTECODE, so otherwise every cold process compiles every module.
python3 -m compileall -q cuda_runner > /dev/null
python3 -c 'import torch, cupy, numpy, typer; print("torch", torch.__version__, "cupy", cupy.__version__, "numpy", numpy.__version__, "typer", typer.__version__, "gpu", torch.cuda.get_device_name(0))' | tee "$out/versions.txt"
# Wheels carried to a machine without registry access, installed into private
# folders: .gpu-wheels/ (cryptography, for the signing tests), .gpu-et/ (an
# ExecuTorch wheel, or scripts/pack_executorch.sh's archive of its export side;
# real programs are then exported on this GPU) and
# .gpu-et14/ (an older ExecuTorch, which exports a part of the zoo in its own
# layout). The ExecuTorch wheels are large: carry them only when exporting.
pkgs="${TMPDIR:-/tmp}/cuda-runner-gpu-pkgs"
if ls .gpu-wheels/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-deps --target "$pkgs" .gpu-wheels/*.whl 2>&1 | tail -2
  export PYTHONPATH="$PYTHONPATH:$pkgs" PATH="$pkgs/bin:$PATH"
fi
et=""
if compgen -G ".gpu-et/*.whl" >/dev/null || compgen -G ".gpu-et/*.tar.gz" >/dev/null; then
  # Wheels, or the export-only archive scripts/pack_executorch.sh makes (small enough to travel with the test data).
  et="${TMPDIR:-/tmp}/cuda-runner-et"
  mkdir -p "$et"
  for archive in .gpu-et/*.tar.gz; do [ -e "$archive" ] && tar -xzf "$archive" -C "$et"; done
  if ls .gpu-et/*.whl >/dev/null 2>&1; then python3 -m pip install -q --no-deps --target "$et" .gpu-et/*.whl 2>&1 | tail -2; fi
fi
if [ "${GPU_ET_EXPORT:-1}" = 1 ] && [ -n "$et" ]; then
  PYTHONPATH="$PYTHONPATH:$et" python3 scripts/make_et_program.py --out-dir "$out/et_two_io" > "$out/et-export.log" 2>&1
  tail -1 "$out/et-export.log"
  [ -f "$out/et_two_io/model.pte" ] && export CUDA_RUNNER_ET_EXTRA="$out/et_two_io"
fi
if [ -n "${GPU_ET14_ZOO:-}" ] && ls .gpu-et14/*.whl >/dev/null 2>&1; then
  # GPU_ET14_ZOO: the zoo programs to export with it (make_et_zoo.py --only), packed as one archive.
  et14="${TMPDIR:-/tmp}/cuda-runner-et14"
  python3 -m pip install -q --no-deps --target "$et14" .gpu-et14/*.whl 2>&1 | tail -2
  zoo="${TMPDIR:-/tmp}/zoo_et141_torch211"
  PYTHONPATH="$PYTHONPATH:$et14" python3 scripts/make_et_zoo.py --out-dir "$zoo" --et-version-tag et141 --only "$GPU_ET14_ZOO" \
    --jobs 4 > "$out/et14-zoo.log" 2>&1
  tail -3 "$out/et14-zoo.log"
  tar -czf "$out/zoo_et141.tar.gz" -C "$(dirname "$zoo")" "$(basename "$zoo")" && ls -la "$out/zoo_et141.tar.gz"
fi
status=0
# scripts/bench_scale.py's stages (GPU_SCALE), with ExecuTorch's export side where it was carried.
scale_stages() {
  PYTHONPATH="$PYTHONPATH${et:+:$et}" python3 -X faulthandler scripts/bench_scale.py --stages "$1" \
    --work "${GPU_SCALE_WORK:-/tmp/cuda-runner-scale}" --out "$out" ${GPU_SCALE_ARGS:-} 2>&1 | tee -a "$out/scale.log"
}
scale_left="${GPU_SCALE:-}" compiling=""
scale_left="${scale_left// /}"
if [ "${GPU_SCALE_BESIDE:-0}" = 1 ] && [ "${GPU_TESTS:-1}" = 1 ] && [[ ",$scale_left," == *,compile,* ]]; then
  # GPU_SCALE_BESIDE=1: the compile stage beside the tests (mostly Inductor on the CPU, whose cores
  # the tests leave idle, with some tuning on the GPU), the timed stages after both, with the GPU to
  # themselves; the whole-device tests wait for the compile too.
  scale_stages compile > /dev/null &
  compiling=$!
  scale_left=$(echo ",$scale_left," | sed 's/,compile,/,/; s/^,//; s/,$//')
fi
if [ "${GPU_TESTS:-1}" = 1 ]; then
  # On GPU_WORKERS processes where pytest-xdist is installed (it can travel in
  # .gpu-wheels/): the suite's compiles take minutes one after another. Tests
  # that measure the whole GPU then run with nothing beside them.
  parallel=() alone=()
  if python3 -c "import xdist" 2>/dev/null; then
    # -n 0 last: the whole-device run stays one process whatever GPU_TEST_ARGS asks.
    alone=(-n 0)
    case "${GPU_WORKERS:-8}" in 0|1) ;; *) parallel=(-n "${GPU_WORKERS:-8}" --dist loadgroup) ;; esac
  fi
  python3 -X faulthandler -m pytest -m "(gpu or triton) and not whole_device" tests -p no:cacheprovider -p no:logging -rA -s ${parallel[@]+"${parallel[@]}"} \
    ${GPU_TEST_ARGS:-} 2>&1 | tee "$out/gpu-tests.log"
  main=${PIPESTATUS[0]}
  [ -z "$compiling" ] || wait "$compiling" || echo "the scale benchmarks' compile stage failed (see scale.log)"
  python3 -X faulthandler -m pytest -m "gpu and whole_device" tests -p no:cacheprovider -p no:logging -rA -s ${GPU_TEST_ARGS:-} \
    ${alone[@]+"${alone[@]}"} 2>&1 | tee "$out/gpu-tests-whole-device.log"
  whole=${PIPESTATUS[0]}
  # 5: pytest collected none (GPU_TEST_ARGS selected tests of one kind only); a failure only where both did.
  case "$main/$whole" in 0/0|0/5|5/0) status=0 ;; *) status=1 ;; esac
  # The shim's vector math on this machine's CPU too: the AVX-512 entry points, which the CI machines cannot run.
  python3 -m pytest tests/runtime/test_vector_math.py -q -p no:cacheprovider 2>&1 | tail -3 | tee "$out/vector-math.log"
fi
# The environment without torch, on a CPU that can run the ExecuTorch CPU
# stand-ins (their libraries need AVX-512, which the CI machines lack).
if [ "${GPU_NO_TORCH_ENV:-1}" = 1 ]; then
  python3 -X faulthandler -m pytest tests/runtime/test_no_torch_env.py -p no:cacheprovider -rA 2>&1 | tee "$out/no-torch-env.log"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
if [ "${GPU_SHARED_WEIGHTS:-0}" = 1 ]; then
  python3 -X faulthandler scripts/bench_shared_weights.py --device cuda --json "$out/shared-weights.json" 2>&1 | tee "$out/shared-weights.log"
fi
[ "${GPU_COLDSTART:-1}" = 1 ] && {
  echo "== import cost (s)"
  for module in numpy typer rich cupy cupy_backends.cuda.api.runtime; do
    python3 -c "import time; t=time.perf_counter(); import $module; print('$module', round(time.perf_counter()-t, 3))"
  done
  echo "== a cold CLI run, slowest imports (cumulative microseconds)"
  python3 -m cuda_runner compile --help >/dev/null
  python3 - <<'PY'
import numpy as np, subprocess, sys, tempfile, pathlib
import cuda_runner, torch
from torch.export import Dim
work = pathlib.Path(tempfile.mkdtemp())
module = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8)).eval()
x = torch.randn(4, 16)
cuda_runner.compile_module(module, (x,), work / "m.bundle", device="cuda", dynamic_shapes={"input": {0: Dim("batch", max=64)}})
np.savez(work / "in.npz", input=x.numpy())
run = [sys.executable, "-X", "importtime", "-m", "cuda_runner", "run", str(work / "m.bundle"), "-i", str(work / "in.npz"), "-q"]
result = subprocess.run(run, capture_output=True, text=True)
rows = [line.split("|") for line in result.stderr.splitlines() if line.startswith("import time:") and "|" in line]
rows = sorted(((int(row[1]), row[2].rstrip()) for row in rows[1:]), reverse=True)[:12]
for cumulative, name in rows:
    print(f"{cumulative:>9} {name}")
PY
} 2>&1 | tee "$out/coldstart.txt"
if [ "${GPU_CHECKS:-1}" = 1 ]; then
  python3 -X faulthandler scripts/bench_checks.py --device cuda --output "$out/checks.json" 2>&1 | tee "$out/checks.log"
  python3 -X faulthandler scripts/bench_signing.py --device cuda --weights-gib 1 --output "$out/signing.json" 2>&1 | tee "$out/signing.log"
fi
if [ "${GPU_STANDALONE:-0}" = 1 ]; then
  # The zoo (and with GPU_STANDALONE_HF=1 three tiny Hugging Face models), compiled the default way (standalone) and --libtorch.
  python3 -X faulthandler scripts/bench_standalone.py --output "$out/standalone.json" --markdown "$out/standalone.md" \
    ${GPU_STANDALONE_HF:+--hf} 2>&1 | tee "$out/standalone.log"
fi
if [ -n "$scale_left" ]; then
  # GPU_SCALE: the stages of scripts/bench_scale.py to run (compile,check,load,decode,big,whisper), GPU_SCALE_ARGS more of its
  # arguments (--builds default,libtorch); WORK kept between calls on a warm
  # machine. With ExecuTorch's wheels carried (.gpu-et/), the compile stage also exports the 1B decoder as an ExecuTorch program.
  scale_stages "$scale_left"
fi
if [ "${GPU_FLOOR:-0}" = 1 ]; then
  # The MLP --standalone: per call beside the C program, layer by layer, and a cold no-torch CLI run broken down.
  python3 -X faulthandler scripts/bench_standalone.py --floor-only --device cuda --iterations 2000 --cold --cold-rounds "${GPU_FLOOR_ROUNDS:-7}" \
    > "$out/floor.out" 2> "$out/floor.err"
  tail -12 "$out/floor.out"; grep -A16 "cold CLI" "$out/floor.err"
fi
if [ "${GPU_BENCH:-1}" = 1 ]; then
  python3 -X faulthandler scripts/bench_per_call.py --output "$out/per-call.json" 2>&1 | tee "$out/per-call.log"
  python3 -X faulthandler scripts/bench_compare.py --device cuda --output "$out/bench-gpu.json" --markdown "$out/bench-gpu.md" ${GPU_BENCH_ARGS:-} 2>&1 | tee "$out/bench-gpu.log"
fi
exit "$status"
