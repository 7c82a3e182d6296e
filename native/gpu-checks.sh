#!/usr/bin/env bash
# Issue #24's GPU checks and benchmark on a GPU machine with no network, from the repository's
# root, with native/device-bundle.sh's bundle at .device. Two calls of the device tool on one
# warm machine (its 10-minute limit per call; llama-server's CUDA build alone took 348 s on 14
# cores of the H100 machine), the second issued as soon as the first returns. A session's
# device time is 900 s in all, the machine's start (~100 s) and idle waits included, so the
# two calls' limits add up to no more than ~770 s:
#
#   run(command="OUT=$OUT QUICK=1 bash native/gpu-checks.sh", carry=[".device"], timeout_s=300)
#   run(command="OUT=$OUT TOTAL_S=450 bash native/gpu-checks.sh", carry=[".device"], timeout_s=470)
#
# The full call benches the verifier the quick call found fastest among those bit-identical at
# every width (cuBLAS, the Triton matmul, torch.compile: native/gpu-pick-settings.py) unless
# BENCH_SET is given before bash: daemon settings separated by spaces (e.g. BENCH_SET='' for
# the default; the pick adds worker_spin_us=2000 and daemon_spin_us=5000 itself where the quick
# call's round trips showed a wake-up costing more than polling). BENCH_ARGS adds arguments to that
# bench (e.g. BENCH_ARGS='--temperature 0.8': every system sampled, seeded per prompt).
# GEMMA=1 before a quick call adds T_verify of a random Gemma-3-1B-shaped folder at its end.
#
# Every call installs the bundle (wheels, the CPU llama-cpp-python package, hetspec editable)
# and starts, once per machine and in sessions of their own (setsid) that outlive the call,
# llama-server's CUDA build (native/build-llama-server.sh cuda, on every core but the first
# two) and heavy-1b/heavy-300m. The quick call then runs the CUDA tests, heavy-1b's linear
# layers alone (cuBLAS against the Triton kernel) and T_verify(w) of the torch verifier
# (widths 1..64: the width-invariant fixed width with cuBLAS, with hetspec's Triton matmul and
# through torch.compile, then width buckets) with each width's distance from one token at a
# time, a tree's from its branches as chains, and a profile of one token's forward, then the
# worker round trip with and without a wake-up; the
# full call waits for llama-server, times a draft token as the rounds pay for it (bench_draft,
# 1 and 4 threads), runs the lossless suite's greedy test on draft-cpu (the
# drafter's llama.cpp would fight the build for cores before) and `hetspec bench` on heavy-1b
# with the GPU peers, busy-core run included, then the same bench with int8 weights in the
# verifier (no peers, no load) in what time is left (DRAFT_GPU=1 before bash: draft-gpu on
# heavy-300m with Dovetail's head and with the independent draft model instead).
# Everything goes to $OUT/log.txt as it happens, bench_verify's and bench_matmul's tables to
# $OUT/tables.tgz (one file: the device tool brings back 8), the bench's to $OUT/bench*.
# Each step has its own time limit; a failed step does not stop the others. docs/bench/gpu/README.md has the last run's figures.
set -uo pipefail
OUT=${OUT:?set OUT to the folder for the results}
root=$(pwd)
python=${PYTHON:-python3}
export HETSPEC_CACHE_DIR=${HETSPEC_CACHE_DIR:-/tmp/hetspec-cache}
export PYTHONUNBUFFERED=1
log="$OUT/log.txt"
exec > >(tee -a "$log") 2>&1
began=$SECONDS
tables=/tmp/gpu-tables  # the JSON tables, packed into $OUT/tables.tgz after each step
mkdir -p "$tables"
pack_tables() { tar czf "$OUT/tables.tgz" -C "$tables" . 2>/dev/null || true; }
trap pack_tables EXIT
stamp() { echo; echo "== [$((SECONDS - began)) s] $*"; }
step() {  # step LIMIT_S DESCRIPTION COMMAND...: run with a time limit, report, go on
  local limit=$1 what=$2; shift 2
  stamp "$what"
  timeout --kill-after=10 "$limit" "$@"
  local status=$?
  [[ $status -eq 0 ]] || echo "!! $what: exit $status"
  pack_tables
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

pin=(taskset -c 0,1)  # the measurements' own cores: the build must not slow the launches
heavy() { "$python" -c "from hetspec.models.heavy import ensure_heavy as e; \
print(e('$1', ('f16', 'q8_0'), quiet=True).folder)"; }
verify() {  # verify NAME MODEL ARGS...: T_verify(w) at 512 tokens of context, and a token
  # decoded alone (64 a call) with the forwards queued on the GPU against the host's loop
  local name=$1 model=$2; shift 2
  step "${VERIFY_S:-90}" "T_verify $name" "${pin[@]}" "$python" -m hetspec.bench.torch_verify \
      --model "$model" --contexts 512 --widths 1,2,4,8,16,32,64 --repeats 30 --decode 65 \
      --json "$tables/verify-$name.json" "$@"
}

if [[ -n "${QUICK:-}" ]]; then
  # most telling first: a step the call's limit cuts off costs the least there
  step 120 "CUDA tests" "${pin[@]}" "$python" -m pytest -q -p no:cacheprovider \
      tests/test_cuda_graphs.py tests/test_torch_runtime.py tests/test_skinny_matmul.py \
      tests/test_split_attention.py tests/test_int8_weights.py \
      -k "(cuda or graph or fixed or bucket) and not compiled"  # compiling: T_verify's below
  # heavy-1b's linear layers alone, cuBLAS against the Triton kernel's tilings (GB/s of
  # weight, and whether each keeps a row's bits among other rows), while the targets build
  step 90 "linear layers" "${pin[@]}" "$python" -m hetspec.bench.torch_matmul \
      --json "$tables/matmul.json"
  # the Triton verifier below runs the tiling fastest over a 16-row forward (none: the default)
  tiling=$("$python" native/gpu-pick-settings.py --tiling "$tables")
  stamp "waiting for the heavy targets"
  while [[ ! -e "$HETSPEC_CACHE_DIR/heavy.done" ]]; do sleep 2; done
  h1b=$(heavy 1b)
  # the width-invariant verifier (chains in one-path forwards, in the cache's order in place
  # where the load's check found the same bits: its header says "chains in place"): the
  # invariance table's "tree" row compares a 4x4 tree with its branches as chains, i.e. the
  # shapes (any row that differs means chain_forwards must be off on this GPU); the profile
  # says where a target-alone token's time goes (the GPU's kernels against the wall time)
  # (chains and four-branch trees: the third session's 4x4 tree took 2.44-2.53 ms, a chain 1.81)
  verify 1b-fixed16 "$h1b" --dtype bfloat16 --fixed-width 16 --invariance --profile-width 1 \
      --shape chain,tree
  # the same with every linear layer in hetspec's Triton kernel (the weight read once for all
  # 16 rows, split-K fixed by the weight's shape): cuBLAS's 16-row kernels read heavy-1b's
  # 1.95 GB at ~36% of the HBM's bandwidth; Triton compiles its kernels at load
  VERIFY_S=150 verify 1b-fixed16-triton "$h1b" --dtype bfloat16 --fixed-width 16 --invariance \
      --matmul triton --matmul-tiling "$tiling" --profile-width 1 --shape chain,tree
  # the full call's verifier, unless BENCH_SET says otherwise there: the least T(1) plus the
  # slowest 16-row forward (chain or tree) of the fixed-width tables whose every row stayed
  # bit-identical; picked now, again after split attention and at the end, so a call cut
  # short by its limit still leaves a choice for the full call (int8 before split: the
  # larger lever, and the call's limit cuts the last steps)
  pick() {
    stamp "the verifier the full call benches"
    "$python" native/gpu-pick-settings.py "$tables" > "$HETSPEC_CACHE_DIR/bench_set"
    echo "BENCH_SET for the full call: '$(cat "$HETSPEC_CACHE_DIR/bench_set")'"
  }
  pick
  # through torch.compile (inductor fuses the small kernels between the matmuls: a layer's
  # norms, rotary, activation and residual adds), compiled at load (three forwards, each
  # once for every span bucket: trees, gathered chains, chains in place), around the Triton
  # matmul as one op a layer where bench_matmul found its 16-row forward faster than
  # cuBLAS's, else cuBLAS's
  compiled_matmul=$("$python" native/gpu-pick-settings.py --compiled-matmul "$tables")
  compiled_with=(--matmul "$compiled_matmul")
  [[ $compiled_matmul != triton ]] || compiled_with+=(--matmul-tiling "$tiling")
  VERIFY_S=200 verify 1b-fixed16-compiled "$h1b" --dtype bfloat16 --fixed-width 16 --invariance \
      --compile "${compiled_with[@]}" --profile-width 1 --shape chain,tree
  pick
  # int8 weights (workers/runtimes/torch_runtime/int8_weights.py): the same Triton kernel reading
  # one byte a weight and a scale per row, half the 1.95 GB (llama-server's Q8_0 reads 1.06
  # GB). The int8 model computes other logits, so it is no candidate for the bf16 pick: its
  # T(1) and T(16) against the Triton table above, and its linear layers alone
  step 60 "linear layers, int8 weights" "${pin[@]}" "$python" -m \
      hetspec.bench.torch_matmul --weights int8 --json "$tables/matmul-int8.json"
  tiling_int8=$("$python" native/gpu-pick-settings.py --tiling "$tables" matmul-int8.json)
  echo "$tiling_int8" > "$HETSPEC_CACHE_DIR/tiling_int8"
  VERIFY_S=120 verify 1b-fixed16-int8 "$h1b" --dtype bfloat16 --fixed-width 16 --invariance \
      --weights int8 --matmul-tiling "$tiling_int8" --profile-width 1 --shape chain,tree
  # split attention (workers/runtimes/torch_runtime/split_attention.py): each row reads the cache in
  # place up to a point its position fixes and gathers only its path's last 33-48 keys, in
  # explicit float32 arithmetic instead of SDPA; a tree should cost about a chain (the +12%
  # trees keep over chains offline, docs/bench/gpu/README.md); its tables against the above
  verify 1b-fixed16-split "$h1b" --dtype bfloat16 --fixed-width 16 --invariance \
      --profile-width 1 --shape chain,tree --attention split
  pick
  # a worker woken for every call (1 ms apart, as in a round: it sleeps after 100 us of
  # polling) against one that polls through the gap: the price of a wake-up on this box, per
  # link (the 2-vCPU dev VM, back to back: mailboxes 46-56 us, ZeroMQ alone 208-242)
  # (the pick adds worker_spin_us=2000 to the full call's settings where polling pays)
  for spin in 100 2000; do
    step 40 "worker round trip, 1 ms apart, polling $spin us" "$python" -m \
        hetspec.bench.roundtrip --floats 16 --count 600 --turns 1 --gap-us 1000 \
        --spin-us $spin --json "$tables/roundtrip-spin$spin.json"
  done
  # the daemon's side: the worker computing 1 ms an answer (as through a verification), the
  # daemon sleeping until the answer wakes it, or polling (on the 2-vCPU dev VM, the daemon
  # on a core of its own: 123 against 73 us; the pick adds daemon_spin_us=5000 where it pays)
  for daemon in 0 5000; do
    step 40 "worker round trip, a 1 ms answer, the daemon polling $daemon us" "$python" -m \
        hetspec.bench.roundtrip --floats 16 --count 600 --turns 1 --gap-us 1000 \
        --spin-us 2000 --hold-us 1000 --daemon-spin-us $daemon \
        --json "$tables/roundtrip-hold$([[ $daemon == 0 ]] || echo -daemon).json"
  done
  pick
  # split attention compiled, its kernel one op a layer, with the compiled step's matmul
  VERIFY_S=200 verify 1b-fixed16-compiled-split "$h1b" --dtype bfloat16 --fixed-width 16 \
      --invariance --compile "${compiled_with[@]}" --attention split --profile-width 1 \
      --shape chain,tree
  pick
  # the least telling last: width buckets (not invariant)
  verify 1b-buckets "$h1b" --dtype bfloat16 --invariance
  # what attending in place saves: the same verifier with every chain gathering its path
  # (the third session's fixed-width rows: 1.806 ms at w = 1)
  VERIFY_S=60 verify 1b-fixed16-gathered "$h1b" --dtype bfloat16 --fixed-width 16 \
      --no-chain-in-place
  if [[ -n "${GEMMA:-}" ]]; then  # GEMMA=1: a Gemma-3-1B-shaped target (random weights, a
    # 262,144-token tied head, windowed layers): the torch runtime's Gemma path on the GPU
    gemma="$HETSPEC_CACHE_DIR/gemma3-1b"
    [[ -e "$gemma/model-q8_0.gguf" ]] || step 150 "random Gemma-3-1B folder" "${pin[@]}" \
        "$python" -m hetspec.models.random_gemma3 1b "$gemma"
    verify gemma3-1b-fixed16 "$gemma" --dtype bfloat16 --fixed-width 16 --invariance
    # its 262,144 x 1,152 head is a third of its weights: int8 halves that too
    verify gemma3-1b-fixed16-int8 "$gemma" --dtype bfloat16 --fixed-width 16 --invariance \
        --weights int8 --matmul-tiling "$tiling_int8"
    # a sampled round's verdict: the daemon's walk over 17 rows of 262,144 logits copied off
    # the GPU into the arena, against the verifier's walk reading only the rows it reaches
    step 90 "sampled verdict, gemma3-1b" "${pin[@]}" "$python" -m hetspec.bench.verdict \
        "$gemma" --runtime torch --rounds 30 --json "$tables/verdict-gemma3-1b.json"
  fi
  stamp "done (quick): the llama-server build so far"
  tail -c 300 "$build_log"; echo
  exit 0
fi

stamp "waiting for the llama-server build"
while [[ ! -e "$HETSPEC_CACHE_DIR/llama-server.done" ]]; do
  sleep 5
  (( SECONDS - began < ${BUILD_WAIT_S:-360} )) || { echo "!! not built yet: the bench goes on without it"; break; }
done
tail -3 "$build_log"
while [[ ! -e "$HETSPEC_CACHE_DIR/heavy.done" ]]; do sleep 2; done
# a draft token as the rounds pay for it on this box's cores, against a forward alone
for threads in 1 4; do
  step 30 "a draft token in rounds, $threads thread(s)" "$python" -m hetspec.bench.draft_cost \
      models/draft/draft-q8_0.gguf --threads "$threads" --cores "$(seq -s, 2 $((1 + threads)))" \
      --rounds 200
done
step 120 "lossless, draft-cpu, greedy" "$python" -m pytest -q -x -p no:cacheprovider \
    tests/test_lossless.py -k "test_every_mode_returns_the_targets_own_greedy_output and \
draft-cpu and not llama and not native and not rpc"

bench_out=/tmp/bench
mkdir -p "$bench_out"
( while sleep 10; do cp "$bench_out"/bench.md "$OUT/bench.md" 2>/dev/null; \
  cp "$bench_out"/bench.json "$OUT/bench.json" 2>/dev/null; done ) &
copier=$!
left=$(( ${TOTAL_S:-570} - (SECONDS - began) ))
# BENCH_SET: daemon settings for this bench, separated by spaces, e.g. 'gpu_worker.matmul=
# "triton"' or 'gpu_worker.compile=true' where the quick call's T_verify showed it faster and
# as invariant
# (unset: what the quick call chose, native/gpu-pick-settings.py)
BENCH_SET=${BENCH_SET-$(cat "$HETSPEC_CACHE_DIR/bench_set" 2>/dev/null)}
echo "BENCH_SET: '${BENCH_SET:-}'"
bench_set=()
for item in ${BENCH_SET:-}; do bench_set+=(--set "$item"); done
# BENCH_ARGS: more arguments for this bench, separated by spaces (e.g. '--temperature 0.8')
read -r -a bench_args <<< "${BENCH_ARGS:-}"
# every speculative round of its daemon, written straight into $OUT (a call cut short keeps
# them): the controller's expected tokens/s against its rounds', per mode
step $(( left > 60 ? left - 40 : 20 )) "bench heavy-1b draft-cpu" "$python" -m hetspec.client.cli bench \
    --target heavy-1b --placement draft-cpu --gammas 4 --prompts 3 --max-tokens 128 \
    --repeats 1 --warmup 1 --out "$bench_out" "${bench_set[@]}" "${bench_args[@]}" \
    --set "round_log=\"$OUT/rounds-heavy-1b.jsonl\""
cp "$bench_out"/bench.md "$OUT/bench.md"; cp "$bench_out"/bench.json "$OUT/bench.json"
"$python" -m hetspec.daemon.decode.round_log "$OUT/rounds-heavy-1b.jsonl" || true
# the same pair with int8 weights in the verifier (the int8 model's text, its own target alone
# the reference; the peers above read Q8_0), in what time is left: no peers, no load
int8_set=(--set 'gpu_worker.weights="int8"')
tiling_int8=$(cat "$HETSPEC_CACHE_DIR/tiling_int8" 2>/dev/null || true)
[[ -n "$tiling_int8" ]] && int8_set+=(--set "gpu_worker.matmul_tiling={$tiling_int8}")
for item in ${BENCH_SET:-}; do  # the bf16 bench's other choices (split attention, ...) too
  case "$item" in
    gpu_worker.matmul*|gpu_worker.compile*) ;;  # the int8 kernel and its own tiling instead
    *) int8_set+=(--set "$item") ;;
  esac
done
left=$(( ${TOTAL_S:-570} - (SECONDS - began) ))
if [[ -z "${DRAFT_GPU:-}" ]] && (( left > 60 )); then
  step $(( left - 10 )) "bench heavy-1b draft-cpu, int8 weights" "$python" -m \
      hetspec.client.cli bench --target heavy-1b --placement draft-cpu --gammas 4 --prompts 3 \
      --max-tokens 128 --repeats 1 --warmup 1 --no-load --no-peers "${int8_set[@]}" \
      "${bench_args[@]}" --out "$bench_out-int8"
  cp "$bench_out-int8"/bench.md "$OUT/bench-int8.md" 2>/dev/null
  cp "$bench_out-int8"/bench.json "$OUT/bench-int8.json" 2>/dev/null
fi
# DRAFT_GPU=1 before bash, in place of the int8 bench: draft-gpu on heavy-300m (#22's goal),
# Dovetail's head, then the independent draft model, each in half of what time is left
for head in auto none; do
  [[ -n "${DRAFT_GPU:-}" ]] || break
  left=$(( ${TOTAL_S:-570} - (SECONDS - began) ))
  [[ $head == auto ]] && left=$(( left / 2 ))
  step $(( left > 30 ? left - 10 : 5 )) "bench heavy-300m draft-gpu, draft_head $head" \
      "$python" -m hetspec.client.cli bench --target heavy-300m --placement draft-gpu \
      --gammas 4 --prompts 1 --max-tokens 64 --repeats 1 --warmup 1 --no-load --no-peers \
      --set "draft_head=\"$head\"" --out "$bench_out-gpu-$head"
  cp "$bench_out-gpu-$head"/bench.md "$OUT/bench-draft-gpu-$head.md" 2>/dev/null
done
kill $copier 2>/dev/null
stamp "done"
