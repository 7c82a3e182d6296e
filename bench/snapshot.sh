#!/bin/bash
# A frozen copy of HEAD, with the native library built here, importable as `hetspec`: a bench
# run from it cannot see the working tree change under it (a worker started after a protocol
# bump once spoke a newer protocol than the daemon that started it).
#
#   bench/snapshot.sh [DIR]      (default /tmp/hetspec-snapshot; prints the PYTHONPATH to use)
#   cd DIR && PYTHONPATH=DIR/site .venv/bin/python -m hetspec.bench.parallel_clients ...
#
# Run from DIR, not from DIR/repo or the repository: Python puts the working directory first
# on its path, and a `hetspec/` folder there (the repository's own) would be imported instead
# of DIR/site/hetspec, its subpackages then found by the editable install's finder, in the
# working tree.
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
# where the daemon's code comes from, as a bench run from $out imports it
where=$(cd "$out" && PYTHONPATH="$out/site" "$repo/.venv/bin/python" -c \
    'import hetspec.daemon, hetspec.workers; print(hetspec.daemon.__file__, hetspec.workers.__file__)')
case "$where" in
"$out"/*" $out"/*) ;;
*) echo "the snapshot does not import as hetspec: $where" >&2; exit 1 ;;
esac
echo "PYTHONPATH=$out/site (run from $out)"
