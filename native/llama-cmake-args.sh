#!/usr/bin/env bash
# The CMake options of a llama-cpp-python build for one backend, printed on one line:
#
#   native/llama-cmake-args.sh BACKEND
#
# Shared by install-llama-cpp.sh (into a virtual environment) and build-wheelhouse.sh (into a
# folder of wheels for an offline box), so both build llama.cpp the same way.
set -euo pipefail
backend=${1:?usage: $0 BACKEND}

# Parts of llama.cpp that hetspec never uses: skipping them shortens the build.
common="-DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF"
common+=" -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF"
# The RPC backend: a verifier may put some of its layers on other hosts' rpc-server
# (llama_cpp.rpc_servers; docs/beyond-one-box.md). It costs nothing when unused.
common+=" -DGGML_RPC=ON"
# Without llamafile's sgemm, a token's logits are the same whatever else its forward holds:
# with it, a 5-token verification of SmolLM2-135M (Q4_1) moved logits by up to 1.46 against
# one token at a time and flipped 10 of 480 greedy tokens (lossless output needs the
# target's own). It costs 0-10% on verifications of 5-17 tokens here (docs/design-notes.md).
common+=" -DGGML_LLAMAFILE=OFF"
case "$backend" in
  cpu)          flags="-DGGML_NATIVE=ON" ;;
  cpu-portable) flags="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON" ;;
  cuda)         flags="-DGGML_NATIVE=ON -DGGML_CUDA=ON" ;;
  vulkan)       flags="-DGGML_NATIVE=ON -DGGML_VULKAN=ON" ;;
  openblas)     flags="-DGGML_NATIVE=ON -DGGML_BLAS=ON -DGGML_BLAS_VENDOR=OpenBLAS" ;;
  metal)        flags="-DGGML_METAL=ON" ;;
  *) echo "unknown llama.cpp backend '$backend' (cpu, cpu-portable, cuda, vulkan, openblas, metal)" >&2
     exit 2 ;;
esac
echo "$common $flags ${LLAMA_CMAKE_ARGS:-}"
