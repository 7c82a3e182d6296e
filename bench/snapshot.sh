#!/bin/bash
# A frozen copy of HEAD, with the native library built here, importable as `hetspec`: a bench
# run from it cannot see the working tree change under it (a worker started after a protocol
# bump once spoke a newer protocol than the daemon that started it).
#
#   bench/snapshot.sh [DIR]      (default /tmp/hetspec-snapshot; prints the PYTHONPATH to use)
#   cd DIR/repo && PYTHONPATH=DIR/site .venv/bin/python -m hetspec.bench.parallel_clients ...
set -euo pipefail
out=${1:-/tmp/hetspec-snapshot}
repo=$(cd "$(dirname "$0")/.." && pwd)
rm -rf "$out"
mkdir -p "$out/repo" "$out/site/hetspec"
git -C "$repo" archive HEAD | tar -x -C "$out/repo"
cp "$repo"/native/_hsnative*.so "$out/repo/native/"
cp -r "$out/repo/hetspec/." "$out/site/hetspec/"
# the installed names (hetspec.daemon, ...) point at the snapshot's top-level folders
for pkg in bench client daemon models native protocol speculative workers; do
    ln -s "$out/repo/$pkg" "$out/site/hetspec/$pkg"
done
echo "PYTHONPATH=$out/site"
