#!/usr/bin/env bash
# What a GPU machine with no network needs to run hetspec's tests and bench, in one folder
# small enough to carry (the device tool takes 64 MiB per call):
#
#   native/device-bundle.sh [OUT] [PYTHON_VERSION]      (default .device, 3.12)
#
# OUT/wheels        wheels, for PYTHON_VERSION on manylinux x86-64, of the pinned packages such
#                   a machine's image lacks (its Python already holds torch, numpy, aiohttp, ...)
# OUT/llama-server/sdist/llama_cpp_python-VERSION.tar.gz
#                   the pinned llama-cpp-python source, trimmed of what no build of ours reads
#                   (llama.cpp's vocabulary test files, docs, tests, benches, other backends):
#                   77 MB -> about 12 MB. Both llama-cpp-python and llama-server build from it.
# OUT/llama_cpp_python.tar.gz
#                   the llama-cpp-python installed here (CPU build), unpacked there by
#                   native/gpu-checks.sh, which builds only llama-server for CUDA
# OUT/install.sh    run there, from the repository's root: installs the wheels, builds
#                   llama-cpp-python for CUDA, installs hetspec (editable, its C kernels built
#                   for that Python) and builds llama-server for CUDA from the same source.
#
# OUT is meant to be git-ignored and carried: run(command="bash .device/install.sh && ...",
# carry=[".device"]).
set -euo pipefail

out=${1:-.device}
python_version=${2:-3.12}
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
constraints="$root/constraints.txt"
pip=("${PIP_PYTHON:-$root/.venv/bin/python}" -m pip)
# the pinned packages the GPU machine's image does not hold (device tool's KINDS.md)
missing=(msgspec pyzmq structlog gguf diskcache pytest-asyncio)

pin() { sed -n "s/^$1==//Ip" "$constraints" | head -1; }
mkdir -p "$out/wheels" "$out/llama-server/sdist"
out=$(cd "$out" && pwd)

requirements=()
for name in "${missing[@]}"; do
  version=$(pin "$name")
  [[ -n "$version" ]] || { echo "device-bundle: $name is not pinned in constraints.txt" >&2; exit 1; }
  requirements+=("$name==$version")
done
echo "wheels for Python $python_version: ${requirements[*]}"
"${pip[@]}" download -q --no-deps -d "$out/wheels" --python-version "$python_version" \
    --only-binary=:all: --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_17_x86_64 "${requirements[@]}"

version=$(pin llama-cpp-python)
name="llama_cpp_python-$version"
trimmed="$out/llama-server/sdist/$name.tar.gz"
if [[ ! -f "$trimmed" ]]; then
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  echo "llama-cpp-python $version source, trimmed ..."
  "${pip[@]}" download -q --no-deps --no-binary :all: -d "$work" "llama-cpp-python==$version"
  tar xzf "$work/$name.tar.gz" -C "$work"
  vendor="$work/$name/vendor/llama.cpp"
  rm -rf "$vendor"/{models,docs,benches,tests,media,.github} "$work/$name"/{.git,docs,tests,examples}
  for backend in sycl hexagon opencl vulkan cann musa kompute webgpu zdnn blas metal; do
    rm -rf "$vendor/ggml/src/ggml-$backend"
  done
  mkdir -p "$vendor/models"  # CMake lists it as an install destination
  tar czf "$trimmed" -C "$work" "$name"
fi

# llama-cpp-python as installed here (a ctypes package: its libraries do not depend on the
# Python version), for native/gpu-checks.sh: drafting on the CPU needs no CUDA build of it.
site=$("${pip[0]}" -c 'import llama_cpp, pathlib; print(pathlib.Path(llama_cpp.__file__).parents[1])')
tar czf "$out/llama_cpp_python.tar.gz" -C "$site" llama_cpp \
    $(cd "$site" && ls -d llama_cpp_python-*.dist-info)

cat > "$out/install.sh" <<'EOF'
#!/usr/bin/env bash
# On the GPU machine, from the repository's root, with the bundle at .device (no network).
set -euo pipefail
bundle=$(cd "$(dirname "$0")" && pwd)
python=${PYTHON:-python3}
"$python" -m pip install -q --no-index --find-links "$bundle/wheels" "$bundle"/wheels/*.whl
sdist=$(ls "$bundle"/llama-server/sdist/llama_cpp_python-*.tar.gz)
if ! "$python" -c 'import llama_cpp; assert llama_cpp.llama_supports_gpu_offload()' 2>/dev/null; then
  echo "building llama-cpp-python for CUDA (minutes) ..."
  CMAKE_ARGS="$(native/llama-cmake-args.sh cuda)" "$python" -m pip install -q --no-index \
      --no-deps --no-build-isolation "$sdist"
fi
"$python" -m pip install -q --no-index --no-deps --no-build-isolation -e .
"$python" setup.py -q build_ext --inplace
HETSPEC_CACHE_DIR="$bundle" PYTHON="$python" native/build-llama-server.sh cuda | tail -1
EOF
chmod +x "$out/install.sh"
echo "$(du -sh "$out" | cut -f1) in $out: carry it, then run bash $(basename "$out")/install.sh"
