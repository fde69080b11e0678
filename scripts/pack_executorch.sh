#!/usr/bin/env bash
# Pack ExecuTorch's export side for the GPU machine, which has no registry:
# the executorch wheel without its runtime libraries, tests and other
# backends (only aoti, cuda and transforms are kept), plus the pure-Python
# packages its export imports that the GPU image lacks. 19 MB of wheel becomes
# a 5 MB archive, small enough to travel beside the tree and its test data.
# scripts/gpu-test.sh unpacks .gpu-et/*.tar.gz onto PYTHONPATH.
#
#   bash scripts/pack_executorch.sh 1.5.1     # writes .gpu-et/executorch-1.5.1-export.tar.gz
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
version="${1:-1.5.1}"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
  -d "$work/wheels" "executorch==$version" ruamel.yaml ruamel.yaml.clib expecttest parameterized
mkdir -p "$work/tree"
for wheel in "$work"/wheels/*.whl; do unzip -qo "$wheel" -d "$work/tree"; done
cd "$work/tree/executorch"
for backend in backends/*/; do
  case "$backend" in backends/aoti/|backends/cuda/|backends/transforms/) ;; *) rm -rf "$backend" ;; esac
done
find . -type d \( -name test -o -name tests \) -prune -exec rm -rf {} +
rm -f lib/*.so extension/llm/runner/*.so extension/llm/custom_ops/*.so extension/pybindings/*.so
mkdir -p "$repo/.gpu-et"
tar -czf "$repo/.gpu-et/executorch-$version-export.tar.gz" -C "$work/tree" .
ls -la "$repo/.gpu-et/executorch-$version-export.tar.gz"
