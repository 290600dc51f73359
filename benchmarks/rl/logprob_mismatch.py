"""The trainer–engine log-probability mismatch on Qwen3-30B-A3B shapes: each sampled token's log-probability from the
engine against transformers' forward over the same sequence (what a trainer computes), bf16 head and fp32 head.

    python benchmarks/rl/logprob_mismatch.py --output benchmarks/results/h200-p1-logprob-mismatch.json
    python benchmarks/rl/logprob_mismatch.py --device cpu --tiny --num-layers 2      (a smoke run, ~20 s)

1. The model: transformers' `Qwen3MoeForCausalLM` with the published Qwen3-30B-A3B config (moebius.config's preset)
   cut to --num-layers, random weights at a trained model's scale (every matrix std --init-std 0.02, norms 1) in
   bf16 on the device; the lm_head is then scaled so that the next-token distributions of a random prompt have a
   mean entropy of --target-entropy nats (std 0.02 alone gives logits of std ~1, a near-uniform distribution over
   152k tokens, entropy ~log V: no trained model samples from that). Saved with save_pretrained (safetensors,
   config.json, no tokenizer: the prompts are token ids) in a temporary directory.
2. The engine on it at P = 1 in this process, bf16, once with the bf16 head and once with --lm-head-dtype float32
   (each closed before the next): K prompts of random token ids at each of --prompt-lens, --max-tokens sampled at
   temperature 1 (a seed a prompt, the same for both engines), the sampled tokens' raw log-probabilities
   (`logprobs=0`).
3. The references over prompt + output: transformers' forward in bf16 (`model(input_ids).logits`, log_softmax in
   fp32: the trainer's computation) and in float32 (the same weights cast to float32): |engine - reference| of
   every sampled token, mean / p50 / p90 / p99 / max; against the fp32 forward the engine's own error, against the
   bf16 one what a trainer sees (the two bf16 computations' rounding errors both in it); `trainer_rounding` rows:
   transformers' bf16 forward against its fp32 one on the same tokens.
   The entropy of the distributions the tokens were sampled from (the fp32 forward's) is reported and checked: a
   mean near 0 or near log V means the random model does not resemble a trained one (the output says so).

Writes one JSON (tables `mismatch`, `per_length`, `summary`) and a PNG beside it (--output); prints one line a
configuration. --dtype float32 runs the engine and the "trainer" in float32 (a check of the harness: the mismatch
is then ~1e-6).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import random
import shutil
import tempfile
import time
from typing import Any

import torch

from moebius.bench import results

PRESET = "qwen3-30b-a3b"
# --tiny: the smoke run's shapes (the real vocabulary kept: the head's bf16 rounding depends on it)
TINY = dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, num_experts=16, num_experts_per_tok=4)
HEADS = {"bf16": "auto", "fp32": "float32"}  # engine head -> --lm-head-dtype
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
QUANTILES = (0.5, 0.9, 0.99)


def _parse_set(items: list[str]) -> dict[str, Any]:
    """--set KEY=VALUE (VALUE as JSON, else a string) -> {KEY: VALUE}."""
    out: dict[str, Any] = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise SystemExit(f"--set takes KEY=VALUE, got {item!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def hf_config(num_layers: int, overrides: dict[str, Any], attn: str | None, experts: str | None) -> Any:
    """transformers' Qwen3MoeConfig of the preset's shapes, num_layers decoder layers, overrides applied."""
    from transformers import Qwen3MoeConfig

    from moebius.config import PRESETS

    kw = {k: v for k, v in PRESETS[PRESET].items() if k not in ("architectures", "model_type")}
    kw.update(num_hidden_layers=num_layers, **overrides)
    if attn is not None:
        kw["attn_implementation"] = attn
    if experts is not None:
        kw["experts_implementation"] = experts
    cfg = Qwen3MoeConfig(**kw)
    cfg.architectures = ["Qwen3MoeForCausalLM"]
    return cfg


def build_model(cfg: Any, device: str, std: float, seed: int, cls: Any = None) -> torch.nn.Module:
    """The model (transformers' `cls`, Qwen3MoeForCausalLM by default) in bf16 on the device: every matrix
    N(0, std), every norm weight 1, routing bias buffers (DeepSeek-V3's e_score_correction_bias) 0."""
    if cls is None:
        from transformers import Qwen3MoeForCausalLM as cls

    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bf16: no fp32 copy of a multi-billion-parameter model
    try:
        with torch.device(device):
            model = cls(cfg)
    finally:
        torch.set_default_dtype(old)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, std, generator=g)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.zero_()
    return model.eval()


def _entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy (nats) of softmax(logits) a row, float32."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


@torch.no_grad()
def calibrate_head(model: torch.nn.Module, ids: torch.Tensor, target: float) -> dict[str, float]:
    """Scale lm_head so the mean next-token entropy over `ids` ([1, n]) is `target` nats: the logits are linear in
    the head, so the scale is found by bisection on the fp32 logits of one forward and applied once."""
    hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state[0].float()  # after the final norm
    w = model.lm_head.weight
    logits = hidden @ w.float().t()
    before = float(_entropy(logits).mean())
    lo, hi = math.log(1e-2), math.log(1e3)  # entropy falls as the scale grows
    for _ in range(30):  # the scale to ~1e-4 relative
        mid = (lo + hi) / 2
        if float(_entropy(logits * math.exp(mid)).mean()) > target:
            lo = mid
        else:
            hi = mid
    scale = math.exp((lo + hi) / 2)
    w.mul_(scale)
    after = float(_entropy(hidden @ w.float().t()).mean())
    return dict(head_scale=scale, head_std=float(w.float().std()), calib_entropy_before=before,
                calib_entropy_after=after, calib_logit_std=float((logits * scale).std()))


def make_prompts(lens: list[int], per_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lens for _ in range(per_len)]


def sample(path: str, head: str, prompts: list[list[int]], args: argparse.Namespace) -> dict[str, Any]:
    """One engine (P = 1 in process) on the checkpoint: the sampled tokens and their log-probabilities."""
    from moebius import LLM, SamplingParams

    cuda = args.device == "cuda"
    kw: dict[str, Any] = dict(model=path, device=args.device, dtype=args.dtype, lm_head_dtype=HEADS[head],
                              rank_process="off", seed=args.seed, block_size=16,
                              max_model_len=max(len(p) for p in prompts) + args.max_tokens + 16,
                              max_total_tokens=sum(len(p) + args.max_tokens + 16 for p in prompts))
    if cuda:  # a KV pool of 16k tokens at least (~16 KB a token at 8 layers): room beside the graphs' padding
        kw.update(warmup="none", cuda_graph_max_bs=args.cuda_graph_max_bs,
                  max_total_tokens=max(kw["max_total_tokens"], 16384))
    t0 = time.perf_counter()
    llm = LLM(**kw)
    try:
        start_s = time.perf_counter() - t0
        params = [SamplingParams(temperature=1.0, seed=args.seed + i, max_tokens=args.max_tokens, logprobs=0,
                                 ignore_eos=True) for i in range(len(prompts))]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        gen_s = time.perf_counter() - t0
    finally:
        llm.close()
        del llm
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    seqs = []
    for p, o in zip(prompts, outs, strict=True):
        c = o.outputs[0]
        lps = [lp[t] for lp, t in zip(c.logprobs, c.token_ids, strict=True)]
        seqs.append(dict(prompt=p, tokens=list(c.token_ids), engine=torch.tensor(lps, dtype=torch.float64)))
    return dict(seqs=seqs, start_s=start_s, generate_s=gen_s, engine_kw={k: v for k, v in kw.items() if k != "model"})


@torch.no_grad()
def reference(model: torch.nn.Module, seq: dict[str, Any], device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' log-probability of each sampled token over prompt + output (log_softmax in fp32 of the logits
    as the model returns them), and the entropy of each distribution a token was drawn from."""
    p, t = seq["prompt"], seq["tokens"]
    ids = torch.tensor([p + t[:-1]], device=device)
    logits = model(input_ids=ids, use_cache=False).logits[0, len(p) - 1:]  # the rows that predicted each token
    logp = torch.log_softmax(logits.float(), dim=-1)
    lp = logp.gather(1, torch.tensor(t, device=device)[:, None]).squeeze(1)
    ent = -(logp.exp() * logp).sum(-1)
    return lp.double().cpu(), ent.double().cpu()


def stats(d: torch.Tensor) -> dict[str, float]:
    a = d.abs()
    q = torch.quantile(a, torch.tensor(QUANTILES, dtype=a.dtype)) if a.numel() else torch.zeros(len(QUANTILES))
    return dict(tokens=a.numel(), mean_abs=float(a.mean()), max_abs=float(a.max()),
                mean_signed=float(d.mean()), **{f"p{round(x * 100)}_abs": float(v) for x, v in zip(QUANTILES, q,
                                                                                                   strict=True)})


def plot(result: dict[str, Any], png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results.table(result, "mismatch")
    s = results.summary_of(result)
    keys = ["mean_abs", "p50_abs", "p90_abs", "p99_abs", "max_abs"]
    fig, ax = plt.subplots(figsize=(9, 3.8))
    width = 0.8 / max(len(rows), 1)
    for i, r in enumerate(rows):
        vals = [max(r[k], 1e-9) for k in keys]
        ax.bar([j + i * width for j in range(len(keys))], vals, width, label=f"{r['engine_head']} head vs "
               f"{r['reference']}" if r["engine_head"] != "-" else f"{r['reference']} (trainer rounding)")
    ax.set_xticks([j + width * (len(rows) - 1) / 2 for j in range(len(keys))], [k.removesuffix("_abs") for k in keys])
    ax.set_yscale("log")
    ax.set_ylabel("|Δ logprob| (nats)")
    ax.legend(fontsize=7)
    ent = s.get("entropy_mean")
    ax.set_title(f"{s.get('shapes')}, {s.get('num_layers')} layers, {s.get('tokens_per_engine')} sampled tokens an "
                 f"engine; entropy {ent if ent is None else round(ent, 2)} of log V {s.get('log_vocab', 0):.2f}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python benchmarks/rl/logprob_mismatch.py", description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--num-layers", type=int, default=8, help="decoder layers of the preset kept (48 in the model)")
    ap.add_argument("--tiny", action="store_true", help=f"small shapes for a CPU smoke run: {TINY}")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="any Qwen3MoeConfig field over the preset's (JSON values), e.g. --set num_experts=16")
    ap.add_argument("--dtype", default="bfloat16", choices=list(DTYPES),
                    help="the engine's and the trainer's forward (float32: a check of this harness)")
    ap.add_argument("--init-std", type=float, default=0.02, help="std of every weight matrix (norms are 1)")
    ap.add_argument("--target-entropy", type=float, default=2.0,
                    help="nats: lm_head scaled to this mean next-token entropy; 0: not scaled")
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=[16, 128, 512])
    ap.add_argument("--prompts-per-len", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens sampled a prompt")
    ap.add_argument("--heads", nargs="+", default=list(HEADS), choices=list(HEADS), help="engine heads to run")
    ap.add_argument("--hf-attn", default="sdpa", help="transformers' attn_implementation (eager, sdpa)")
    ap.add_argument("--hf-experts", default=None, help="transformers' experts_implementation (eager, grouped_mm, "
                    "...; default: transformers' own)")
    ap.add_argument("--cuda-graph-max-bs", type=int, default=64)
    ap.add_argument("--checkpoint-dir", default=None, help="where the checkpoint goes (default: a temporary "
                    "directory, removed at the end)")
    ap.add_argument("--time-budget", type=float, default=1e9,
                    help="seconds: past this, the phases not begun are skipped (the result still written)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--output", default=None, help="result JSON (PNG beside it); written after every phase")
    return ap


def main() -> None:
    run(parser().parse_args())


def run(args: argparse.Namespace) -> dict[str, Any]:
    t_start = time.perf_counter()
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here (--device cpu for a smoke run)")
    overrides = {**(TINY if args.tiny else {}), **_parse_set(args.set)}
    dtype = DTYPES[args.dtype]
    shapes = PRESET + (" (--tiny)" if args.tiny else "") + "".join(f" --set {x}" for x in args.set)
    tables: dict[str, list[dict[str, Any]]] = {"mismatch": [], "per_length": []}
    summary: dict[str, Any] = dict(shapes=shapes, num_layers=args.num_layers, dtype=args.dtype)
    skipped: list[str] = []

    def over() -> bool:
        return time.perf_counter() - t_start > args.time_budget

    def save() -> None:
        summary["wall_s"] = round(time.perf_counter() - t_start, 1)
        summary["skipped"] = skipped
        if args.output is None:
            return
        note = (f"Trainer-engine log-probability mismatch at P = 1 (rank in process), {shapes}, {args.num_layers} "
                f"decoder layers, {args.dtype}, random weights (std {args.init_std}, norms 1, lm_head scaled to a "
                f"mean next-token entropy of {args.target_entropy} nats; see summary entropy_*). Engine sampled "
                f"{args.prompts_per_len} prompts of each length {args.prompt_lens} (random token ids), "
                f"{args.max_tokens} tokens each at temperature 1, logprobs=0, with the bf16 head and with "
                "--lm-head-dtype float32. Table mismatch: |engine - transformers| of each sampled token's "
                "log-probability, transformers' forward over prompt + output in the engine's dtype (hf_bf16: the "
                "trainer's computation, log_softmax in fp32) and cast to float32 (hf_fp32: the engine's own error); "
                "engine_head '-' rows: transformers bf16 against fp32 on the bf16-head engine's tokens (the "
                "trainer's own rounding). mean_signed > 0: the engine rates its sampled tokens higher than the "
                "reference (they were drawn from its distribution). Table per_length: the same per prompt length.")
        import transformers

        versions = dict(torch=torch.__version__, transformers=transformers.__version__)
        results.save_result(args.output, plot if tables["mismatch"] else None,
                            tables={k: v for k, v in tables.items() if v}, summary=summary, note=note,
                            params=results.params_of(args, overrides=overrides, **versions),
                            num_gpus=1 if cuda else 0)

    # 1. the checkpoint
    cfg = hf_config(args.num_layers, overrides, args.hf_attn, args.hf_experts)
    vocab = cfg.vocab_size
    ids_vocab = min(vocab, cfg.bos_token_id) if cfg.bos_token_id else vocab  # no special tokens in the prompts
    own_dir = args.checkpoint_dir is None
    path = tempfile.mkdtemp(prefix="moebius-logprob-") if own_dir else args.checkpoint_dir
    try:
        t0 = time.perf_counter()
        model = build_model(cfg, args.device, args.init_std, args.seed)
        summary["params_b"] = round(sum(p.numel() for p in model.parameters()) / 1e9, 3)
        if args.target_entropy > 0:
            g = torch.Generator().manual_seed(args.seed + 7)
            calib = torch.randint(0, ids_vocab, (1, 128), generator=g).to(args.device)
            summary.update(calibrate_head(model, calib, args.target_entropy))
        if dtype != torch.bfloat16:
            model.to(dtype)  # the checkpoint holds the bf16 weights' values, exactly
        os.makedirs(path, exist_ok=True)
        model.save_pretrained(path)
        summary["build_and_save_s"] = round(time.perf_counter() - t0, 1)
        print(f"checkpoint: {summary['params_b']} B parameters, {args.num_layers} layers, in {path} "
              f"({summary['build_and_save_s']} s)")

        # 2. the engines
        prompts = make_prompts(args.prompt_lens, args.prompts_per_len, ids_vocab, args.seed)
        runs: dict[str, dict[str, Any]] = {}
        for head in args.heads:
            if over():
                skipped.append(f"engine {head} head")
                continue
            runs[head] = sample(path, head, prompts, args)
            summary[f"engine_{head}_start_s"] = round(runs[head]["start_s"], 1)
            summary[f"engine_{head}_generate_s"] = round(runs[head]["generate_s"], 2)
            print(f"engine, {head} head: {len(prompts)} prompts sampled in {runs[head]['generate_s']:.1f} s")
        summary["tokens_per_engine"] = len(prompts) * args.max_tokens
        for head, r in runs.items():  # a model whose every position samples the same few tokens is degenerate too
            toks = [t for s in r["seqs"] for t in s["tokens"]]
            summary[f"engine_{head}_distinct_tokens"] = len(set(toks))
        save()

        # 3. the references: the model in its dtype, then cast to float32
        refs = ["hf_bf16", "hf_fp32"] if dtype == torch.bfloat16 else ["hf_fp32"]
        ref_lp: dict[tuple[str, str], list[torch.Tensor]] = {}
        entropies: list[torch.Tensor] = []
        for ref in refs:
            if over():
                skipped.append(f"reference {ref}")
                continue
            if ref == "hf_fp32":
                model.float()
            t0 = time.perf_counter()
            for head, r in runs.items():
                got = [reference(model, s, args.device) for s in r["seqs"]]
                ref_lp[head, ref] = [lp for lp, _ in got]
                if ref == "hf_fp32" and not entropies:
                    entropies = [e for _, e in got]
            summary[f"{ref}_s"] = round(time.perf_counter() - t0, 1)
        del model
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()

        log_v = math.log(vocab)
        if entropies:
            ent = float(torch.cat(entropies).mean())
            degenerate = ent < 0.1 or ent > 0.9 * log_v
            summary.update(entropy_mean=ent, log_vocab=log_v, entropy_ok=not degenerate)
            print(f"entropy of the sampled distributions: mean {ent:.2f} nats (log V = {log_v:.2f}): "
                  + ("DEGENERATE: a random model unlike a trained one" if degenerate else "not degenerate"))
        for (head, ref), lps in ref_lp.items():
            seqs = runs[head]["seqs"]
            d = torch.cat([s["engine"] - lp for s, lp in zip(seqs, lps, strict=True)])
            row = dict(engine_head=head, reference=ref, **stats(d))
            tables["mismatch"].append(row)
            summary[f"{head}_head_vs_{ref}.mean_abs"] = row["mean_abs"]
            summary[f"{head}_head_vs_{ref}.max_abs"] = row["max_abs"]
            summary[f"{head}_head_vs_{ref}.p99_abs"] = row["p99_abs"]
            print(f"engine {head} head vs {ref}: mean |Δ| {row['mean_abs']:.3e}  p99 {row['p99_abs']:.3e}  max "
                  f"{row['max_abs']:.3e}  bias {row['mean_signed']:+.2e}  ({row['tokens']} tokens)")
            for n in args.prompt_lens:
                dn = torch.cat([s["engine"] - lp for s, lp in zip(seqs, lps, strict=True) if len(s["prompt"]) == n])
                tables["per_length"].append(dict(engine_head=head, reference=ref, prompt_len=n, **stats(dn)))
        for head in runs:  # the trainer's own rounding on the same tokens
            if (head, "hf_bf16") in ref_lp and (head, "hf_fp32") in ref_lp:
                d = torch.cat([a - b for a, b in zip(ref_lp[head, "hf_bf16"], ref_lp[head, "hf_fp32"],
                                                     strict=True)])
                row = dict(engine_head="-", reference="hf_bf16_vs_hf_fp32", tokens_of=head, **stats(d))
                tables["mismatch"].append(row)
                summary["trainer_rounding.mean_abs"] = row["mean_abs"]
                summary["trainer_rounding.max_abs"] = row["max_abs"]
                print(f"transformers bf16 vs fp32 ({head}-head tokens): mean |Δ| {row['mean_abs']:.3e}  p99 "
                      f"{row['p99_abs']:.3e}  max {row['max_abs']:.3e}")
                break
    finally:
        if own_dir:
            shutil.rmtree(path, ignore_errors=True)
    save()
    return dict(tables=tables, summary=summary)


if __name__ == "__main__":
    main()
