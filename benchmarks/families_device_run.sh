#!/usr/bin/env bash
# The model families' first runs on one H200 (issues 44, 45, 46): DeepSeek-V2-Lite shapes with dummy bf16 weights,
# gpt-oss-20b's, Qwen3-30B-A3B's in FP8. `tests` and `families` passed at 01422685 but for OLMoE and GPT-OSS; OLMoE's
# `retest` passed at 8a37444 (an H100), GPT-OSS's at f5344d7 (an H200), and `fp8tests` / `mxfp4tests` there too: no
# family or format is refused on a GPU now. Each argument is one step, run in the order given; group them into device calls of
# under 10 minutes:
#   align     the fused MoE's GPU tests and benchmarks/kernels/align_phases.py (the align's block table)
#   tests     the family's GPU tests: float32 tokens against transformers through decode graphs, step pieces and eager
#             steps across a switch; the latent kernels against their references; pieces against eager steps in bf16
#   retest    OLMoE's and GPT-OSS's GPU parity tests (`families` failed them: a test checkpoint's head_dim 8, and the
#             oracle's near tie on the device's transformers)
#   families  the same float32 GPU parity for the GQA families not yet run on a GPU (GLM-4.5, Qwen2-MoE, Mixtral,
#             OLMoE, GPT-OSS; windowed variants: the sliding layers' tables in the graphs, the kernel's window and
#             sinks; every one passed, none is `cpu_only` now)
#   bars      the three bars in one call: DeepSeek-V2-Lite's and gpt-oss-20b's decode sweeps from batch 64, FP8's in
#             both scopes (`sweep`, `gptsweep`, `fp8scope`'s sweeps at the bars' batches)
#   sweep     decode steps at batches 1 .. 1024 (context 1024) against the floor model extended to MLA
#             (the bar: better than 1.3x the floor from batch 64)
#   work      256 whole requests (prompts 64-512, 128 out) against transformers' continuous batching in the same call
#   fp8tests  --quantization fp8's GPU path (the fused MoE and the projections on FP8 rows): its GPU tests
#   fp8       Qwen3-30B-A3B shapes' decode sweep in FP8 (bf16's is h200-p1-sweep.json), and
#             the switch's expert permutes on FP8 rows beside bf16's (reshard_copy.py)
#   fp8scope  `fp8sweep` and `fp8work`'s requests with --quantization-scope experts (dense weights in bf16) beside the
#             default and bf16, one call
#   fp8work   256 whole requests in FP8 and in bf16 (one call), greedy agreement of the FP8 engine with the bf16
#             model's fp32 argmax beside transformers' bf16 (8 of 48 layers); fp8worka8 the requests in W8A8 too
#   mxfp4tests --quantization mxfp4's GPU path (the fused MoE on MXFP4 rows, W4A16): its GPU tests
#   mxfp4     gpt-oss-20b
#             shapes' decode sweep in MXFP4 (after `gptoss`: bf16's is h200-p1-gpt-oss-20b-sweep.json)
#   mxfp4work 256 whole requests at gpt-oss-20b shapes in MXFP4 and in bf16 (one call: the timings compare)
#   mxfp4ab   `mxfp4`'s sweep at 1, 64 and 256 with this tree and with an older tree's package, one call (OLD: a
#             folder holding its `moebius/`, e.g. `git archive 41c9a22 moebius | tar -x -C $OLD`; OLDC: its full hash)
#   fp8prompt the fused MoE on FP8 rows at 64, 1024 and 4096 tokens (16-, 64- and 128-row blocks): this tree against an
#             older tree's kernels (OLD: a folder holding its `moebius/`; 6a54b89's took float16 chunk products at every
#             block size), W8A8 and a bf16 control (moe_fp8_variants.py)
#   mxfp4tune128 gpt-oss-20b's MXFP4 MoE at 128 tokens searched (MXFP4_CONFIGS' 16-row blocks since the H100's search
#             there beat CONFIGS' 32-row ones, which spill at 4 warps: moe_spills.py)
#   gptoss    gpt-oss-20b shapes (issue 45, after `families` passes GPT-OSS's GPU test): decode sweep against its floor
#             (the sliding layers read a window), the same at a 16k context (the floor's and the step's growth past
#             the window come from the full layers only), 256 whole requests against transformers
#   gptsweep  `gptoss`'s decode sweep alone; gptsweep512 the same at a 512 context (batch 1024 fits an H100)
#   routertune the float32 router's launches (benchmarks/kernels/router_tune.py)
#   moetests  the shared experts' launches (SwiGLU, the add inside the pairs' sum) and the MoE blocks' GPU tests
#   qktests   the q/k rope kernel without norms and the GQA families' GPU parity through it
#   profile   the top kernels of a decode step at batches 1 and 64 (4 layers): Qwen3-30B-A3B in FP8 and bf16,
#             DeepSeek-V2-Lite; gpt-oss-20b at 256
#   bigprofile gpt-oss-20b's decode at 512 and 1024 (graphs), and the kernels of DeepSeek-V2-Lite's and gpt-oss-20b's
#             large-batch steps without PDL (each kernel's time its own); midprofile the same kernels at the batches just over the bar
#             (DeepSeek-V2-Lite 256 and 512, gpt-oss-20b 512)
#   sharedstream DeepSeek-V2-Lite's decode at 64-1024 with and without --disable-shared-experts-stream; sharedtests
#             its GPU parity (a run with the flag)
#   groups    the fused MoE's blocks interleaved in groups against the default order (moe_tune.py --groups)
#   splittune the FP8 projection's launches with K splits (W8A16; 8, 64, 256 rows) and W8A16's decode kernels at 64
#             and 256 (no PDL: each kernel's own time)
#   fp8tune   the fused MoE's tiles and the projection's launch searched on FP8 rows (moe_tune.py --quantization
#             fp8, linear_fp8_tune.py)
#   moetune   the fused MoE's bf16 tiles searched at gpt-oss-20b's and DeepSeek-V2-Lite's expert shapes
#   mlatune   the latent decode attention's launch shapes against its default (benchmarks/kernels/mla_tune.py);
#             mlatune16 at 16 heads and batches 64 to 1024 only; mlatune128 at 128 heads with 64-head blocks
#             beside the kernel's own (batches 32, 128); each with whole KV tiles unmasked or every tile masked
#             (`kernels/mla.DecodeLaunch.whole`); mlaproto the prototype kernels of
#             benchmarks/kernels/mla_proto.py against it, from HBM and from L2
#   halves    the fused MoE's half blocks: their GPU test, and gpt-oss-20b's MoE searched with them (256-1024)
#   fp8rows   the FP8 GPU tests, and W8A16's fused MoE on rows in one segment a row against a segment a chunk
#             (kernels/fp8_rows.py; timed as a variant, fp8_trailer_variant.py, on an H100 at fc81c3a)
#   tabletests GPT-OSS's own MoE table and the half blocks against the reference, the DeepSeek family's GPU tests
#   groupsearch gpt-oss-20b's MoE tiles searched at 512 and 1024 tokens, each BM's best also in groups of 2 and 4
#   fp8moetune the fused MoE on FP8 rows in W8A16 at 64 and 256 (decode) and 4096 tokens (experts unpacked); fp8stages the same
#             at 64 and 256 searched with up to 6 pipeline stages (moe_tune.py --fp8-max-stages)
#   v3wide    DeepSeek-V3 cut to 4 layers (128 heads a rank: the latent decode's wide head blocks) decode steps at 1, 32, 128
#             (its 3 dense layers' slots hold no experts since the twenty-second session: 2 slots of 21 GiB)
#   agree     bf16 agreement with transformers' fp32 argmax on the engine's own sequences, beside transformers' bf16
#             (8 of 27 layers, random weights at a trained model's scale)
#   downdots  W8A16's down in float16 dots in decode's blocks (benchmarks/kernels/fp8_down_dots_variant.py) against
#             the tree at 8-512 tokens (moe_fp8_variants.py)
#   stepprof  the whole-request workload's first twelve steps each under torch.profiler, bf16 twice on one engine and
#             FP8 once (benchmarks/steps/profile_workload.py): which first-run GEMMs wait for the device to drain
#             (the worst step's trace comes back in $OUT), and whether FP8's prompt steps now wait on the device
#             (one unpack pass, `fused_moe.UNPACK_BYTES`)
# Usage (device): MOEBIUS_COMMIT=<full hash> bash benchmarks/families_device_run.sh <steps>. Measured on an H200 at
#   d701103 (docs/performance.md, thirteenth session): `sweep gptsweep fp8sweep work gptosswork fp8work`, `splittune
#   bigprofile`, `sharedstream agree`, `fp8`; the bars fail at DeepSeek-V2-Lite's 256-1024, gpt-oss-20b's 512-1024
#   and FP8's 64-256. On H100s at 494dd47-bc79944 (fourteenth session): `fp8tests fp8sweep fp8work`, `fp8moetune
#   midprofile mlatune16 groupsearch`, and benchmarks/kernels/fp8_prefill_moe.py (docs/performance.md). On H100s at
#   32e6972-a6ce148 (fifteenth session): `fp8scope` (--quantization-scope experts) and benchmarks/kernels/mla_proto.py.
#   Sixteenth session (f6f3178, an H100): benchmarks/kernels/align_phases.py, DeepSeek-V2-Lite's sweep with acq_rel
#   and relaxed align atomics, mla_proto.py with a register stage (dropped). Seventeenth (f926faf, an H100): `align`,
#   the FP8 GPU tests, W8A16 in f16 dots against the dequantizing tiles (moe_tune.py --old; reverted), DeepSeek-V2-Lite's
#   and gpt-oss-20b's sweeps at 64-512; the align A/B and --fp8-max-stages (853b974, an H100). Eighteenth (H100s,
#   a0941bc and 4c55779): the FP8 GPU tests, benchmarks/kernels/moe_fp8_variants.py (the FP8 MoE's variants and a bf16
#   control from HBM and from L2: the reverted W8A16 variants are no faster even from L2, so the H200 need not time
#   them), linear_fp8_tune.py --w8a8 --table-only, FP8 sweeps in W8A8. Nineteenth (a0773e1, an H100): Nsight Compute
#   on the fused MoE, FP8 against bf16, and two-chunk K steps (moe_fp8_variants.py). Twenty-first (fd12bfb, an H100):
#   `mxfp4tests retest mxfp4ab mlatune128` and the bars' sweeps (docs/performance.md). Twenty-second (594c909, an
#   H100): `halves mxfp4tests`, mla_tune.py with whole tiles, the MXFP4 sweep (`v3wide` did not fit an H100 then: every
#   slot held experts). Twenty-third (09f24ac and 29de6ca, H100s): `tabletests bars v3wide`, moe_tune.py at DeepSeek-V2-Lite's
#   shapes, moe_fp8_variants.py and Nsight Compute's warp stalls of the FP8 MoE. Twenty-fourth (fc81c3a and 2dd9c08,
#   H100s): `fp8trail` (since replaced by the tree's layout), `fp8rows bars`. Twenty-fifth (dde5bbd and d7f68ec,
#   H100s): moe_fp8_variants.py on W8A8 and float16 variants, the FP8 GPU tests. Twenty-sixth: no GPU (sixteen starts
#   refused). Twenty-seventh (3d96d97 and 9ef3c83, H100s): `fp8tests`, `fp8prompt mxfp4tune128`, the workload's step
#   profiles (profile_workload.py, bf16 as is and with CUDA_MODULE_LOADING=EAGER, FP8) and FP8's whole requests after
#   a warm-up with 256 MiB and one-pass unpacking. Twenty-eighth (60db1ec, an H100): `fp8tests`, moe_fp8_variants.py
#   (one block scale a tile against 081679b's kernels, W8A8 in 128-row blocks, W8A16's chunk dots at prompt blocks),
#   `stepprof` (the first-use wait: the lm_head's cuBLAS kernel), FP8 whole requests in W8A8 and W8A16 after a warm-up.
#   Next, on an H200: `bars fp8work` (FP8's whole requests against bf16 with one unpack pass and one scale a tile),
#   `downdots`, `mlatune16`, then `halves moetune v3wide`, `mlaproto`. Results land under the card's names, so rename an earlier record
#   (`<name>-<commit>.json`) before copying a new one in.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export MOEBIUS_COMMIT=${MOEBIUS_COMMIT:?export MOEBIUS_COMMIT=<the full 40-character hash measured> (the device tree is a copy)}
W=${W:-/tmp/g}; mkdir -p $W; R=benchmarks/results; B="python3 -m moebius.entrypoints.cli bench"
# results named by the card that ran them (h200-p1-*, or h100-p1-* on a lent H100)
C=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -q H100 && echo h100 || echo h200)
export TRITON_CACHE_DIR=$W/triton
M="--model deepseek-v2-lite --load-format dummy --num-ranks 1"
O=${OUT:-/tmp/out}; mkdir -p $O
# $OUT brings back at most 8 files: after each step this call's results (JSON and plots) and the logs so far are
# packed into two archives there, results.tgz and logs.tgz, so a call cut at its limit keeps what finished.
touch $W/.start; mkdir -p $W/logs
TOP=$PWD
keep() { (cd $TOP/$R && find . -maxdepth 1 -name "$C-p1-*" -newer $W/.start | tar czf $O/results.tgz -T -)
         (cd $W/logs && tar czf $O/logs.tgz *.log); true; }
t() { local n=$1; shift; timeout $1 "${@:2}" > $W/logs/$n.log 2>&1; echo "$n rc=$? $(date +%T)"; grep -v "^INFO\|Warning\|leaked\|nanobind" $W/logs/$n.log | tail -12; keep; }
P="python3 -m pytest -v --tb=short --timeout 200 -m gpu -p no:cacheprovider"
date +%T
for step in "$@"; do case $step in
families)
  t families 320 $P tests/test_glm4_moe_family.py tests/test_qwen2_moe_family.py tests/test_mixtral_family.py tests/test_olmoe_family.py tests/test_gpt_oss_family.py ;;
retest)  # the families that failed `families` once mended: OLMoE (passed on an H100 at 8a37444) and GPT-OSS
  t retest 150 $P tests/test_olmoe_family.py tests/test_gpt_oss_family.py ;;
align)  # the align's block table (602fb63) on a GPU: the fused MoE's GPU tests, then its phases' timings
  t align_tests 150 $P tests/test_gpu.py -k "experts_match_reference or fp8_rows_experts"
  t align_phases 120 python3 benchmarks/kernels/align_phases.py $R/$C-p1-align-phases.json ;;
tests)
  t gpu_tests 250 $P tests/test_deepseek_family.py tests/test_deepseek_moe.py tests/test_gpu.py -k "latent or deepseek or graph_replay" ;;
moetests)  # the shared experts' activation in one launch and their add inside the pair sum; the MoE blocks through them
  t moe_tests 150 $P tests/test_gpu.py -k "swiglu or shared_experts or pairs_summed or fused_experts"
  t moe_blocks 150 $P tests/test_deepseek_moe.py tests/test_glm4_moe_family.py tests/test_qwen2_moe_family.py ;;
fp8sweep)  # `fp8`'s decode sweep alone (W8A16, the default since a740521)
  t fp8_sweep 150 $B sweep --model qwen3-30b-a3b --load-format dummy --num-ranks 1 --quantization fp8 --modes tp --cuda-graph-max-bs 1024 --batches 1,8,64,256,1024 --context-len 1024 --output $R/$C-p1-qwen3-30b-fp8-sweep.json ;;
fp8scope)  # FP8 with the dense weights in bf16 (--quantization-scope experts) beside the default, one call: decode
  # sweeps (the same FP8 floor) and whole requests beside bf16's
  S="--model qwen3-30b-a3b --load-format dummy --num-ranks 1 --quantization fp8 --modes tp --cuda-graph-max-bs 1024 --context-len 1024"
  [ $C = h100 ] && S="$S --batches 1,8,64,256" || S="$S --batches 1,8,64,256,1024"
  t fp8_sweep 150 $B sweep $S --output $R/$C-p1-qwen3-30b-fp8-sweep.json
  t fp8_sweep_experts 150 $B sweep $S --quantization-scope experts --output $R/$C-p1-qwen3-30b-fp8-experts-sweep.json
  Q="--model qwen3-30b-a3b --load-format dummy --num-ranks 1 --num-prompts 256 --prompt-len-dist uniform --prompt-len-range 64,512 --output-len 128"
  t fp8_work_experts 150 $B throughput $Q --quantization fp8 --quantization-scope experts --output $R/$C-p1-qwen3-30b-fp8-experts-throughput.json
  t fp8_work 150 $B throughput $Q --quantization fp8 --output $R/$C-p1-qwen3-30b-fp8-throughput.json
  t fp8_work_bf16 150 $B throughput $Q --output $R/$C-p1-qwen3-30b-fp8-throughput-bf16.json ;;
fp8sweepw8a8)  # the same in W8A8 (--fp8-activations)
  t fp8_sweep_w8a8 150 $B sweep --model qwen3-30b-a3b --load-format dummy --num-ranks 1 --quantization fp8 --fp8-activations --modes tp --cuda-graph-max-bs 256 --batches 1,8,64,256 --context-len 1024 --output $R/$C-p1-qwen3-30b-fp8-w8a8-sweep.json ;;
routertune)  # the float32 router's launches (DeepSeek-V2-Lite's and V3's routers) against the upcast copy + cuBLAS
  t router_tune 120 python3 benchmarks/kernels/router_tune.py $R/$C-p1-router-tune.json ;;
bars)  # the three issues' bars in one call (from batch 64, context 1024; an H100 holds gpt-oss-20b's and FP8's KV to
  # 512): DeepSeek-V2-Lite, gpt-oss-20b, FP8 in both scopes
  X="--load-format dummy --num-ranks 1 --modes tp --cuda-graph-max-bs 1024 --context-len 1024"
  [ $C = h100 ] && L=64,128,256,512 || L=64,128,256,512,1024
  F="--model qwen3-30b-a3b $X --quantization fp8 --batches ${L/,128/}"
  t bars_fp8 150 $B sweep $F --output $R/$C-p1-qwen3-30b-fp8-sweep.json
  t bars_fp8_experts 150 $B sweep $F --quantization-scope experts --output $R/$C-p1-qwen3-30b-fp8-experts-sweep.json
  t bars_deepseek 150 $B sweep $M --modes tp --cuda-graph-max-bs 1024 --batches 64,128,256,512,1024 --context-len 1024 --output $R/$C-p1-deepseek-v2-lite-sweep.json
  t bars_gptoss 150 $B sweep --model gpt-oss-20b $X --batches $L --output $R/$C-p1-gpt-oss-20b-sweep.json ;;
sweep)
  t sweep 200 $B sweep $M --modes tp --cuda-graph-max-bs 1024 --batches 1,2,4,8,16,32,64,128,256,512,1024 --context-len 1024 --output $R/$C-p1-deepseek-v2-lite-sweep.json ;;
work)
  t work 240 $B throughput $M --num-prompts 256 --prompt-len-dist uniform --prompt-len-range 64,512 --output-len 128 --hf-baseline --output $R/$C-p1-deepseek-v2-lite-throughput.json ;;
fp8tests)
  t fp8_tests 100 $P tests/test_fp8_experts.py tests/test_gpu.py -k "fp8" ;;
fp8)
  t fp8_sweep 150 $B sweep --model qwen3-30b-a3b --load-format dummy --num-ranks 1 --quantization fp8 --modes tp --cuda-graph-max-bs 1024 --batches 1,8,64,256,1024 --context-len 1024 --output $R/$C-p1-qwen3-30b-fp8-sweep.json
  t fp8_reshard 60 python3 benchmarks/switch/reshard_copy.py --quantization fp8 --elems 16384 --output $R/$C-p1-qwen3-30b-fp8-reshard-copy.json
  t bf16_reshard 60 python3 benchmarks/switch/reshard_copy.py --elems 16384 --output $R/$C-p1-qwen3-30b-fp8-reshard-copy-bf16.json ;;
fp8work)
  Q="--model qwen3-30b-a3b --load-format dummy --num-ranks 1 --num-prompts 256 --prompt-len-dist uniform --prompt-len-range 64,512 --output-len 128"
  t fp8_work 200 $B throughput $Q --quantization fp8 --output $R/$C-p1-qwen3-30b-fp8-throughput.json
  t fp8_work_bf16 150 $B throughput $Q --output $R/$C-p1-qwen3-30b-fp8-throughput-bf16.json
  t fp8_agree 200 python3 benchmarks/models/greedy_agreement.py --preset qwen3-30b-a3b --num-layers 8 --engine-set quantization=fp8 --output $R/$C-p1-qwen3-30b-fp8-agreement.json ;;
fp8worka8)  # `fp8work`'s whole requests in W8A8 (--fp8-activations: prompt sizes through the FP8 kernels' float8
  # dots, activations quantized once) beside W8A16 and bf16 in one call
  Q="--model qwen3-30b-a3b --load-format dummy --num-ranks 1 --num-prompts 256 --prompt-len-dist uniform --prompt-len-range 64,512 --output-len 128"
  t fp8_work_w8a8 200 $B throughput $Q --quantization fp8 --fp8-activations --output $R/$C-p1-qwen3-30b-fp8-w8a8-throughput.json
  t fp8_work 200 $B throughput $Q --quantization fp8 --output $R/$C-p1-qwen3-30b-fp8-throughput.json
  t fp8_work_bf16 150 $B throughput $Q --output $R/$C-p1-qwen3-30b-fp8-throughput-bf16.json ;;
mxfp4)
  G="--model gpt-oss-20b --load-format dummy --num-ranks 1 --quantization mxfp4"
  t mxfp4_sweep 150 $B sweep $G --modes tp --batches 1,4,16,64,256,1024 --context-len 1024 --output $R/$C-p1-gpt-oss-20b-mxfp4-sweep.json ;;
mxfp4tests)
  t mxfp4_tests 150 $P tests/test_mxfp4_experts.py tests/test_gpu.py -k "mxfp4" ;;
mxfp4ab)
  G="--model gpt-oss-20b --load-format dummy --num-ranks 1 --quantization mxfp4 --modes tp --batches 1,64,256 --context-len 1024"
  t mxfp4ab_new 150 $B sweep $G --output $R/$C-p1-gpt-oss-20b-mxfp4-sweep-ab.json
  (cd "${OLD:?set OLD to an older tree holding moebius/}" && export PYTHONPATH=$PWD MOEBIUS_COMMIT=${OLDC:?set OLDC} &&
    t mxfp4ab_old 150 $B sweep $G --output $TOP/$R/$C-p1-gpt-oss-20b-mxfp4-sweep-ab-$(echo $OLDC | cut -c1-7).json)
  keep ;;
fp8prompt)
  mkdir -p $W/old && cp "${OLD:?set OLD to an older tree holding moebius/}"/moebius/kernels/{fused_moe,linear}.py $W/old/
  t fp8prompt 200 python3 benchmarks/kernels/moe_fp8_variants.py $R/$C-p1-moe-fp8-prompt-blocks.json --variants \
    tree=moebius/kernels old=$W/old --w8a8 tree --bf16 tree --batches 64 1024 4096 ;;
mxfp4tune128)
  t mxfp4tune128 150 python3 benchmarks/kernels/moe_tune.py --preset gpt-oss-20b --ranks 1 --modes tp --quantization mxfp4 --batches 128 --output $R/$C-p1-moe-tune-mxfp4-128.json ;;
mxfp4work)
  G="--model gpt-oss-20b --load-format dummy --num-ranks 1 --num-prompts 256 --prompt-len-dist uniform --prompt-len-range 64,512 --output-len 128"
  t mxfp4_work 200 $B throughput $G --quantization mxfp4 --output $R/$C-p1-gpt-oss-20b-mxfp4-throughput.json
  t mxfp4_work_bf16 200 $B throughput $G --output $R/$C-p1-gpt-oss-20b-mxfp4-throughput-bf16.json ;;
gptoss)
  G="--model gpt-oss-20b --load-format dummy --num-ranks 1"
  t gptoss_sweep 150 $B sweep $G --modes tp --cuda-graph-max-bs 1024 --batches 1,4,16,64,128,256,512,1024 --context-len 1024 --output $R/$C-p1-gpt-oss-20b-sweep.json
  t gptoss_long 90 $B sweep $G --modes tp --batches 1,8,64 --context-len 16384 --output $R/$C-p1-gpt-oss-20b-long-context.json
  t gptoss_work 200 $B throughput $G --num-prompts 256 --prompt-len-dist uniform --prompt-len-range 64,512 --output-len 128 --hf-baseline --output $R/$C-p1-gpt-oss-20b-throughput.json ;;
gptsweep)  # `gptoss`'s decode sweep alone (an H100 holds the KV of batch 512 at most at context 1024)
  t gptoss_sweep 150 $B sweep --model gpt-oss-20b --load-format dummy --num-ranks 1 --modes tp --cuda-graph-max-bs 1024 --batches 1,4,16,64,128,256,512,1024 --context-len 1024 --output $R/$C-p1-gpt-oss-20b-sweep.json ;;
gptsweep512)  # the same at a 512 context, where an H100 holds batch 1024's KV
  t gptoss_sweep512 150 $B sweep --model gpt-oss-20b --load-format dummy --num-ranks 1 --modes tp --cuda-graph-max-bs 1024 --batches 1,4,16,64,128,256,512,1024 --context-len 512 --output $R/$C-p1-gpt-oss-20b-sweep-context512.json ;;
qktests)  # the q/k rope kernel without q/k norms (GPT-OSS, Mixtral, Qwen2-MoE take it now) and its families' GPU parity
  t qk_tests 200 $P tests/test_gpu.py -k "qk_norm_rope" tests/test_gpt_oss_family.py tests/test_mixtral_family.py tests/test_qwen2_moe_family.py tests/test_glm4_moe_family.py ;;
gptosswork)  # `gptoss`'s whole requests alone (its transformers baseline: generate() in static batches where
  # continuous batching runs out of memory)
  t gptoss_work 200 $B throughput --model gpt-oss-20b --load-format dummy --num-ranks 1 --num-prompts 256 --prompt-len-dist uniform --prompt-len-range 64,512 --output-len 128 --hf-baseline --output $R/$C-p1-gpt-oss-20b-throughput.json ;;
profile)  # the top kernels of a decode step (graph replay) at batches 1 and 64: FP8 and bf16 rows, DeepSeek-V2-Lite
  S="python3 benchmarks/steps/profile_decode.py --num-layers 4 --batch 1 64 --context 1024 --graphs-only"
  t profile_fp8 120 $S --model qwen3-30b-a3b --quantization fp8 --output $R/$C-p1-decode-profile-fp8.json
  t profile_bf16 120 $S --model qwen3-30b-a3b --output $R/$C-p1-decode-profile-bf16.json
  t profile_deepseek 120 $S --model deepseek-v2-lite --output $R/$C-p1-decode-profile-deepseek.json
  t profile_gptoss 120 $S --model gpt-oss-20b --batch 256 --output $R/$C-p1-decode-profile-gpt-oss.json ;;  # (1.34x at 256)
bigprofile)  # the large batches that miss the bar (DeepSeek-V2-Lite from 512, gpt-oss-20b): each kernel's own time
  S="python3 benchmarks/steps/profile_decode.py --num-layers 4 --context 1024 --graphs-only --disable-pdl --top 40"
  t gptoss_big 150 $B sweep --model gpt-oss-20b --load-format dummy --num-ranks 1 --modes tp --cuda-graph-max-bs 1024 --batches 512,1024 --context-len 1024 --output $R/$C-p1-gpt-oss-20b-sweep-big.json
  t bigprofile_deepseek 120 $S --model deepseek-v2-lite --batch 64 1024 --output $R/$C-p1-decode-profile-deepseek-big.json
  t bigprofile_gptoss 120 $S --model gpt-oss-20b --batch 1024 --output $R/$C-p1-decode-profile-gpt-oss-big.json ;;
midprofile)  # the batches just over the bar on the H200: DeepSeek-V2-Lite at 256 and 512, gpt-oss-20b at 512 (no PDL)
  S="python3 benchmarks/steps/profile_decode.py --num-layers 4 --context 1024 --graphs-only --disable-pdl --top 40"
  t midprofile_deepseek 120 $S --model deepseek-v2-lite --batch 256 512 --output $R/$C-p1-decode-profile-deepseek-mid.json
  t midprofile_gptoss 120 $S --model gpt-oss-20b --batch 512 --output $R/$C-p1-decode-profile-gpt-oss-mid.json ;;
sharedstream)  # DeepSeek-V2-Lite's decode with the shared experts on a side stream (the default) and after the routed
  # experts (--disable-shared-experts-stream) in the same call
  S="$B sweep $M --modes tp --cuda-graph-max-bs 1024 --batches 64,256,512,1024 --context-len 1024"
  t shared_off 150 $S --disable-shared-experts-stream --output $R/$C-p1-deepseek-v2-lite-sweep-shared-inline.json
  t shared_on 150 $S --output $R/$C-p1-deepseek-v2-lite-sweep-shared-stream.json
  ;;
sharedtests)  # the DeepSeek family's GPU parity (with its --disable-shared-experts-stream run)
  t shared_tests 200 $P tests/test_deepseek_family.py -k greedy_equals_transformers_on_the_gpu ;;
groups)  # the fused MoE's blocks interleaved in groups (`TileConfig.group`) against the default order, where experts
  # take several blocks: gpt-oss-20b and DeepSeek-V2-Lite at large decode batches, Qwen3-30B-A3B at prompt sizes
  for p in gpt-oss-20b:"256 512 1024" deepseek-v2-lite:"512 1024" qwen3-30b-a3b:"1024 2048 8192"; do
    t groups_${p%%:*} 100 python3 benchmarks/kernels/moe_tune.py --preset ${p%%:*} --ranks 1 --modes tp --no-search --groups 1 2 4 8 --batches ${p#*:} --output $R/$C-p1-moe-groups-${p%%:*}.json
  done ;;
splittune)  # the projection on FP8 rows with its K split (W8A16, decode's rows), and the W8A16 step's kernels each
  # timed alone (no PDL) at 64 and 256
  t splittune 330 python3 benchmarks/kernels/linear_fp8_tune.py $O/$C-p1-linear-fp8-split-tune.json --rows 64 8 256  # (into $OUT as it goes)
  t fp8profile 150 python3 benchmarks/steps/profile_decode.py --num-layers 4 --batch 64 256 --context 1024 --graphs-only --disable-pdl --top 30 --model qwen3-30b-a3b --quantization fp8 --output $R/$C-p1-decode-profile-fp8-w8a16.json ;;
fp8tune)  # the fused MoE's tiles on FP8 rows at Qwen3-30B-A3B's shapes (never searched: bf16's are used)
  t fp8tune 300 python3 benchmarks/kernels/moe_tune.py --preset qwen3-30b-a3b --ranks 1 --modes tp --quantization fp8 --batches 1 8 64 256 2048 --output $R/$C-p1-moe-tune-fp8.json
  t fp8lineartune 240 python3 benchmarks/kernels/linear_fp8_tune.py $R/$C-p1-linear-fp8-tune.json ;;
moetune)  # the fused MoE's bf16 tiles at gpt-oss-20b's and DeepSeek-V2-Lite's expert shapes (CONFIGS were searched at
  # Qwen3-30B-A3B's)
  t moetune_gptoss 200 python3 benchmarks/kernels/moe_tune.py --preset gpt-oss-20b --ranks 1 --modes tp --batches 64 128 256 512 1024 --output $R/$C-p1-moe-tune-gpt-oss-20b.json
  t moetune_deepseek 200 python3 benchmarks/kernels/moe_tune.py --preset deepseek-v2-lite --ranks 1 --modes tp --batches 64 128 256 1024 --output $R/$C-p1-moe-tune-deepseek-v2-lite.json ;;
halves)  # half blocks (TileConfig.halves) on the GPU: their test at every sorted table row (TMA included), then
  # gpt-oss-20b's MoE searched with them beside every BM's best (128-row blocks from 17 pairs an expert too)
  t half_tests 150 $P tests/test_gpu.py -k "half_blocks"
  t halfsearch 240 python3 benchmarks/kernels/moe_tune.py --preset gpt-oss-20b --ranks 1 --modes tp --batches 256 512 1024 --output $R/$C-p1-moe-halves-gpt-oss-20b.json ;;
tabletests)  # GPT-OSS's own MoE table and the half blocks against the reference, the DeepSeek family's GPU parity
  t table_tests 200 $P tests/test_gpu.py -k "gpt_oss_shape_table or half_blocks" tests/test_deepseek_family.py ;;
fp8rows)  # the FP8 rows in one segment a row (gate|up, q|k|v; down's too on one rank): the FP8 GPU tests, then
  # W8A16's fused MoE on them against the same weights a segment a chunk (the layout before), one call
  t fp8_tests 150 $P tests/test_fp8_experts.py tests/test_gpu.py -k "fp8"
  t fp8rows_whole 100 python3 benchmarks/kernels/moe_fp8_variants.py $R/$C-p1-moe-fp8-whole-rows.json --variants tree=moebius/kernels --bf16 tree --batches 8 64 256
  t fp8rows_chunks 100 python3 benchmarks/kernels/moe_fp8_variants.py $R/$C-p1-moe-fp8-chunk-rows.json --variants tree=moebius/kernels --batches 8 64 256 --chunk-rows ;;
mlatune16)  # the same at DeepSeek-V2-Lite's 16 heads and the bar's batches (the H200's kernel ran 2.3x its cache's
  # bytes at 64, 1.4x at 1024: benchmarks/results/h200-p1-decode-profile-deepseek-big.json)
  t mlatune16 300 python3 benchmarks/kernels/mla_tune.py $R/$C-p1-mla-tune-16-heads.json --heads 16 --batches 64 128 256 1024 --kv-tiles 32 64 ;;
groupsearch)  # gpt-oss-20b's MoE at 512 and 1024 tokens: every BM's best tiles, each also with its blocks in groups
  t groupsearch 200 python3 benchmarks/kernels/moe_tune.py --preset gpt-oss-20b --ranks 1 --modes tp --groups 2 4 --batches 512 1024 --output $R/$C-p1-moe-groupsearch-gpt-oss-20b.json ;;
fp8moetune)  # the fused MoE on FP8 rows (W8A16) at decode sizes and at 4096 tokens (the unpacked experts' path)
  t fp8moetune 250 python3 benchmarks/kernels/moe_tune.py --preset qwen3-30b-a3b --ranks 1 --modes tp --quantization fp8 --batches 64 256 4096 --output $R/$C-p1-moe-tune-fp8-w8a16.json ;;
fp8stages)  # W8A16's decode tiles searched with up to 6 pipeline stages (the engine caps FP8 rows' at 3; at 16-row
  # blocks 6 stages of every searched tile fit Hopper's shared memory)
  t fp8stages 250 python3 benchmarks/kernels/moe_tune.py --preset qwen3-30b-a3b --ranks 1 --modes tp --quantization fp8 --fp8-max-stages 6 --batches 64 256 --output $R/$C-p1-moe-tune-fp8-stages.json ;;
mlaproto)  # prototype latent decode kernels against kernels/mla's, from HBM and from L2 (each kernel's ceiling)
  t mlaproto 150 python3 benchmarks/kernels/mla_proto.py $R/$C-p1-mla-variants.json ;;
mlatune)  # the latent decode attention's launch shapes (splits, tile, warps, stages) at 16 and 128 heads
  t mlatune 300 python3 benchmarks/kernels/mla_tune.py $R/$C-p1-mla-tune.json ;;
mlatune128)  # DeepSeek-V3's 128 heads (a rank of EP): the kernel's own launch (64-head blocks on 8 warps since
  # ef68441) against 64-head blocks' other shapes, whole tiles unmasked or not
  t mlatune128 150 python3 benchmarks/kernels/mla_tune.py $R/$C-p1-mla-tune-128-heads.json --heads 128 --batches 32 128 --head-blocks 64 --kv-tiles 32 64 ;;
v3wide)  # DeepSeek-V3's 128 heads a rank (4 layers: 3 dense, 1 MoE) through the engine's decode graphs: the wide head
  # blocks (a88a365) in a whole step, beside mlatune128's launches
  t v3wide 200 $B sweep --model deepseek-v3 --num-layers 4 --load-format dummy --num-ranks 1 --modes tp --batches 1,32,128 --context-len 1024 --output $R/$C-p1-deepseek-v3-4-layers-sweep.json ;;
stepprof)
  QW="--model qwen3-30b-a3b --load-format dummy --num-ranks 1 --num-prompts 256 --prompt-len-dist uniform --prompt-len-range 64,512 --output-len 128 --steps 12"
  t stepprof 150 python3 benchmarks/steps/profile_workload.py $QW --output $R/$C-p1-workload-steps.json --trace $O/steps-trace.json.gz
  t stepprof_fp8 150 python3 benchmarks/steps/profile_workload.py $QW --reps 1 --quantization fp8 --output $R/$C-p1-workload-steps-fp8.json ;;
downdots)
  python3 benchmarks/kernels/fp8_down_dots_variant.py $W/vdown
  t downdots 200 python3 benchmarks/kernels/moe_fp8_variants.py $R/$C-p1-moe-fp8-down-dots.json --variants tree=moebius/kernels vdown=$W/vdown --bf16 tree --batches 8 64 128 256 512 ;;
agree)
  t agree 140 python3 benchmarks/models/greedy_agreement.py --preset deepseek-v2-lite --num-layers 8 --output $R/$C-p1-deepseek-v2-lite-agreement.json ;;
*) echo "unknown step $step"; exit 2 ;;
esac; done
true
