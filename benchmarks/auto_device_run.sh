#!/usr/bin/env bash
# One device call: calibration, the rollout and bursty benchmarks and their simulations, at P = 1 (30B shapes,
# 16 layers); results into benchmarks/results, the profile into benchmarks/profiles, both back in $OUT/results.tgz
# (logs in $OUT/logs.tgz). Usage (device):
# MOEBIUS_COMMIT=<full hash> bash benchmarks/auto_device_run.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export MOEBIUS_COMMIT=${MOEBIUS_COMMIT:?export MOEBIUS_COMMIT=<the full 40-character hash measured> (the device tree is a copy)}
[ ${#MOEBIUS_COMMIT} -ge 40 ] || { echo "MOEBIUS_COMMIT must be the full hash (git rev-parse HEAD), not $MOEBIUS_COMMIT"; exit 2; }
W=/tmp/auto; mkdir -p $W/cal; R=benchmarks/results; touch $W/stamp
M="--model qwen3-30b-a3b --load-format dummy --num-layers 16 --num-ranks 1"
t() { local n=$1; shift; timeout $1 "${@:2}" > $W/$n.log 2>&1; echo "$n rc=$? $(date +%T)"; grep -v "^INFO\|Warning\|return func" $W/$n.log | tail -6; }
date +%T
t calibrate 200 python3 -m moebius.entrypoints.cli calibrate $M --calibration-dir $W/cal --batches 1,4,16,64,128,256,512,1024,2048 --context 256 --max-running-requests 2048 --cuda-graph-max-bs 512
CAL=benchmarks/profiles/h200-p1-qwen3-30b-16l.json; cp $(ls $W/cal/*.json | head -1) $CAL
ROLL="--requests 512 --scale 0.1 --seed 0"
t rollout 220 python3 -m moebius.entrypoints.cli bench rollout $M $ROLL --systems tp,ep --max-running-requests 512 --cuda-graph-max-bs 512 --output $R/h200-p1-rollout.json
t sim_rollout 60 python3 -m moebius.entrypoints.cli bench simulate rollout $ROLL --profile $CAL --max-running-requests 512 --validate $R/h200-p1-rollout.json --output $R/h200-p1-sim-rollout.json
BUR="--scale 0.1 --burst1-s 2 --quiet-s 20 --burst2-s 2 --bin-s 2 --seed 0"
t bursty 160 python3 -m moebius.entrypoints.cli bench bursty $M $BUR --systems tp --max-running-requests 512 --cuda-graph-max-bs 512 --output $R/h200-p1-bursty.json
t sim_bursty 60 python3 -m moebius.entrypoints.cli bench simulate bursty $BUR --profile $CAL --max-running-requests 512 --validate $R/h200-p1-bursty.json --output $R/h200-p1-sim-bursty.json
find $R benchmarks/profiles -type f -newer $W/stamp | tar czf $OUT/results.tgz -T -; tar czf $OUT/logs.tgz -C $W .
