#!/usr/bin/env bash
# A/B on one GPU: a copy of an earlier tree (before) against this tree (after), alternated, in one device call: the
# decode sweep (steady decode steps over batches) and `bench throughput` (256 requests of 64-512 prompt tokens and
# 128 output tokens, served to the end). Usage: git archive <rev> | tar -x -C .baseline (a folder .git/info/exclude
# ignores; carry it), then bash benchmarks/ab_sweep.sh [.baseline] [sweep|throughput ...] (default: both).
# Prints each run and the best after/before per point; $OUT/ab.json.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
ROOT=$PWD; BASE=$(cd "${1:-.baseline}" && pwd); shift || true; W=/tmp/ab; mkdir -p $W; OUT=${OUT:-$W}
WHAT=${*:-sweep throughput}
M=${M:-"--model qwen3-30b-a3b --load-format dummy --num-ranks 1"}  # (a dry run on a CPU: M="--num-ranks 1")
SWEEP="bench sweep $M --modes tp --batches 1,8,64,256,1024 --context-len 512 --steps 10 --warmup 3 --eager-up-to 0 --cuda-graph-max-bs 1024 ${SWEEP_EXTRA:-"--mem-fraction 0.85"}"
THROUGHPUT="bench throughput $M --num-prompts 256 --prompt-len-dist uniform --prompt-len-range 64,512 --output-len 128"
run() {  # kind name dir args
  (cd $3 && PYTHONPATH=$3 timeout 300 python3 -m moebius.entrypoints.cli $4 --output $W/$1-$2.json) > $W/$1-$2.log 2>&1
  echo "$1 $2 rc $? $(date +%T)"; grep -E "^ *tp +[0-9]|requests in" $W/$1-$2.log | tail -5
}
date +%T
for kind in $WHAT; do
  args=$SWEEP; [ $kind = throughput ] && args=$THROUGHPUT
  for i in 1 2; do run $kind before$i $BASE "$args"; run $kind after$i $ROOT "$args"; done
done
python3 - <<'PY'
import glob, json, os
def pts(path):
    d = json.load(open(path))
    rows = d.get("rows", [])
    if os.path.basename(path).startswith("throughput"):
        s = next(r for r in rows if r.get("table") == "summary")
        return {"wall_s": s["wall_s"], "decode_s": s["decode_s"]}
    return {r["batch"]: r["step_ms"] for r in rows if r.get("table", "decode") == "decode" and "step_ms" in r}
runs = {os.path.basename(p)[:-5]: pts(p) for p in sorted(glob.glob("/tmp/ab/*.json"))}
json.dump(runs, open(os.environ.get("OUT", "/tmp/ab") + "/ab.json", "w"), indent=1)
for kind in ("sweep", "throughput"):
    b = {k: v for k, v in runs.items() if k.startswith(kind + "-before")}
    a = {k: v for k, v in runs.items() if k.startswith(kind + "-after")}
    if not b or not a:
        continue
    for point in sorted(next(iter(b.values())), key=str):
        bb = min(v[point] for v in b.values() if point in v); aa = min(v[point] for v in a.values() if point in v)
        print(f"{kind} {point}: before {[round(v.get(point, 0), 3) for v in b.values()]} after "
              f"{[round(v.get(point, 0), 3) for v in a.values()]}  best after/before {aa / bb:.4f}")
PY
tail -c 3000 $W/sweep-after1.log > $OUT/after1.tail 2>/dev/null; tail -c 3000 $W/sweep-before1.log > $OUT/before1.tail 2>/dev/null
