#!/usr/bin/env bash
# Set up a virtual environment, lint and type-check, and run the test suite.
# CI runs exactly this (.ci/run). torch 2.13.0 is pinned: on CPU machines it is the small CPU build.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
# Bytecode is written as modules are first imported, into one folder inside
# the venv (nothing lands in the source tree), instead of pip compiling all of
# torch, Ray and pandas up front: about 50 s of one core on the 2-core CI
# machine, for files the suite mostly never imports. Writing is turned on even
# where PYTHONDONTWRITEBYTECODE is set: without bytecode every process that
# imports torch would compile it again (about 4 s each).
export PYTHONPYCACHEPREFIX="$PWD/.venv/pycache"
unset PYTHONDONTWRITEBYTECODE
# A step that fails ends the script: stop what still runs beside it.
wheels=""
trap 'kill $(jobs -p) 2>/dev/null || true; [ -z "$wheels" ] || rm -rf "$wheels"' EXIT
# uv installs everything: it downloads and unpacks in parallel, 12 s on the
# 2-core CI machine where pip took 50 (Ray, the test tools and the editable
# build). uv reads none of pip's configuration (mirrors, find-links,
# certificates), and this machine's pip configuration says where the CPU build
# of torch 2.13.0 lies, so pip chooses torch's wheel and fetches it (a copy,
# where it lies on disk), beside the install of uv itself, and uv installs
# that file. Where uv cannot be installed, or a step fails, pip installs it
# all, as before. scripts/min_versions.sh uses the same choice (CUDA_RUNNER_UV).
pip_install=(.venv/bin/python -m pip install --quiet --no-compile)
wheels=$(mktemp -d)
.venv/bin/python -m pip download --quiet --no-deps --dest "$wheels" "torch==2.13.0" >/dev/null 2>&1 &
torch_download=$!
export CUDA_RUNNER_UV=""
if "${pip_install[@]}" "uv>=0.5,<1" >/dev/null 2>&1; then
  CUDA_RUNNER_UV="$PWD/.venv/bin/uv"
fi
uv_install() { [ -n "$CUDA_RUNNER_UV" ] && "$CUDA_RUNNER_UV" pip install --quiet --python .venv/bin/python "$@"; }
# Jobs that only have to end before the suite does run at a lower priority
# (nice): they take what the install and the suite leave idle (a worker
# waiting on a lock, the last test running alone) instead of slowing what
# everything else waits for.
background=(nice -n 10)
# The lowest allowed dependency versions, without torch, in a venv of their
# own: beside the install and the suite.
"${background[@]}" bash scripts/min_versions.sh > .venv-min.log 2>&1 &
minimum=$!
torch_wheel=""
if wait "$torch_download"; then
  for wheel in "$wheels"/torch-*.whl; do [ -e "$wheel" ] && torch_wheel=$wheel; done
fi
# NumPy with it: torch's import, which the warm-up below runs, looks for it.
if [ -z "$torch_wheel" ] || ! uv_install "$torch_wheel" numpy; then
  "${pip_install[@]}" "torch==2.13.0" numpy
fi
rm -rf "$wheels"
# torch's bytecode, written once beside the rest of the install: otherwise the
# suite's first processes (both workers, and the compiles they start) each
# compile the same files at once, about 16 s of a core each (see the script).
.venv/bin/python scripts/warm_bytecode.py torch > .venv/warm-torch.log 2>&1 &
warm_torch=$!
if ! uv_install -e ".[test,ray]"; then
  "${pip_install[@]}" -e ".[test,ray]"
fi
installed=$SECONDS
# Ray's bytecode, for its workers, which start together: at the normal
# priority, since it has to be written before the Ray test runs.
.venv/bin/python scripts/warm_bytecode.py ray > .venv/warm-ray.log 2>&1 &
.venv/bin/ruff check cuda_runner tests scripts examples
# The type check beside the suite (one core for about 30 s), judged at the end.
"${background[@]}" .venv/bin/mypy > .venv/mypy.log 2>&1 &
types=$!
wait "$warm_torch" || true  # only a warm-up
started=$SECONDS
set +e
# Two workers: the 2-core CI machine compiles fixtures and runs subprocesses side by side.
.venv/bin/python -m pytest -n "${PYTEST_WORKERS:-2}" --dist loadgroup "$@"
status=$?
tested=$SECONDS
wait "$types"
types_status=$?
wait "$minimum"
minimum_status=$?
cat .venv/mypy.log
tail -n 3 .venv-min.log
# Where the time went (the minimum-versions check's own time is in its last line).
echo "test.sh: install $installed s, torch bytecode and lint until $started s, suite $((tested - started)) s, all $SECONDS s"
set -e
if [ "$types_status" -ne 0 ]; then
  echo "type check failed (mypy)" >&2
  exit 1
fi
if [ "$minimum_status" -ne 0 ]; then
  echo "minimum-versions check failed (scripts/min_versions.sh):" >&2
  cat .venv-min.log >&2
  exit 1
fi
if [ "$status" -eq 5 ]; then
  echo "pytest collected no tests: failing on purpose" >&2
  exit 1
fi
exit "$status"
