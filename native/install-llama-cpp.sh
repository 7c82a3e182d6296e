#!/usr/bin/env bash
# Build and install llama-cpp-python (and the llama.cpp it vendors) into a virtual environment.
#
#   native/install-llama-cpp.sh VENV_PYTHON [BACKEND]
#
# BACKEND picks the llama.cpp build (default: cpu):
#   cpu           this machine's CPU, every SIMD extension it has (-march=native)
#   cpu-portable  an AVX2/FMA/F16C baseline, for a wheel that must run on other x86-64 machines
#   cuda          NVIDIA GPUs (needs the CUDA toolkit; set CUDAARCHS, e.g. 87 for Jetson Orin)
#   vulkan        Vulkan GPUs (needs the Vulkan SDK / glslc)
#   openblas      OpenBLAS for large prompt batches (needs libopenblas-dev)
#   metal         Apple GPUs (macOS only)
# LLAMA_CMAKE_ARGS adds CMake options of your own; LLAMA_REBUILD=1 forces a fresh build.
#
# The default cpu build is cached by pip, so only the first setup pays for the compile (about
# 10 minutes on 2 cores). Other backends bypass pip's wheel cache: its key is the source
# archive alone, so a cached wheel of one backend would otherwise be reused for another.
set -euo pipefail

python=${1:?usage: $0 VENV_PYTHON [BACKEND]}
backend=${2:-cpu}
here=$(cd "$(dirname "$0")" && pwd)
constraints="$here/../constraints.txt"
stamp="$(dirname "$python")/../.llama-cpp-backend"

# llama.cpp turns GGML_NATIVE *and every SIMD flag* off when SOURCE_DATE_EPOCH is set
# (reproducible-build mode), which silently makes a build several times slower.
unset SOURCE_DATE_EPOCH

args=$("$here/llama-cmake-args.sh" "$backend")
export CMAKE_ARGS="$args"

wanted=$(sed -n 's/^llama-cpp-python==//p' "$constraints")
installed=$("$python" -c 'import importlib.metadata as m; print(m.version("llama-cpp-python"))' \
            2>/dev/null || true)
if [[ -z "${LLAMA_REBUILD:-}" && "$installed" == "$wanted" &&
      "$(cat "$stamp" 2>/dev/null)" == "$backend $CMAKE_ARGS" ]]; then
  exit 0   # already installed: same version, same build
fi

pip_args=(-c "$constraints" --no-deps --force-reinstall)
if [[ "$backend" != cpu || -n "${LLAMA_REBUILD:-}" ]]; then
  pip_args+=(--no-cache-dir)
fi
echo "Installing llama-cpp-python for '$backend' (CMAKE_ARGS=$CMAKE_ARGS)."
echo "A first build compiles llama.cpp (about 4 minutes on 2 cores); pip caches it for later setups."
start=$SECONDS
"$python" -m pip install -q "${pip_args[@]}" llama-cpp-python
# pip's wheel cache is keyed by the source archive alone: a wheel cached by an older setup
# (built before the RPC backend was switched on, or with llamafile's sgemm) would come back
# as it was built. Build afresh then.
built_as_asked='import sys, llama_cpp as L
sys.exit(not L.llama_supports_rpc() or b"LLAMAFILE = 1" in L.llama_print_system_info())'
if ! "$python" -c "$built_as_asked" 2>/dev/null; then
  echo "The cached llama-cpp-python wheel was built otherwise (RPC, llamafile); compiling a fresh one."
  "$python" -m pip install -q "${pip_args[@]}" --no-cache-dir llama-cpp-python
fi
echo "$backend $CMAKE_ARGS" > "$stamp"
echo "llama-cpp-python ready in $((SECONDS - start)) s."
