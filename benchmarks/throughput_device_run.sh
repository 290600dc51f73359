#!/usr/bin/env bash
# Whole-request speed (issue 26) and the served run (issue 24) at P = 1, Qwen3-30B-A3B shapes (dummy bf16 weights), in
# three device calls, each under the 10-minute limit, in order (the Triton cache of the first stays in /tmp/g while the
# machine is held):
#   start:   the GPU tests; start-up and the first requests with a cold Triton cache, without and with the warm-up;
#   work:    the 256 x (64-512 -> 128) workload (warm cache) against its floor and transformers' continuous batching,
#            the same at a token budget of 8192; prefill steps of 512 .. 16k tokens against their floor; TTFT against
#            prompt length (1k .. 32k);
#   rollout: a rollout-shaped run (1024 requests, prompts 128-1024, log-normal outputs up to 2048); `moebius serve`
#            loaded by `moebius bench serve` with the bursty trace (needs the serve wheels: carry .whl).
# Results (JSON + PNG) come back in $OUT/results.tgz, logs in $OUT/logs.tgz. Usage (device):
# MOEBIUS_COMMIT=<hash> bash benchmarks/throughput_device_run.sh start|work|rollout
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export MOEBIUS_COMMIT=${MOEBIUS_COMMIT:?export MOEBIUS_COMMIT=<the commit measured> (the device tree is a copy)}
W=${W:-/tmp/g}; mkdir -p $W; R=benchmarks/results; B="python3 -m moebius.entrypoints.cli bench"; touch $W/stamp
M=${M:-"--model qwen3-30b-a3b --load-format dummy --num-ranks 1"}  # M, N and V: smaller for a dry run on a CPU
N=${N:-1}; V=${V:-151936}
WORK="--num-prompts $((256 / N)) --prompt-len-dist uniform --prompt-len-range 64,512 --output-len $((128 / N)) --probe-requests 10"
t() { local n=$1; shift; timeout $1 "${@:2}" > $W/$n.log 2>&1; echo "$n rc=$? $(date +%T)"; grep -v "^INFO\|Warning\|return func" $W/$n.log | tail -4; }
date +%T
case ${1:?start, work or rollout} in
start)
t gpu_tests 200 python3 -m pytest -q -m gpu tests/test_gpu.py -x -p no:cacheprovider
TRITON_CACHE_DIR=$W/cold1 t cold_none 170 $B throughput $M $WORK --warmup none --output $R/h200-p1-throughput-cold-nowarmup.json
TRITON_CACHE_DIR=$W/cold2 t cold_full 200 $B throughput $M $WORK --warmup full --output $R/h200-p1-throughput-cold.json ;;
work)
export TRITON_CACHE_DIR=$W/cold2
t warm_full 200 $B throughput $M $WORK --warmup full --hf-baseline --output $R/h200-p1-throughput.json
t budget8k 120 $B throughput $M $WORK --max-num-batched-tokens 8192 --output $R/h200-p1-throughput-budget8k.json
t prefill 120 $B sweep $M --modes tp --batches 1 --steps 5 --warmup 2 --prefill-chunks $((512 / N)),$((1024 / N)),$((2048 / N)),$((4096 / N)),$((8192 / N)),$((16384 / N)) --output $R/h200-p1-prefill.json
python3 -c "import json; [print(json.dumps({'prompt_len': n // $N, 'output_len': 1})) for _ in range(2) for n in (1024, 4096, 16384, 32768)]" > $W/ttft.jsonl
t ttft 130 $B throughput $M --lengths $W/ttft.jsonl --probe-requests 8 --max-model-len $((32800 / N)) --output $R/h200-p1-ttft.json ;;
rollout)
export TRITON_CACHE_DIR=$W/cold2
t rollout 230 $B throughput $M --num-prompts $((1024 / N)) --prompt-len-dist uniform --prompt-len-range $((128 / N)),$((1024 / N)) --output-len-dist lognormal --output-len $((300 / N)) --output-len-range 1,$((2048 / N)) --max-running-requests 1024 --output $R/h200-p1-throughput-rollout.json
python3 -m moebius.entrypoints.cli serve $M --port 8011 > $W/server.log 2>&1 & S=$!
for _ in $(seq 150); do curl -sf localhost:8011/health > /dev/null && break; sleep 1; done; echo "server up $(date +%T)"
t serve 200 $B serve --base-url http://127.0.0.1:8011 --vocab-size $V --trace bursty --scale $(python3 -c "print(1 / $N)") --quiet-s 40 --goodput ttft:1000,tpot:50 --output $R/h200-p1-serve-bursty.json
kill -TERM $S; wait $S; echo "server exit $? $(date +%T)"; tail -3 $W/server.log ;;
esac
find $R -name 'h200-p1-*' -newer $W/stamp | tar czf $OUT/results.tgz -T -; tar czf $OUT/logs.tgz -C $W --exclude='cold*' .
