#!/usr/bin/env bash
# Issue #24's GPU checks and benchmark in one run on a GPU machine with no network, from the
# repository's root, with native/device-bundle.sh's bundle at .device (the device tool:
# run(command="OUT=$OUT bash native/gpu-checks.sh", carry=[".device"])):
#
#   1. installs the bundle (wheels, the CPU llama-cpp-python package, hetspec editable);
#   2. builds llama-server for CUDA from the same llama.cpp, in the background, on all cores
#      but the first two (the measurements keep those);
#   3. makes heavy-1b and heavy-300m;
#   4. runs the CUDA tests;
#   5. T_verify(w), w = 1..64, of the torch verifier on heavy-1b and heavy-300m: width buckets
#      as CUDA graphs, fixed width 16 (the width-invariant verifier), eager; and how far each
#      width's logits are from one token at a time;
#   6. once llama-server is built: `hetspec bench` on heavy-1b with the GPU peers (draft-cpu,
#      busy-core run included), then draft-gpu.
# Everything goes to $OUT/log.txt as it happens; tables to $OUT/*.json and $OUT/bench*.md.
# Each step has its own time limit and a failed step does not stop the others.
set -uo pipefail
OUT=${OUT:?set OUT to the folder for the results}
root=$(pwd)
python=${PYTHON:-python3}
export HETSPEC_CACHE_DIR=${HETSPEC_CACHE_DIR:-/tmp/hetspec-cache}
export PYTHONUNBUFFERED=1
log="$OUT/log.txt"
exec > >(tee -a "$log") 2>&1
began=$SECONDS
stamp() { echo; echo "== [$((SECONDS - began)) s] $*"; }
step() {  # step LIMIT_S DESCRIPTION COMMAND...: run with a time limit, report, go on
  local limit=$1 what=$2; shift 2
  stamp "$what"
  timeout --kill-after=10 "$limit" "$@"
  local status=$?
  [[ $status -eq 0 ]] || echo "!! $what: exit $status"
  return 0
}

stamp "machine"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
lscpu | grep -E '^(Model name|CPU\(s\)|Flags)' | cut -c1-200
"$python" -c 'import torch, sys; print(sys.version.split()[0], "torch", torch.__version__)'

stamp "install"
if ! "$python" -c 'import hetspec.workers, llama_cpp, msgspec' 2>/dev/null; then
  site=$("$python" -c 'import site; print(site.getsitepackages()[0])')
  "$python" -m pip install -q --no-index --no-deps .device/wheels/*.whl
  tar xzf .device/llama_cpp_python.tar.gz -C "$site"
  "$python" -m pip install -q --no-index --no-deps --no-build-isolation -e . 2>&1 | tail -3
fi
"$python" -c 'import llama_cpp, hetspec; print("llama-cpp-python", llama_cpp.__version__)'
mkdir -p "$HETSPEC_CACHE_DIR/llama-server/sdist"
cp .device/llama-server/sdist/*.tar.gz "$HETSPEC_CACHE_DIR/llama-server/sdist/"

# Slow builds start first, in sessions of their own (setsid), so that they go on after a
# quick run returns and a full run started next on the same warm machine finds them done
# or under way: llama-server for CUDA (minutes of nvcc) on every core but the first two,
# which the measurements keep, and the heavy targets.
build_log="$HETSPEC_CACHE_DIR/llama-server-build.log"
if [[ ! -e "$HETSPEC_CACHE_DIR/llama-server.started" ]]; then
  touch "$HETSPEC_CACHE_DIR/llama-server.started"
  stamp "llama-server for CUDA: building in the background on cores 2-$(($(nproc) - 1))"
  setsid taskset -c 2-$(($(nproc) - 1)) bash -c "bash native/build-llama-server.sh cuda \
      >'$build_log' 2>&1; echo \$? >'$HETSPEC_CACHE_DIR/llama-server.done'" </dev/null &
fi
heavy_log="$HETSPEC_CACHE_DIR/heavy.log"
if [[ ! -e "$HETSPEC_CACHE_DIR/heavy.started" ]]; then
  touch "$HETSPEC_CACHE_DIR/heavy.started"
  setsid taskset -c 0,1 bash -c "for size in 1b 300m; do '$python' -m hetspec.models.heavy \
      --params \$size --types f16,q8_0; done >'$heavy_log' 2>&1; \
      touch '$HETSPEC_CACHE_DIR/heavy.done'" </dev/null &
fi

if [[ -n "${QUICK:-}" ]]; then  # a smoke run: the GPU code paths on heavy-100m, minutes
  step 60 "heavy-100m" "$python" -m hetspec.models.heavy --params 100m --types f16,q8_0
  h100=$("$python" -c "from hetspec.models.heavy import ensure_heavy as e; \
print(e('100m', ('f16', 'q8_0'), quiet=True).folder)")
  step 150 "CUDA tests" "$python" -m pytest -q -x -p no:cacheprovider tests/test_cuda_graphs.py \
      tests/test_torch_runtime.py -k "cuda or graph or fixed or bucket"
  for mode in "--fixed-width 16 --invariance" "--invariance" "--no-graphs"; do
    step 60 "T_verify 100m $mode" "$python" -m hetspec.workers.torch_runtime.bench_verify \
        --model "$h100" --dtype bfloat16 --contexts 512 --widths 1,4,16,64 --repeats 20 $mode
  done
  step 150 "lossless, draft-cpu, greedy" "$python" -m pytest -q -x -p no:cacheprovider \
      tests/test_lossless.py -k "test_every_mode_returns_the_targets_own_greedy_output and \
draft-cpu and not llama and not native and not rpc"
  stamp "done (quick): the llama-server build so far"
  tail -c 300 "$build_log"; echo
  find /tmp -name '*.cu.o' -path '*ggml-cuda*' 2>/dev/null | wc -l
  exit 0
fi

# the measurements' own cores: the build must not slow the GPU's launches
pin=(taskset -c 0,1)
stamp "waiting for the heavy targets"
while [[ ! -e "$HETSPEC_CACHE_DIR/heavy.done" ]]; do sleep 2; done
tail -4 "$heavy_log"
heavy() { "$python" -c "from hetspec.models.heavy import ensure_heavy as e; \
print(e('$1', ('f16', 'q8_0'), quiet=True).folder)"; }
h1b=$(heavy 1b)
h300=$(heavy 300m)

step 180 "CUDA tests" "${pin[@]}" "$python" -m pytest -q -x -p no:cacheprovider \
    tests/test_cuda_graphs.py tests/test_torch_runtime.py -k "cuda or graph or fixed or bucket"

verify() {  # verify NAME MODEL ARGS...: T_verify(w) at 512 tokens of context
  local name=$1 model=$2; shift 2
  step 120 "T_verify $name" "${pin[@]}" "$python" -m hetspec.workers.torch_runtime.bench_verify \
      --model "$model" --contexts 512 --widths 1,2,4,8,16,32,64 --repeats 30 \
      --json "$OUT/verify-$name.json" "$@"
}
verify 1b-bf16-buckets "$h1b" --dtype bfloat16 --invariance
verify 1b-bf16-fixed16 "$h1b" --dtype bfloat16 --fixed-width 16 --invariance
verify 1b-bf16-eager "$h1b" --dtype bfloat16 --no-graphs
verify 1b-f32-fixed16 "$h1b" --dtype float32 --fixed-width 16
verify 300m-bf16-fixed16 "$h300" --dtype bfloat16 --fixed-width 16
verify 300m-bf16-eager "$h300" --dtype bfloat16 --no-graphs

stamp "waiting for the llama-server build"
while [[ ! -e "$HETSPEC_CACHE_DIR/llama-server.done" ]]; do
  sleep 5
  (( SECONDS - began < ${BUILD_WAIT_S:-360} )) || { echo "!! not built yet: the bench goes on without it"; break; }
done
tail -3 "$build_log"

bench_out=/tmp/bench
mkdir -p "$bench_out"
( while sleep 10; do cp "$bench_out"/bench.md "$OUT/bench.md" 2>/dev/null; \
  cp "$bench_out"/bench.json "$OUT/bench.json" 2>/dev/null; done ) &
copier=$!
# the GPU worker's runtime is torch: "auto" would also time llama.cpp on the GPU worker's one
# core (its build here cannot offload), minutes for a 1B target
export HETSPEC_GPU_RUNTIME=torch
left=$(( ${TOTAL_S:-570} - (SECONDS - began) ))
step $(( left > 60 ? left - 40 : 20 )) "bench heavy-1b draft-cpu" "$python" -m hetspec.client.cli bench \
    --target heavy-1b --placement draft-cpu --gammas 2,4,6 --prompts 4 --max-tokens 128 \
    --repeats 1 --warmup 2 --out "$bench_out"
cp "$bench_out"/bench.md "$OUT/bench.md"; cp "$bench_out"/bench.json "$OUT/bench.json"
left=$(( ${TOTAL_S:-570} - (SECONDS - began) ))
step $(( left > 30 ? left - 15 : 5 )) "bench heavy-1b draft-gpu" "$python" -m hetspec.client.cli bench \
    --target heavy-1b --placement draft-gpu --gammas 4 --prompts 2 --max-tokens 64 \
    --repeats 1 --warmup 1 --no-load --no-peers --out "$bench_out-gpu"
cp "$bench_out-gpu"/bench.md "$OUT/bench-draft-gpu.md" 2>/dev/null
kill $copier 2>/dev/null
stamp "done"
