#!/usr/bin/env bash
# A/B decode sweep on one GPU: a copy of an earlier tree (before) against this tree (after), alternated, in one
# device call. Usage: git archive <rev> | tar -x -C .baseline (a folder .git/info/exclude ignores; carry it), then
# bash benchmarks/ab_sweep.sh [.baseline]. Prints each run and the best after/before per batch; $OUT/ab.json.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
ROOT=$PWD; BASE=$(cd "${1:-.baseline}" && pwd); W=/tmp/ab; mkdir -p $W; OUT=${OUT:-$W}
ARGS="bench sweep --model qwen3-30b-a3b --num-ranks 1 --modes tp --batches 1,8,64,256,1024 --context-len 512 --steps 10 --warmup 3 --eager-up-to 0 --cuda-graph-max-bs 1024 --mem-fraction 0.85"
run() {  # name dir
  (cd $2 && PYTHONPATH=$2 timeout 240 python3 -m moebius.entrypoints.cli $ARGS --output $W/$1.json) > $W/$1.log 2>&1
  echo "$1 rc $? $(date +%T)"; grep -E "^ *tp +[0-9]" $W/$1.log | tail -5
}
date +%T
for i in 1 2; do run before$i $BASE; run after$i $ROOT; done
python3 - <<'PY'
import json, glob, os
def pts(path):
    d = json.load(open(path))
    rows = d.get("points") or [r for r in d.get("rows", []) if r.get("table", "decode") == "decode"]
    return {r["batch"]: r["step_ms"] for r in rows if "step_ms" in r}
runs = {os.path.basename(p)[:-5]: pts(p) for p in sorted(glob.glob("/tmp/ab/*.json"))}
json.dump(runs, open(os.environ["OUT"] + "/ab.json", "w"), indent=1)
b = {k: v for k, v in runs.items() if k.startswith("before")}; a = {k: v for k, v in runs.items() if k.startswith("after")}
for batch in sorted(next(iter(runs.values()))):
    bb = min(v[batch] for v in b.values() if batch in v); aa = min(v[batch] for v in a.values() if batch in v)
    print(f"batch {batch:5d}: before {[round(v.get(batch, 0), 3) for v in b.values()]} after {[round(v.get(batch, 0), 3) for v in a.values()]}  best after/before {aa / bb:.4f}")
PY
tail -c 3000 $W/after1.log > $OUT/after1.tail; tail -c 3000 $W/before1.log > $OUT/before1.tail
