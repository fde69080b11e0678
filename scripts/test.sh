#!/usr/bin/env bash
# Set up a virtual environment, lint and type-check, and run the test suite.
# CI runs exactly this (.ci/run). torch 2.13.0 is pinned: on CPU machines it is the small CPU build.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install --quiet "torch==2.13.0" -e ".[test,ray]"
.venv/bin/ruff check cuda_runner tests scripts examples
.venv/bin/mypy
set +e
# The lowest allowed dependency versions, without torch, beside the suite (mostly downloads).
bash scripts/min_versions.sh > .venv-min.log 2>&1 &
minimum=$!
# Two workers: the 2-core CI machine compiles fixtures and runs subprocesses side by side.
.venv/bin/python -m pytest -n "${PYTEST_WORKERS:-2}" --dist loadgroup "$@"
status=$?
wait "$minimum"
minimum_status=$?
tail -n 3 .venv-min.log
set -e
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
