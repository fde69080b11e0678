#!/usr/bin/env bash
# The lowest versions pyproject.toml allows for the run-time dependencies (and
# typer 0.27, whose option naming differs), without torch: the CLI parses every
# command's options, refuses bad input with its exit codes, and reads, inspects
# and converts a real ExecuTorch program. scripts/test.sh (CI) runs this beside
# the install and the suite.
set -euo pipefail
cd "$(dirname "$0")/.."
here="$PWD"
venv="$PWD/.venv-min"
python3 -m venv "$venv"
# uv where scripts/test.sh chose it (CUDA_RUNNER_UV: faster, and no bytecode
# compiled up front), else pip; pip again if uv cannot install them.
pip_install=("$venv/bin/python" -m pip install --quiet)
install_pinned() {
  if [ -n "${CUDA_RUNNER_UV:-}" ] && "$CUDA_RUNNER_UV" pip install --quiet --python "$venv/bin/python" "$@"; then
    return
  fi
  "${pip_install[@]}" "$@"
}
install_pinned "numpy==1.24.0" "ml_dtypes==0.3.0" "xxhash==3.2.0" "rich==13.0.0" "typer==0.21.1"
program="$PWD/tests/data/executorch/standin_g3/model.pte"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# cuda-runner itself runs from a copy of this tree's sources, without its
# native shim: installing it would build the shim a second time (15 s of a core
# beside the suite), and the shim that the main install builds into the tree
# meanwhile must not be read half-written. Nothing here needs it.
"$venv/bin/python" -c "import shutil, sys; shutil.copytree('cuda_runner', sys.argv[1], ignore=shutil.ignore_patterns('*.so', '__pycache__'))" "$work/src/cuda_runner"
export PYTHONPATH="$work/src${PYTHONPATH:+:$PYTHONPATH}"
cd "$work"  # `python -m` puts the working directory first on the path: not the tree's cuda_runner
"$venv/bin/python" -c "import cuda_runner, sys; assert cuda_runner.__file__.startswith(sys.argv[1]), cuda_runner.__file__" "$work/src"
check() {  # check EXPECTED_EXIT COMMAND...
  local expected=$1; shift
  set +e
  "$venv/bin/python" -m cuda_runner "$@" >"$work/out" 2>"$work/err"
  local code=$?
  set -e
  if [ "$code" != "$expected" ] || grep -q Traceback "$work/err"; then
    echo "FAILED ($code, wanted $expected): cuda-runner $*" >&2
    cat "$work/err" >&2
    exit 1
  fi
}
"$venv/bin/python" -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1], 'w').close()" "$work/empty.pt2"
for typer_version in 0.21.1 0.27.2; do
  install_pinned "typer==$typer_version"
  # In fresh processes: `python -m cuda_runner` starting, and a compile that finds no torch.
  check 0 --help
  check 4 compile "$work/empty.pt2" --device cuda -o "$work/m.bundle"
  # The rest in one interpreter (every command's help, refusals with their
  # exit codes, reading a real ExecuTorch program): see the script.
  "$venv/bin/python" "$here/scripts/min_versions_check.py" "$work" "$program"
  echo "minimum versions with typer $typer_version: ok"
done
echo "minimum versions: done in $SECONDS s"
