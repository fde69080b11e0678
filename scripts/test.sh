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
# Two workers: the 2-core CI machine compiles fixtures and runs subprocesses side by side.
.venv/bin/python -m pytest -n "${PYTEST_WORKERS:-2}" --dist loadgroup "$@"
status=$?
set -e
if [ "$status" -eq 5 ]; then
  echo "pytest collected no tests: failing on purpose" >&2
  exit 1
fi
exit "$status"
