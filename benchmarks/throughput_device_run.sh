#!/usr/bin/env bash
# One device call for whole-request speed (issue 26) at P = 1, Qwen3-30B-A3B shapes (dummy bf16 weights): start-up
# and the first requests with a cold Triton cache without and with the start-up warm-up, then with a warm cache; the
# 256 x (64-512 -> 128) workload against its floor and transformers' continuous batching; the same at a token budget
# of 8192; prefill steps of 512 .. 16k tokens against their floor; TTFT against prompt length; a rollout-shaped run.
# Results into benchmarks/results via $OUT. Four device calls (each under the 10-minute limit), in order; the warm
# Triton cache of the first stays in /tmp/g while the machine is held. Usage (device):
# MOEBIUS_COMMIT=<hash> bash benchmarks/throughput_device_run.sh start|work|prefill|rollout
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export MOEBIUS_COMMIT=${MOEBIUS_COMMIT:?export MOEBIUS_COMMIT=<the commit measured> (the device tree is a copy)}
W=/tmp/g; mkdir -p $W; R=benchmarks/results; B="python3 -m moebius.entrypoints.cli bench"
M="--model qwen3-30b-a3b --load-format dummy --num-ranks 1"
WORK="--num-prompts 256 --prompt-len-dist uniform --prompt-len-range 64,512 --output-len 128 --probe-requests 10"
t() { local n=$1; shift; timeout $1 "${@:2}" > $W/$n.log 2>&1; echo "$n rc=$? $(date +%T)"; grep -v "^INFO\|Warning\|return func" $W/$n.log | tail -4; }
date +%T
case ${1:?start, work, prefill or rollout} in
start)
TRITON_CACHE_DIR=$W/cold1 t cold_none 300 $B throughput $M $WORK --warmup none --output $R/h200-p1-throughput-cold-nowarmup.json
TRITON_CACHE_DIR=$W/cold2 t cold_full 300 $B throughput $M $WORK --warmup full --output $R/h200-p1-throughput-cold.json ;;
work)
TRITON_CACHE_DIR=$W/cold2 t warm_full 400 $B throughput $M $WORK --warmup full --hf-baseline --output $R/h200-p1-throughput.json
TRITON_CACHE_DIR=$W/cold2 t budget8k 240 $B throughput $M $WORK --max-num-batched-tokens 8192 --output $R/h200-p1-throughput-budget8k.json ;;
prefill)
export TRITON_CACHE_DIR=$W/cold2
t prefill 240 $B sweep $M --modes tp --batches 1 --steps 5 --warmup 2 --prefill-chunks 512,1024,2048,4096,8192,16384 --output $R/h200-p1-prefill.json
python3 -c "import json; [print(json.dumps({'prompt_len': n, 'output_len': 1})) for _ in range(2) for n in (1024, 4096, 16384, 32768)]" > $W/ttft.jsonl
t ttft 300 $B throughput $M --lengths $W/ttft.jsonl --probe-requests 8 --max-model-len 32800 --output $R/h200-p1-ttft.json ;;
rollout)
export TRITON_CACHE_DIR=$W/cold2
t rollout 500 $B throughput $M --num-prompts 1024 --prompt-len-dist uniform --prompt-len-range 128,1024 --output-len-dist lognormal --output-len 300 --output-len-range 1,2048 --max-running-requests 1024 --output $R/h200-p1-throughput-rollout.json ;;
esac
mkdir -p $OUT/r; cp $R/h200-p1-throughput*.json $R/h200-p1-prefill.json $R/h200-p1-ttft.json $OUT/r/ 2>/dev/null; tar czf $OUT/png.tgz $R/h200-p1-throughput*.png $R/h200-p1-prefill.png $R/h200-p1-ttft.png 2>/dev/null; tar czf $OUT/logs.tgz -C $W --exclude='cold*' .
