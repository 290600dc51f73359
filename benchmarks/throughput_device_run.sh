#!/usr/bin/env bash
# Whole-request speed (issue 26) and the served run (issue 24) at P = 1, Qwen3-30B-A3B shapes (dummy bf16 weights).
# Each argument is one measurement, run in the order given; group them into device calls of under 10 minutes (the
# Triton cache in /tmp/g stays while the machine is held, so `cold` runs only as the first of a fresh machine):
#   flash     install FlashAttention-4 from the carried wheels (.fa4b, and the first part of the CUDA 13 compiler
#             runtime that an earlier call carried in .fa4a and left in /tmp: benchmarks/README.md); later steps of
#             the call find it (--prefill-attention auto takes it)
#   tests     the GPU tests (pytest -m gpu)
#   cold      start-up and 10 probe requests then the 256 x (64-512 -> 128) workload, with a cold Triton cache,
#             without and with the start-up warm-up
#   work      the same workload with a warm cache against its floor and transformers' continuous batching; the
#             start-up with a warm cache and no warm-up
#   budget    a 16k-token prompt arriving among 64 decoding requests at token budgets of 2048, 8192 and 16384:
#             their inter-token gap and its TTFT (what the default budget costs running requests)
#   prefill   prefill steps of 512 .. 16k tokens against their floor; TTFT against prompt length (1k .. 32k)
#   rollout   a rollout-shaped run (1024 requests, prompts 128-1024, log-normal outputs up to 2048)
#   groups    the rollout's shape as GRPO groups (128 prompts x 8 samples, each its own output length), with the prefix
#             cache and with --disable-prefix-caching (one lease: an A/B), into h200-p1-throughput-groups-cache-{on,off}
#   attntune  the prefill attention kernel at its default tiles beside torch's SDPA backends
#   moetune   the fused MoE block shapes at prefill sizes (2k, 8k, 16k tokens)
#   profile   the kernels of prefill steps of 2048 and 8192 tokens and an eager decode step of 1024 requests
#   mixed     a 512-token prompt beside 255 decoding requests (1500 cached tokens each), their attention shared with
#             the prompt's launch and apart (--mixed-attention), timed (sweep) and profiled; decode batches of 512
#             and 1024 profiled in step pieces (the rollout's batches past the decode graphs)
#   steady    STREAMS (256) streams of 128 -> STEADY_OUT (512) tokens, all at once: served (`moebius bench serve`)
#             against the same work offline (`bench throughput`): what serving adds to a decode step (needs the
#             serve wheels; past 256 streams give M a larger --max-running-requests)
#   plans     the steady work offline, then served with --plans-ahead 1 and 2 in turn (one lease: an A/B), into
#             h200-p1-serve-steady$STREAMS-plans{1,2}; each result carries the rank's host / device / plan-wait times
#   engine    the steady work served with --engine-process on and off in turn, twice, at STREAMS and at twice as many
#             (one lease: an A/B), into h200-p1-serve-steady$S-engine-{on,off}[-2], and offline at twice STREAMS into
#             h200-p1-steady$((2 * STREAMS))-offline (M needs a --max-running-requests of twice STREAMS)
#   serve     `moebius serve` loaded by `moebius bench serve` with the bursty trace, into h200-p1-serve-bursty-$SERVE_TAG
#             (default "new": the kept runs are not overwritten; the server flags are M) (needs the serve wheels: carry
#             .whl, see benchmarks/README.md)
# Results (JSON + PNG) come back in $OUT/results.tgz, logs in $OUT/logs.tgz. Usage (device):
# MOEBIUS_COMMIT=<full hash> bash benchmarks/throughput_device_run.sh tests cold work ...
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # a tool run as a script (benchmarks/<sub>/x.py) imports this tree's moebius
export MOEBIUS_COMMIT=${MOEBIUS_COMMIT:?export MOEBIUS_COMMIT=<the full 40-character hash measured> (the device tree is a copy)}
[ ${#MOEBIUS_COMMIT} -ge 40 ] || { echo "MOEBIUS_COMMIT must be the full hash (git rev-parse HEAD), not $MOEBIUS_COMMIT"; exit 2; }
W=${W:-/tmp/g}; mkdir -p $W; R=benchmarks/results; B="python3 -m moebius.entrypoints.cli bench"; touch $W/stamp
M=${M:-"--model qwen3-30b-a3b --load-format dummy --num-ranks 1"}  # M, N and V: smaller for a dry run on a CPU
N=${N:-1}; V=${V:-151936}; export TRITON_CACHE_DIR=$W/triton
WORK="--num-prompts $((256 / N)) --prompt-len-dist uniform --prompt-len-range 64,512 --output-len $((128 / N)) --probe-requests 10"
STREAMS=${STREAMS:-256}; STEADY="--num-prompts $((STREAMS / N)) --prompt-len-dist fixed --prompt-len $((128 / N)) --output-len $((${STEADY_OUT:-512} / N))"
up() { python3 -m moebius.entrypoints.cli serve $M --port 8011 > $W/server.log 2>&1 & S=$!
  for _ in $(seq 150); do curl -sf localhost:8011/health > /dev/null && break; sleep 1; done; echo "server up $(date +%T)"; }
down() { kill -TERM $S; wait $S; echo "server exit $? $(date +%T)"; tail -3 $W/server.log; }
t() { local n=$1; shift; timeout $1 "${@:2}" > $W/$n.log 2>&1; echo "$n rc=$? $(date +%T)"; grep -v "^INFO\|Warning\|return func\|compiling kernels" $W/$n.log | tail -4; }
date +%T
for step in "$@"; do case $step in
flash)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/fa4 $(ls .fa4b/*.whl | grep -v cuda_) \
    && cat /tmp/fa4.part1 .fa4b/*.part2 | xz -d | tar xf - -C /tmp/fa4 || { echo "flash: install failed"; exit 3; }
  export PYTHONPATH=/tmp/fa4:/tmp/fa4/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH} FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=$W/flash
  python3 -c "from moebius.kernels.flash import unavailable_reason as u; print('flash:', u(0) or 'ok')" ;;
tests)
  t gpu_tests 300 python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider ${TESTS_K:+-k "$TESTS_K"} ;;
cold)  # (FlashAttention-4's kernel cache, where installed, cold too)
  TRITON_CACHE_DIR=$W/cold1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=$W/cold1/flash t cold_none 170 $B throughput $M $WORK --warmup none --output $R/h200-p1-throughput-cold-nowarmup.json
  t cold_full 200 $B throughput $M $WORK --warmup full --output $R/h200-p1-throughput-cold.json ;;
work)
  t warm_full 200 $B throughput $M $WORK --warmup full --hf-baseline --output $R/h200-p1-throughput.json
  t warm_none 120 $B throughput $M $WORK --warmup none --output $R/h200-p1-throughput-warm-nowarmup.json ;;
budget)
  for b in 2048 8192 16384; do
    t budget$b 120 $B throughput $M --num-prompts $((64 / N)) --output-len $((64 / N)) --long-prompt $((16384 / N)) --max-num-batched-tokens $b --output $R/h200-p1-long-prompt-budget$b.json
  done ;;
prefill)
  t prefill 160 $B sweep $M --modes tp --batches 1 --steps 5 --warmup 2 --prefill-chunks $((512 / N)),$((1024 / N)),$((2048 / N)),$((4096 / N)),$((8192 / N)),$((16384 / N)) --output $R/h200-p1-prefill.json
  python3 -c "import json; [print(json.dumps({'prompt_len': n // $N, 'output_len': 1})) for _ in range(2) for n in (1024, 4096, 16384, 32768)]" > $W/ttft.jsonl
  t ttft 130 $B throughput $M --lengths $W/ttft.jsonl --probe-requests 8 --max-model-len $((32800 / N)) --output $R/h200-p1-ttft.json ;;
rollout)
  t rollout 230 $B throughput $M --num-prompts $((1024 / N)) --prompt-len-dist uniform --prompt-len-range $((128 / N)),$((1024 / N)) --output-len-dist lognormal --output-len $((300 / N)) --output-len-range 1,$((2048 / N)) --max-running-requests 1024 --output $R/h200-p1-throughput-rollout.json ;;
groups)
  for c in on off; do
    t groups_$c 240 $B throughput $M --num-prompts $((128 / N)) --samples-per-prompt 8 --prompt-len-dist uniform --prompt-len-range $((128 / N)),$((1024 / N)) --output-len-dist lognormal --output-len $((300 / N)) --output-len-range 1,$((2048 / N)) --max-running-requests 1024 $([ $c = off ] && echo --disable-prefix-caching) --output $R/h200-p1-throughput-groups-cache-$c.json
  done ;;
attntune)
  t attn_tune 150 python3 benchmarks/kernels/attn_prefill_tune.py $R/h200-attn-prefill-default.json --default-only ;;
moetune)
  t moe_tune 330 python3 benchmarks/kernels/moe_tune.py --ranks 1 --modes tp --batches 2048 8192 16384 --output $R/h200-moe-prefill.json ;;
profile)
  t profile 200 python3 benchmarks/steps/profile_steps.py --prefill $((2048 / N)) $((8192 / N)) --decode $((1024 / N)) --context $((512 / N)) ;;
mixed)
  for how in shared apart; do
    t mixed_$how 150 $B sweep $M --modes tp --batches 1 --steps 5 --warmup 2 --prefill-chunks $((512 / N)) --prefill-decodes $((255 / N)) --prefill-decode-context $((1500 / N)) --mixed-attention $how --output $R/h200-p1-mixed-$how.json
    t mixed_prof_$how 150 python3 benchmarks/steps/profile_steps.py --prefill $((512 / N)) --beside $((255 / N)) --context $((1500 / N)) --decode --mixed-attention $how --rows 12
  done
  t pieces_prof 200 python3 benchmarks/steps/profile_steps.py --prefill --decode $((512 / N)) $((1024 / N)) --context $((512 / N)) --pieces --rows 12 ;;
serve)
  up
  t serve 200 $B serve --base-url http://127.0.0.1:8011 --vocab-size $V --trace bursty --scale $(python3 -c "print(1 / $N)") --quiet-s 40 --goodput ttft:1000,tpot:50 --server-args "$M" --output $R/h200-p1-serve-bursty-${SERVE_TAG:-new}.json
  down ;;
steady)
  t steady_offline 150 $B throughput $M $STEADY --output $R/h200-p1-steady${STREAMS}-offline.json
  up
  t steady 150 $B serve --base-url http://127.0.0.1:8011 --vocab-size $V $STEADY --server-args "$M" --output $R/h200-p1-serve-steady${STREAMS}-${SERVE_TAG:-new}.json
  down ;;
plans)
  t steady_offline 150 $B throughput $M $STEADY --output $R/h200-p1-steady${STREAMS}-offline-plans.json
  M0=$M
  for n in 1 2; do
    M="$M0 --plans-ahead $n"; up
    t steady_plans$n 150 $B serve --base-url http://127.0.0.1:8011 --vocab-size $V $STEADY --server-args "$M" --output $R/h200-p1-serve-steady${STREAMS}-plans$n.json
    down; cp $W/server.log $W/server_plans$n.log
  done
  M=$M0 ;;
engine)
  M0=$M; S2=$((2 * STREAMS)); STEADY2="--num-prompts $((S2 / N)) ${STEADY#--num-prompts * }"
  for run in "$STREAMS on" "$STREAMS off" "$STREAMS on -2" "$STREAMS off -2" "$S2 on" "$S2 off"; do
    read -r n e tag <<< "$run"; M="$M0 --engine-process $e"; up
    W0=$STEADY; [ $n = $S2 ] && W0=$STEADY2
    t steady_engine_$e$n$tag 150 $B serve --base-url http://127.0.0.1:8011 --vocab-size $V $W0 --server-args "$M" --output $R/h200-p1-serve-steady$n-engine-$e$tag.json
    down
  done
  M=$M0; t steady_offline$S2 150 $B throughput $M $STEADY2 --output $R/h200-p1-steady$S2-offline.json ;;
*) echo "unknown step $step"; exit 2 ;;
esac; done
find $R -name 'h200-*' -newer $W/stamp | tar czf $OUT/results.tgz -T -; tar czf $OUT/logs.tgz -C $W --exclude=cold1 --exclude=triton --exclude=flash .
