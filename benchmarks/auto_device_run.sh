#!/usr/bin/env bash
# One device call: calibration, the rollout and bursty benchmarks and their simulations (30B shapes, 16 layers) on
# P GPUs (P=1 by default: static TP and EP only, the two being the same computation there; P >= 2 adds auto mode
# with the threshold policy, and an auto run with the cost policy); results into benchmarks/results (h200-p1-* at
# P = 1, h200x<P>-* above), the profile into benchmarks/profiles, both back in $OUT/results.tgz (logs in
# $OUT/logs.tgz). Usage (device):
# MOEBIUS_COMMIT=<full hash> [P=2] bash benchmarks/auto_device_run.sh
# A dry run on a CPU: P=2 M="--device cpu --num-ranks 2" ROLL="--requests 16 --scale 0.02" BUR="--scale 0.01
# --burst1-s 1 --quiet-s 2 --burst2-s 1 --bin-s 1" CALB=1,4 OUT=/tmp/out bash benchmarks/auto_device_run.sh (then drop
# what it wrote into benchmarks/).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export MOEBIUS_COMMIT=${MOEBIUS_COMMIT:?export MOEBIUS_COMMIT=<the full 40-character hash measured> (the device tree is a copy)}
[ ${#MOEBIUS_COMMIT} -ge 40 ] || { echo "MOEBIUS_COMMIT must be the full hash (git rev-parse HEAD), not $MOEBIUS_COMMIT"; exit 2; }
P=${P:-1}; W=/tmp/auto; mkdir -p $W/cal ${OUT:?}; R=benchmarks/results; touch $W/stamp
M=${M:-"--model qwen3-30b-a3b --load-format dummy --num-layers 16 --num-ranks $P"}
N=$([ $P = 1 ] && echo h200-p1 || echo h200x$P)
SYS=$([ $P = 1 ] && echo tp,ep || echo tp,ep,auto); BSYS=$([ $P = 1 ] && echo tp || echo tp,ep,auto)
ENG="--max-running-requests 512 --cuda-graph-max-bs 512 --calibration-dir $W/cal"
t() { local n=$1; shift; timeout $1 "${@:2}" > $W/$n.log 2>&1; echo "$n rc=$? $(date +%T)"; grep -v "^INFO\|Warning\|return func" $W/$n.log | tail -6; }
date +%T
t calibrate 200 python3 -m moebius.entrypoints.cli calibrate $M --calibration-dir $W/cal --batches ${CALB:-1,4,16,64,128,256,512,1024,2048} --context 256 --max-running-requests 2048 --cuda-graph-max-bs 512
CAL=benchmarks/profiles/$N-qwen3-30b-16l.json; cp $(ls $W/cal/*.json | head -1) $CAL
ROLL=${ROLL:-"--requests 512 --scale 0.1 --seed 0"}
t rollout 220 python3 -m moebius.entrypoints.cli bench rollout $M $ROLL --systems $SYS $ENG --output $R/$N-rollout.json
t sim_rollout 60 python3 -m moebius.entrypoints.cli bench simulate rollout $ROLL --profile $CAL --max-running-requests 512 --validate $R/$N-rollout.json --output $R/$N-sim-rollout.json
BUR=${BUR:-"--scale 0.1 --burst1-s 2 --quiet-s 20 --burst2-s 2 --bin-s 2 --seed 0"}
t bursty $((P == 1 ? 160 : 330)) python3 -m moebius.entrypoints.cli bench bursty $M $BUR --systems $BSYS $ENG --output $R/$N-bursty.json
t sim_bursty 60 python3 -m moebius.entrypoints.cli bench simulate bursty $BUR --profile $CAL --max-running-requests 512 --validate $R/$N-bursty.json --output $R/$N-sim-bursty.json
if [ $P != 1 ]; then  # the cost policy: auto only (the static runs above hold for it)
  t rollout_cost 150 python3 -m moebius.entrypoints.cli bench rollout $M $ROLL --systems auto --switch-policy cost $ENG --output $R/$N-rollout-cost.json
  t sim_rollout_cost 60 python3 -m moebius.entrypoints.cli bench simulate rollout $ROLL --profile $CAL --switch-policy cost --max-running-requests 512 --validate $R/$N-rollout-cost.json --output $R/$N-sim-rollout-cost.json
fi
find $R benchmarks/profiles -type f -newer $W/stamp | tar czf $OUT/results.tgz -T -; tar czf $OUT/logs.tgz -C $W .
