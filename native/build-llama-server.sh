#!/usr/bin/env bash
# Build llama.cpp's own llama-server (and its RPC server, ggml-rpc-server) from the llama.cpp that
# the pinned llama-cpp-python vendors.
#
#   native/build-llama-server.sh [BACKEND]
#
# BACKEND: cpu (default; this machine's CPU, -march=native) or cuda (needs nvcc; set CUDAARCHS,
# e.g. 87 for Jetson Orin). The benchmark runs llama-server as a peer: it is llama.cpp's own
# server and speculative decoding, the same llama.cpp version that hetspec's workers link.
#
# The binaries are built once and cached at
#   ${HETSPEC_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/hetspec}/llama-server/VERSION-BACKEND/bin/
# (llama-server, and ggml-rpc-server: another host's layers for docs/beyond-one-box.md)
# (a later run only prints its path; LLAMA_REBUILD=1 forces a fresh build). A cold build takes
# about 9 minutes on 2 cores. Progress goes to stdout and the binary's path is stdout's last
# line; a failure exits non-zero with one line on stderr (the full build log is kept beside the
# binary's place).
set -euo pipefail

backend=${1:-cpu}
here=$(cd "$(dirname "$0")" && pwd)
constraints="$here/../constraints.txt"

fail() { echo "build-llama-server: $*" >&2; exit 1; }

# llama.cpp turns GGML_NATIVE *and every SIMD flag* off when SOURCE_DATE_EPOCH is set
# (reproducible-build mode), which silently makes a build several times slower.
unset SOURCE_DATE_EPOCH

# The server and its tools, nothing else: no tests, examples or libcurl (models are local files),
# and a static build, so the cached binary does not depend on a build tree's shared libraries.
flags="-DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF"
flags+=" -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_TESTS=OFF"
flags+=" -DLLAMA_BUILD_EXAMPLES=OFF -DGGML_NATIVE=ON -DGGML_RPC=ON"
case "$backend" in
  cpu)  ;;
  cuda) command -v nvcc >/dev/null || fail "backend cuda needs the CUDA toolkit: no nvcc on PATH"
        flags+=" -DGGML_CUDA=ON" ;;
  *)    echo "build-llama-server: unknown backend '$backend' (cpu, cuda)" >&2; exit 2 ;;
esac

[[ -r "$constraints" ]] || fail "cannot read $constraints"
version=$(sed -n 's/^llama-cpp-python==//p' "$constraints")
[[ -n "$version" ]] || fail "no llama-cpp-python==VERSION pin in $constraints"

cache=${HETSPEC_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/hetspec}/llama-server
dest="$cache/$version-$backend"
binary="$dest/bin/llama-server"
rpc_binary="$dest/bin/ggml-rpc-server"
if [[ -z "${LLAMA_REBUILD:-}" && -x "$binary" && -x "$rpc_binary" ]]; then
  echo "$binary"
  exit 0
fi

command -v cmake >/dev/null || fail "cmake is not installed (apt install cmake)"
{ command -v cc && command -v c++; } >/dev/null || fail "no C/C++ compiler is installed (apt install g++)"
mkdir -p "$cache/sdist"
# Build beside the destination, so the final move is a rename on one file system.
work=$(mktemp -d "$cache/.build-$version-$backend.XXXXXX")
trap 'rm -rf "$work"' EXIT
log="$work/build.log"
touch "$log"
keep_log() { mkdir -p "$dest" && cp "$log" "$dest/build.log"; }

find_sdist() {
  local file
  for file in "$cache/sdist/llama_cpp_python-$version.tar.gz" \
              "$cache/sdist/llama-cpp-python-$version.tar.gz"; do
    if [[ -f "$file" ]]; then echo "$file"; return 0; fi
  done
  return 0
}
sdist=$(find_sdist)
if [[ -n "$sdist" ]]; then
  echo "Using the llama-cpp-python $version sdist in $cache/sdist."
else
  python=${PYTHON:-}
  if [[ -z "$python" ]]; then
    if [[ -x "$here/../.venv/bin/python" ]]; then python="$here/../.venv/bin/python"
    else python=$(command -v python3 || true); fi
  fi
  [[ -n "$python" ]] && "$python" -m pip --version >/dev/null 2>&1 ||
    fail "no Python with pip to download the llama-cpp-python sdist (set PYTHON)"
  echo "Downloading the llama-cpp-python $version sdist (about 77 MB; kept in $cache/sdist)."
  # The sdist, never a wheel: only the sdist carries the llama.cpp source. It is kept, so a
  # rebuild needs no network.
  if ! "$python" -m pip download -q --no-deps --no-binary :all: -d "$cache/sdist" \
       "llama-cpp-python==$version" >>"$log" 2>&1; then
    keep_log
    fail "downloading the llama-cpp-python $version sdist failed (log: $dest/build.log)"
  fi
  sdist=$(find_sdist)
  [[ -n "$sdist" ]] || fail "pip left no llama-cpp-python $version sdist in $cache/sdist"
fi

echo "Unpacking its vendor/llama.cpp."
mkdir "$work/src"
if ! tar -xzf "$sdist" -C "$work/src" --strip-components=3 --wildcards '*/vendor/llama.cpp/*' \
     >>"$log" 2>&1; then
  keep_log
  rm -f "$sdist"  # a damaged download: the next run fetches it anew
  fail "unpacking vendor/llama.cpp from $sdist failed; removed it, run again (log: $dest/build.log)"
fi

# llama.cpp's AMX matrix kernels (this version) crash llama-server on its first batch on a
# Xeon with AMX (SIGSEGV in ggml_backend_amx_mul_mat, heavy-300m Q8_0 and Q4_K_M, 2026-11-27,
# with the kernel granting AMX state), so where -march=native would enable AMX it is turned
# off; llama.cpp's other CPU paths (its AVX-512 kernels and weight repacking) stay on.
compiler_flags=()
if echo | cc -march=native -dM -E - 2>/dev/null | grep -q __AMX_INT8__; then
  no_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
  compiler_flags=("-DCMAKE_C_FLAGS=$no_amx" "-DCMAKE_CXX_FLAGS=$no_amx")
fi
echo "Configuring llama-server $version for '$backend' ($flags ${compiler_flags[*]:-})."
if ! cmake -S "$work/src" -B "$work/build" $flags ${compiler_flags[@]+"${compiler_flags[@]}"} >>"$log" 2>&1; then
  keep_log
  fail "cmake configuration failed (log: $dest/build.log)"
fi

echo "Compiling llama-server with $(nproc) jobs (about 9 minutes on 2 cores)."
start=$SECONDS
if ! cmake --build "$work/build" --target llama-server ggml-rpc-server -j"$(nproc)" \
     >>"$log" 2>&1; then
  keep_log
  fail "compiling llama-server failed (log: $dest/build.log)"
fi
built="$work/build/bin/llama-server"
[[ -x "$built" ]] || { keep_log; fail "the build finished but left no $built (log: $dest/build.log)"; }
"$built" --version >>"$log" 2>&1 || { keep_log; fail "the built llama-server does not run (log: $dest/build.log)"; }

mkdir -p "$dest/bin"
cp "$log" "$dest/build.log"
[[ -x "$work/build/bin/ggml-rpc-server" ]] || { keep_log; fail "the build left no ggml-rpc-server"; }
mv -f "$work/build/bin/ggml-rpc-server" "$rpc_binary"
mv -f "$built" "$binary"  # a rename: the cached path never holds a partial binary
echo "llama-server built in $((SECONDS - start)) s."
echo "$binary"
