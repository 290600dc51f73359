"""Greedy agreement in bf16 of the engine with transformers, on any served family's preset shapes (DeepSeek-V2-Lite
by default): per generated position, is the engine's greedy token within a small logit margin of transformers' fp32
argmax on the engine's own sequence, at least as often as transformers' own bf16 greedy scored the same way?

    python benchmarks/models/greedy_agreement.py --output benchmarks/results/h200-p1-agreement-v2-lite.json
    python benchmarks/models/greedy_agreement.py --device cpu --tiny --num-layers 2      (a smoke run)

1. The model: transformers' class of the preset's `architectures` (its config class, the preset's shapes cut to
   --num-layers, --tiny: small shapes keeping the family's features), random weights at a trained model's scale as
   benchmarks/rl/logprob_mismatch.py makes them (every matrix N(0, --init-std), norms 1, DeepSeek-V3's
   e_score_correction_bias 0, the lm_head scaled to a mean next-token entropy of --target-entropy nats), built in
   bf16, saved with save_pretrained in a temporary directory.
2. The engine on it (P = 1 in this process, --dtype): K = --per-len prompts of random token ids at each of
   --prompt-lens, --max-tokens greedy tokens each (temperature 0, EOS ignored): its sequences.
3. transformers' own greedy in --dtype on the same prompts (a KV cache, the prompts of one length in one batch,
   argmax of the last row's logits as `generate(do_sample=False)` takes it): its sequences.
4. The reference: transformers' forward over each system's prompt + output with the same weights in float32. A
   generated position's margin = the fp32 max logit - the fp32 logit of the token the system chose there (0 when it
   chose the fp32 argmax). A system agrees at a position when its margin <= --margin.

Each system: positions, the fraction with margin 0 (the fp32 argmax exactly), the fraction within --margin, mean /
p99 / max margin, the fraction of near ties (positions whose fp32 top-2 gap is below --margin: where rounding may
rightly flip the argmax), the mean entropy of the fp32 distributions (as logprob_mismatch reports it: near 0 or near
log V the random model does not resemble a trained one). Verdict: engine within-margin fraction >= transformers' own.
With --dtype float32 both systems run in float32 (a check of this harness: every margin is then 0).

Writes one JSON (tables `agreement`, `per_length`, `cdf`, `summary`) and a PNG of both systems' margin CDFs beside it
(--output); prints one line a system.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import inspect
import math
import os
import shutil
import tempfile
import time
from typing import Any

import torch

from moebius.bench import results
from moebius.config import PRESETS


def _sibling_tool(sub: str, name: str) -> Any:
    """benchmarks/<sub>/<name>.py as a module, by its file: a tool of another topic's folder, not importable by name."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), sub, f"{name}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


lm = _sibling_tool("rl", "logprob_mismatch")  # its model scale, head calibration, prompts and entropy

PRESET = "deepseek-v2-lite"
DTYPES = lm.DTYPES
SYSTEMS = ("engine", "transformers")
QUANTILE = 0.99
# --tiny: small values of the shape keys a preset has (the vocabulary kept: the head's bf16 rounding depends on it)
TINY = dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_attention_heads=4, head_dim=32,
            num_experts=16, n_routed_experts=16, num_experts_per_tok=4, kv_lora_rank=32, qk_nope_head_dim=32,
            qk_rope_head_dim=16, v_head_dim=32)
TINY_Q_LORA = 48  # q_lora_rank where the preset projects q through a LoRA (None stays None: V2-Lite's direct q)
TINY_GROUPS = 4  # at most this many expert groups (16 experts: 4 a group), topk_group at most half of them


def tiny_shapes(preset: dict[str, Any]) -> dict[str, Any]:
    """Small shapes over the preset's keeping its family's features: GQA stays GQA, q-LoRA stays q-LoRA, grouped
    routing stays grouped, a dense first layer stays (first_k_dense_replace at most 1)."""
    out = {k: v for k, v in TINY.items() if k in preset}
    if "num_key_value_heads" in preset:
        gqa = preset["num_key_value_heads"] < preset["num_attention_heads"]
        out["num_key_value_heads"] = out["num_attention_heads"] // 2 if gqa else out["num_attention_heads"]
    if preset.get("q_lora_rank"):
        out["q_lora_rank"] = TINY_Q_LORA
    if preset.get("n_group", 1) > 1:
        out["n_group"] = min(preset["n_group"], TINY_GROUPS)
        out["topk_group"] = min(preset["topk_group"], out["n_group"] // 2)
    if preset.get("first_k_dense_replace", 0) > 1:
        out["first_k_dense_replace"] = 1
    return out


def model_class(preset: str) -> Any:
    """transformers' CausalLM class of the preset's `architectures` (its config class: `.config_class`)."""
    import transformers

    arch = PRESETS[preset]["architectures"][0]
    cls = getattr(transformers, arch, None)
    if cls is None:
        raise SystemExit(f"--preset {preset}: transformers {transformers.__version__} has no {arch}")
    return cls


def hf_config(preset: str, num_layers: int, overrides: dict[str, Any], attn: str | None,
              experts: str | None) -> Any:
    """The preset's config in transformers' config class of its architecture, num_layers decoder layers, overrides
    applied (the class, not model_type: Kimi K2's model_type is not transformers' but its architecture is)."""
    p = PRESETS[preset]
    kw = {k: v for k, v in p.items() if k not in ("architectures", "model_type")}
    kw.update(num_hidden_layers=num_layers, **overrides)
    if attn is not None:
        kw["attn_implementation"] = attn
    if experts is not None:
        kw["experts_implementation"] = experts
    cfg = model_class(preset).config_class(**kw)
    cfg.architectures = list(p["architectures"])
    return cfg


def build_model(preset: str, cfg: Any, device: str, std: float, seed: int) -> torch.nn.Module:
    """logprob_mismatch's model (every matrix N(0, std), norms 1, routing bias buffers 0) of the preset's class."""
    return lm.build_model(cfg, device, std, seed, model_class(preset))


def engine_greedy(path: str, prompts: list[list[int]], args: argparse.Namespace) -> dict[str, Any]:
    """The engine (P = 1 in process) on the checkpoint: greedy tokens of every prompt, EOS ignored."""
    from moebius import LLM, SamplingParams

    cuda = args.device == "cuda"
    kw: dict[str, Any] = dict(model=path, device=args.device, dtype=args.dtype, lm_head_dtype=args.lm_head_dtype,
                              rank_process="off", seed=args.seed, block_size=16,
                              max_model_len=max(len(p) for p in prompts) + args.max_tokens + 16,
                              max_total_tokens=sum(len(p) + args.max_tokens + 16 for p in prompts))
    if cuda:  # no start-up warm-up (its shapes are not this run's); a pool with room beside the graphs' padding
        kw.update(warmup="none", cuda_graph_max_bs=args.cuda_graph_max_bs,
                  max_total_tokens=max(kw["max_total_tokens"], 16384))
    kw.update(lm._parse_set(args.engine_set))
    t0 = time.perf_counter()
    llm = LLM(**kw)
    try:
        start_s = time.perf_counter() - t0
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        gen_s = time.perf_counter() - t0
    finally:
        llm.close()
        del llm
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    seqs = [list(o.outputs[0].token_ids) for o in outs]
    return dict(seqs=seqs, start_s=start_s, generate_s=gen_s, engine_kw={k: v for k, v in kw.items() if k != "model"})


@torch.no_grad()
def hf_greedy(model: torch.nn.Module, prompts: list[list[int]], n: int, device: str) -> list[list[int]]:
    """transformers' own greedy tokens in the model's dtype: a KV cache, the prompts of one length as one batch (no
    padding), each step the argmax of the last row's logits in float32 (as generate(do_sample=False) takes it)."""
    from transformers import DynamicCache

    # the cache's keyword: `cache` in recent transformers, `past_key_values` (deprecated there) before
    key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    by_len: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        by_len.setdefault(len(p), []).append(i)
    out: list[list[int]] = [[] for _ in prompts]
    for idx in by_len.values():
        step = torch.tensor([prompts[i] for i in idx], device=device)
        cache = DynamicCache(config=model.config)  # filled in place by each forward
        toks: list[torch.Tensor] = []
        for _ in range(n):
            logits = model(input_ids=step, use_cache=True, logits_to_keep=1, **{key: cache}).logits
            step = logits[:, -1].float().argmax(-1, keepdim=True)
            toks.append(step)
        got = torch.cat(toks, dim=1).tolist()
        for j, i in enumerate(idx):
            out[i] = got[j]
    return out


@torch.no_grad()
def score(model: torch.nn.Module, prompt: list[int], tokens: list[int], device: str) -> dict[str, torch.Tensor]:
    """The float32 model over prompt + tokens: at each generated position the margin (max logit - the chosen
    token's logit), the top-2 gap and the entropy."""
    ids = torch.tensor([prompt + tokens[:-1]], device=device)
    logits = model(input_ids=ids, use_cache=False, logits_to_keep=len(tokens)).logits[0].float()
    chosen = logits.gather(1, torch.tensor(tokens, device=device)[:, None]).squeeze(1)
    top2 = logits.topk(2, dim=-1).values
    return dict(margin=(top2[:, 0] - chosen).double().cpu(), gap=(top2[:, 0] - top2[:, 1]).double().cpu(),
                entropy=lm._entropy(logits).double().cpu())


def thresholds(margin: float) -> list[float]:
    """The CDF's margins: 0, a log grid from 1e-3 to 10 logits (8 points a decade), and --margin."""
    return sorted({0.0, margin, *(10.0 ** (k / 8) for k in range(-24, 9))})


def agreement(margins: torch.Tensor, gaps: torch.Tensor, entropy: torch.Tensor, margin: float) -> dict[str, Any]:
    """One system's agreement with the fp32 argmax over its positions."""
    n = margins.numel()
    within = float((margins <= margin).double().mean()) if n else float("nan")
    return dict(positions=n, exact_fraction=float((margins == 0).double().mean()) if n else float("nan"),
                within_margin_fraction=within,
                within_margin_stderr=math.sqrt(within * (1 - within) / n) if n else float("nan"),
                mean_margin=float(margins.mean()) if n else float("nan"),
                p99_margin=float(torch.quantile(margins, QUANTILE)) if n else float("nan"),
                max_margin=float(margins.max()) if n else float("nan"),
                near_tie_fraction=float((gaps < margin).double().mean()) if n else float("nan"),
                entropy_mean=float(entropy.mean()) if n else float("nan"))


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def plot(result: dict[str, Any], png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = results.summary_of(result)
    fig, ax = plt.subplots(figsize=(8, 4))
    for system in SYSTEMS:
        rows = [r for r in results.table(result, "cdf") if r["system"] == system]
        if rows:
            ax.step([r["margin"] for r in rows], [r["fraction"] for r in rows], where="post",
                    label=f"{system} {s.get('dtype')} ({rows[0]['positions']} positions)")
    ax.set_xscale("symlog", linthresh=1e-3)
    ax.axvline(s.get("margin", 0.0), color="gray", linestyle=":", label=f"--margin {s.get('margin')}")
    ax.set_xlabel("margin: fp32 max logit - fp32 logit of the chosen token")
    ax.set_ylabel("fraction of positions <= margin")
    ax.legend(fontsize=8, loc="lower right")
    ent = s.get("entropy_mean")
    ax.set_title(f"{s.get('shapes')}, {s.get('num_layers')} layers; greedy vs transformers' fp32 argmax; entropy "
                 f"{ent if ent is None else round(ent, 2)} of log V {s.get('log_vocab', 0):.2f}", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python benchmarks/models/greedy_agreement.py",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default=PRESET, choices=sorted(PRESETS), help="the model's shapes (random weights)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--num-layers", type=int, default=8, help="decoder layers of the preset kept")
    ap.add_argument("--tiny", action="store_true", help=f"small shapes for a CPU smoke run: {TINY}, where the "
                    "preset has the key, family features kept (see tiny_shapes)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="any config field over the preset's (JSON values), e.g. --set vocab_size=4096")
    ap.add_argument("--engine-set", action="append", default=[], metavar="KEY=VALUE",
                    help="any engine flag (LLM keyword, JSON values), e.g. --engine-set disable_cuda_graph=true")
    ap.add_argument("--dtype", default="bfloat16", choices=list(DTYPES),
                    help="the engine's and transformers' greedy runs (float32: a check of this harness)")
    ap.add_argument("--lm-head-dtype", default="auto", help="the engine's --lm-head-dtype (auto: --dtype)")
    ap.add_argument("--margin", type=float, default=0.1,
                    help="logits: a position agrees when the fp32 logit of the chosen token is within this of the "
                    "fp32 max; of the order of a bf16 forward's logit error against fp32 at a trained model's "
                    "scale (benchmarks/results/h200-p1-logprob-mismatch.json, trainer_rounding), so a token inside "
                    "it is a rounding tie and one beyond it a real disagreement; table cdf gives every margin")
    ap.add_argument("--init-std", type=float, default=0.02, help="std of every weight matrix (norms are 1)")
    ap.add_argument("--target-entropy", type=float, default=2.0,
                    help="nats: lm_head scaled to this mean next-token entropy; 0: not scaled")
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=[16, 128, 512])
    ap.add_argument("--per-len", type=int, default=16, help="prompts of each length")
    ap.add_argument("--max-tokens", type=int, default=64, help="greedy tokens a prompt")
    ap.add_argument("--hf-attn", default="sdpa", help="transformers' attn_implementation (eager, sdpa)")
    ap.add_argument("--hf-experts", default=None, help="transformers' experts_implementation (eager, grouped_mm, "
                    "...; default: transformers' own)")
    ap.add_argument("--cuda-graph-max-bs", type=int, default=64)
    ap.add_argument("--checkpoint-dir", default=None, help="where the checkpoint goes (default: a temporary "
                    "directory, removed at the end)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--output", default=None, help="result JSON (PNG beside it)")
    return ap


def main(argv: list[str] | None = None) -> dict[str, Any]:
    return run(parser().parse_args(argv))


def run(args: argparse.Namespace) -> dict[str, Any]:
    t_start = time.perf_counter()
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here (--device cpu for a smoke run)")
    if args.max_tokens < 1 or args.per_len < 1 or min(args.prompt_lens) < 1:
        raise SystemExit("--max-tokens, --per-len and every --prompt-lens must be >= 1")
    overrides = {**(tiny_shapes(PRESETS[args.preset]) if args.tiny else {}), **lm._parse_set(args.set)}
    dtype = DTYPES[args.dtype]
    shapes = args.preset + (" (--tiny)" if args.tiny else "") + "".join(f" --set {x}" for x in args.set)
    tables: dict[str, list[dict[str, Any]]] = {"agreement": [], "per_length": [], "cdf": []}
    summary: dict[str, Any] = dict(shapes=shapes, num_layers=args.num_layers, dtype=args.dtype, margin=args.margin)

    cfg = hf_config(args.preset, args.num_layers, overrides, args.hf_attn, args.hf_experts)
    vocab = cfg.vocab_size
    bos = getattr(cfg, "bos_token_id", None)
    ids_vocab = min(vocab, bos) if bos else vocab  # no special tokens in the prompts
    own_dir = args.checkpoint_dir is None
    path = tempfile.mkdtemp(prefix="moebius-agreement-") if own_dir else args.checkpoint_dir
    seqs: dict[str, list[list[int]]] = {}
    try:
        # 1. the checkpoint (bf16 values; --dtype float32 holds the same values in float32)
        t0 = time.perf_counter()
        model = build_model(args.preset, cfg, args.device, args.init_std, args.seed)
        summary["params_b"] = round(sum(p.numel() for p in model.parameters()) / 1e9, 3)
        if args.target_entropy > 0:
            g = torch.Generator().manual_seed(args.seed + 7)
            calib = torch.randint(0, ids_vocab, (1, 128), generator=g).to(args.device)
            summary.update(lm.calibrate_head(model, calib, args.target_entropy))
        if dtype != torch.bfloat16:
            model.to(dtype)
        os.makedirs(path, exist_ok=True)
        model.save_pretrained(path)
        summary["build_and_save_s"] = round(time.perf_counter() - t0, 1)
        print(f"checkpoint: {summary['params_b']} B parameters, {args.num_layers} layers, in {path} "
              f"({summary['build_and_save_s']} s)")
        prompts = lm.make_prompts(args.prompt_lens, args.per_len, ids_vocab, args.seed)

        # 2. the engine's greedy sequences
        eng = engine_greedy(path, prompts, args)
        seqs["engine"] = eng["seqs"]
        summary.update(engine_start_s=round(eng["start_s"], 1), engine_generate_s=round(eng["generate_s"], 2))
        print(f"engine: {len(prompts)} prompts x {args.max_tokens} greedy tokens in {eng['generate_s']:.1f} s")

        # 3. transformers' own greedy sequences, in --dtype
        t0 = time.perf_counter()
        seqs["transformers"] = hf_greedy(model, prompts, args.max_tokens, args.device)
        summary["transformers_generate_s"] = round(time.perf_counter() - t0, 1)

        # 4. the fp32 reference over each system's sequences
        model.float()
        t0 = time.perf_counter()
        precision = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("highest")  # a true fp32 reference: no TF32 matmuls, whoever enabled them
        try:
            scored = {s: [score(model, p, t, args.device) for p, t in zip(prompts, seqs[s], strict=True)]
                      for s in SYSTEMS}
        finally:
            torch.set_float32_matmul_precision(precision)
        summary["reference_s"] = round(time.perf_counter() - t0, 1)
        del model
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    finally:
        if own_dir:
            shutil.rmtree(path, ignore_errors=True)

    def cat(system: str, key: str, n: int | None = None) -> torch.Tensor:
        return torch.cat([x[key] for p, x in zip(prompts, scored[system], strict=True) if n in (None, len(p))])

    for system in SYSTEMS:
        m, gap, ent = cat(system, "margin"), cat(system, "gap"), cat(system, "entropy")
        row = dict(system=system, dtype=args.dtype, **agreement(m, gap, ent, args.margin),
                   distinct_tokens=len({t for s in seqs[system] for t in s}))
        tables["agreement"].append(row)
        for k in ("exact_fraction", "within_margin_fraction", "mean_margin", "max_margin"):
            summary[f"{system}.{k}"] = row[k]
        print(f"{system} {args.dtype}: {row['positions']} positions, fp32 argmax {row['exact_fraction']:.4f}, "
              f"within {args.margin} {row['within_margin_fraction']:.4f}, margin mean {row['mean_margin']:.3e} max "
              f"{row['max_margin']:.3e}, near ties {row['near_tie_fraction']:.4f}")
        for n in args.prompt_lens:
            tables["per_length"].append(dict(system=system, prompt_len=n, **agreement(
                cat(system, "margin", n), cat(system, "gap", n), cat(system, "entropy", n), args.margin)))
        for x in thresholds(args.margin):
            tables["cdf"].append(dict(system=system, margin=x, positions=m.numel(),
                                      fraction=float((m <= x).double().mean())))

    eng_row, hf_row = tables["agreement"]
    log_v = math.log(vocab)
    ent = eng_row["entropy_mean"]
    degenerate = ent < 0.1 or ent > 0.9 * log_v
    prefixes = [common_prefix(a, b) for a, b in zip(seqs["engine"], seqs["transformers"], strict=True)]
    summary.update(
        entropy_mean=ent, log_vocab=log_v, entropy_ok=not degenerate,
        engine_at_least_transformers=eng_row["within_margin_fraction"] >= hf_row["within_margin_fraction"],
        engine_minus_transformers=eng_row["within_margin_fraction"] - hf_row["within_margin_fraction"],
        exact_engine_at_least_transformers=eng_row["exact_fraction"] >= hf_row["exact_fraction"],
        identical_sequences=sum(n == args.max_tokens for n in prefixes), sequences=len(prefixes),
        mean_common_prefix=sum(prefixes) / len(prefixes), wall_s=round(time.perf_counter() - t_start, 1))
    print(f"entropy: mean {ent:.2f} nats (log V = {log_v:.2f})"
          + (": DEGENERATE, a random model unlike a trained one" if degenerate else ""))
    print(f"verdict: engine {eng_row['within_margin_fraction']:.4f} "
          f"{'>=' if summary['engine_at_least_transformers'] else '<'} transformers "
          f"{hf_row['within_margin_fraction']:.4f} within {args.margin}; {summary['identical_sequences']} of "
          f"{len(prefixes)} sequences identical")

    if args.output is not None:
        import transformers

        note = (f"Greedy agreement at P = 1 (rank in process), {shapes}, {args.num_layers} decoder layers, "
                f"{args.dtype}, random weights (std {args.init_std}, norms 1, lm_head scaled to a mean next-token "
                f"entropy of {args.target_entropy} nats). {args.per_len} prompts of each length {args.prompt_lens} "
                f"(random token ids), {args.max_tokens} greedy tokens each (EOS ignored), by the engine "
                f"(--lm-head-dtype {args.lm_head_dtype}) and by transformers' own greedy (KV cache, same-length "
                "prompts batched). Each system's sequences scored by transformers' forward in float32 (the same "
                "weights): a position's margin = fp32 max logit - fp32 logit of the system's token. Table "
                f"agreement: fraction at margin 0 (the fp32 argmax) and within --margin {args.margin}, mean / p99 / "
                "max margin, near ties (fp32 top-2 gap below --margin), entropy of the fp32 distributions; "
                "per_length the same by prompt length; cdf the fraction within each margin. Summary "
                "engine_at_least_transformers: the engine's within-margin fraction >= transformers' own.")
        versions = dict(torch=torch.__version__, transformers=transformers.__version__)
        results.save_result(args.output, plot, tables=tables, summary=summary, note=note,
                            params=results.params_of(args, overrides=overrides, **versions),
                            num_gpus=1 if cuda else 0)
    return dict(tables=tables, summary=summary, seqs=seqs)


if __name__ == "__main__":
    main()
