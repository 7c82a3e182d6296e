#!/usr/bin/env bash
# A folder of wheels that installs hetspec on a box with no network (`make wheelhouse`):
#
#   native/build-wheelhouse.sh VENV_PYTHON OUT [BACKEND] [EXTRAS]
#
# OUT receives hetspec's own wheel (its native kernels compiled here), a wheel of every pinned
# dependency (constraints.txt), llama-cpp-python built for BACKEND (as install-llama-cpp.sh
# builds it: cpu, cpu-portable, cuda, ...), and INSTALL.txt with the command that installs it.
# EXTRAS (default: none) adds hetspec's optional groups, e.g. "bench" or "test,bench".
#
# Wheels are for this machine's Python version and platform: build on a box like the target
# (same Python minor version, same CPU architecture; for BACKEND=cpu, the same CPU features,
# or use cpu-portable). The target box then needs only Python and pip:
#
#   python3 -m venv /opt/hetspec && /opt/hetspec/bin/pip install --no-index \
#       --find-links OUT -r OUT/requirements.txt
set -euo pipefail

python=${1:?usage: $0 VENV_PYTHON OUT [BACKEND] [EXTRAS]}
out=${2:?usage: $0 VENV_PYTHON OUT [BACKEND] [EXTRAS]}
backend=${3:-cpu}
extras=${4:-}
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
constraints="$root/constraints.txt"

unset SOURCE_DATE_EPOCH  # see install-llama-cpp.sh: it switches llama.cpp's SIMD off
args=$("$here/llama-cmake-args.sh" "$backend")
mkdir -p "$out"
out=$(cd "$out" && pwd)
start=$SECONDS

echo "hetspec's wheel (with its native kernels) ..."
rm -f "$out"/hetspec-*.whl
"$python" -m pip wheel -q --no-deps --no-build-isolation -w "$out" "$root"

# llama-cpp-python alone first: the backend's CMake options apply to its build only, and a
# wheel cached for another backend must not be reused (pip's cache key is the source only)
echo "llama-cpp-python for '$backend' (CMAKE_ARGS=$args; a first build takes minutes) ..."
rm -f "$out"/llama_cpp_python-*.whl
cache=()
[[ "$backend" == cpu ]] || cache=(--no-cache-dir)
CMAKE_ARGS="$args" "$python" -m pip wheel -q --no-deps "${cache[@]}" -c "$constraints" \
    -w "$out" llama-cpp-python

requirement="hetspec${extras:+[$extras]}"
echo "every other dependency of $requirement, as pinned ..."
wheel=$(ls "$out"/hetspec-*.whl)
"$python" -m pip wheel -q -c "$constraints" --find-links "$out" -w "$out" \
    "$requirement @ file://$wheel"

# what the offline box installs: hetspec (with its extras) at this version, its dependencies
# at the pinned versions, from the folder alone
version=$(basename "$wheel" | cut -d- -f2)
cp "$constraints" "$out/constraints.txt"
printf '%s\n' "$requirement==$version" "-c constraints.txt" > "$out/requirements.txt"
cat > "$out/INSTALL.txt" <<EOF
hetspec $version wheelhouse: $(uname -m), $("$python" -c 'import sys; print(f"Python {sys.version_info[0]}.{sys.version_info[1]}")'), llama.cpp backend '$backend'
Install with no network:
  python3 -m venv /opt/hetspec
  /opt/hetspec/bin/pip install --no-index --find-links $out -r $out/requirements.txt
EOF
echo "$(ls "$out"/*.whl | wc -l) wheels, $(du -sh "$out" | cut -f1), in $out ($((SECONDS - start)) s); see INSTALL.txt"
