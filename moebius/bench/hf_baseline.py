"""The benchmarks' baseline: transformers' own model of the config.json (random weights), the class its
`architectures` names (`Qwen3MoeForCausalLM`, `DeepseekV2ForCausalLM`, ...; the model_type's causal-LM class where
transformers has no such class), on the benchmarks' shapes, the ways a user runs it. Points as the sweep's, modes:

- `hf-eager-1gpu`: batched decode steps with a DynamicCache of `context` tokens per request, one GPU;
- `hf-cb-1gpu`: its continuous batching (`generate_batch`: paged cache, its own CUDA graphs where the version has
  them), one GPU, timed from per-token timestamps;
- `hf-eager-tp{P}` / `hf-cb-tp{P}`: the same over the sweep's P GPUs with its tensor-parallel plan (`tp_plan="auto"`:
  DTensor shards, one process per GPU under `torch.distributed.run`, as transformers runs it). Its loader shards a
  checkpoint as it reads it; for random weights each rank builds the whole model and keeps its shard
  (`PreTrainedModel.maybe_distribute_model`, what `from_pretrained` calls before loading weights). Needs
  `accelerate` (the `bench` and `test` extras).

`python -m torch.distributed.run --nproc-per-node P -m moebius.bench.hf_baseline SPEC.json OUT.json` is the
tensor-parallel worker the sweep launches; rank 0 writes the points.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from moebius.bench.floor import decode_step_floor_ms, hardware_of
from moebius.bench.results import gpu_name
from moebius.models.registry import model_config

log = logging.getLogger("moebius")
# requests a generate() call of the throughput baseline serves together where continuous batching fails (the
# batches of a padded offline run, as a transformers user without its continuous batching serves them)
STATIC_BATCH = 64


@dataclass(frozen=True)
class BaselineSpec:
    """What a baseline run needs (the worker gets it as JSON)."""

    cfg_dict: dict[str, Any]  # the HF config.json of the model
    num_layers: int
    batches: list[int]
    context_len: int
    steps: int
    warmup: int


def point(mode: str, batch: int, context: int, step_ms: float, floor_ms: float, graph: bool, **extra: Any
          ) -> dict[str, Any]:
    return dict(mode=mode, batch=batch, context_len=context, step_ms=step_ms, floor_ms=floor_ms,
                ratio_to_floor=step_ms / floor_ms if floor_ms else None, tokens_per_s=batch / step_ms * 1e3,
                cuda_graph=graph, **extra)


def run_one_gpu(spec: BaselineSpec) -> list[dict[str, Any]]:
    """`hf-eager-1gpu` and `hf-cb-1gpu` in this process (on the CPU where there is no GPU); one error point per mode
    and batch where this transformers cannot build the model."""
    dev = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    try:
        model = _build(spec, dev)
    except BaselineUnavailable as e:
        log.warning("transformers baseline: %s", e)
        return [{"mode": m, "batch": b, "error": str(e)} for b in spec.batches for m in ("hf-eager-1gpu", "hf-cb-1gpu")]
    return _time_model(model, spec, dev, "1gpu", 1)


def run_tensor_parallel(spec: BaselineSpec, num_ranks: int, timeout_s: float) -> list[dict[str, Any]]:
    """`hf-eager-tp{P}` and `hf-cb-tp{P}`: the worker below under torch.distributed.run, one process per GPU (per
    gloo rank on the CPU). A failed run becomes one error point per mode and batch, with the end of its log."""
    modes = [f"hf-eager-tp{num_ranks}", f"hf-cb-tp{num_ranks}"]
    gc.collect()
    if torch.cuda.is_available():  # what this process's caching allocator holds would be missing on GPU 0
        torch.cuda.empty_cache()
    with tempfile.TemporaryDirectory(prefix="moebius-hf-tp-") as tmp:
        spec_path, out_path = os.path.join(tmp, "spec.json"), os.path.join(tmp, "points.json")
        with open(spec_path, "w") as f:
            json.dump(asdict(spec), f)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={num_ranks}",
               "-m", "moebius.bench.hf_baseline", spec_path, out_path]
        log_path = os.path.join(tmp, "log.txt")
        with open(log_path, "w") as log_file:
            proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT)
            try:
                proc.wait(timeout=timeout_s)
                why = f"exit {proc.returncode}"
            except subprocess.TimeoutExpired:
                proc.terminate()  # torchrun ends its ranks on SIGTERM (they run in sessions of their own)
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                why = f"no result in {timeout_s:.0f} s"
        with open(log_path) as f:
            lines = f.read().splitlines()
        # the ranks' own tracebacks, not only torchrun's summary after them
        why += ": " + "\n".join([x for x in lines if x.startswith("[rank")] or lines)[-1500:]
        if os.path.exists(out_path):
            with open(out_path) as f:
                return json.load(f)
    log.warning("transformers tensor-parallel baseline failed: %s", why)
    return [{"mode": m, "batch": b, "error": why} for b in spec.batches for m in modes]


class BaselineUnavailable(RuntimeError):
    """This transformers cannot build the model of a config.json (no such class, or its config refused)."""


def hf_model_class(cfg_dict: dict[str, Any], num_layers: int) -> tuple[type, Any]:
    """transformers' model class and config for a config.json cut to `num_layers`: the class `architectures[0]`
    names with its own config class (so a model_type transformers lacks on a known architecture, Kimi-K2's
    `kimi_k2` on DeepSeek-V3's, still builds); without such a class, the model_type's config and its causal-LM
    class. BaselineUnavailable saying what is missing."""
    import transformers

    archs = cfg_dict.get("architectures") or []
    model_type = cfg_dict.get("model_type")
    # num_hidden_layers at construction: configs derive per-layer lists (layer types, dense layers) from it
    fields = {k: v for k, v in cfg_dict.items() if k not in ("architectures", "model_type")}
    fields["num_hidden_layers"] = num_layers
    cls = getattr(transformers, archs[0], None) if archs else None
    try:
        if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel):
            return cls, cls.config_class(**fields)
        if model_type is None:
            raise BaselineUnavailable(f"transformers {transformers.__version__} has no class {archs[0]!r}"
                                      if archs else "the config.json names neither architectures nor model_type")
        config = transformers.AutoConfig.for_model(model_type, **fields)
        return transformers.MODEL_FOR_CAUSAL_LM_MAPPING[type(config)], config
    except BaselineUnavailable:
        raise
    except (ValueError, KeyError, TypeError) as e:  # an unknown model_type, no causal-LM class, a refused field
        raise BaselineUnavailable(f"transformers {transformers.__version__} cannot build {archs or model_type}: "
                                  f"{type(e).__name__}: {e}"[:500]) from e


def attn_implementation(cls: type) -> str:
    """sdpa where the class supports it (what a user gets by default on a GPU), else its eager attention."""
    return "sdpa" if getattr(cls, "_supports_sdpa", False) else "eager"


def _build(spec: BaselineSpec, dev: torch.device, mesh: Any = None, tp_size: int = 1) -> Any:
    """The model on `dev`; with a device mesh, sharded over its `tp_size` ranks by its tensor-parallel plan."""
    cls, hf_cfg = hf_model_class(spec.cfg_dict, spec.num_layers)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    torch.manual_seed(0)  # the same whole model on every rank, so the shards make one model
    with dev:
        model = cls._from_config(hf_cfg, dtype=dtype, attn_implementation=attn_implementation(cls))
    if mesh is not None:
        from transformers.distributed import DistributedConfig

        config = DistributedConfig(tp_size=tp_size, tp_plan="auto")
        model = cls.maybe_distribute_model(model, config, mesh)
    model.eval()
    with torch.no_grad():  # first-call costs (kernel selection, allocator growth) outside the timed steps
        model(input_ids=torch.randint(0, hf_cfg.vocab_size, (8, 16), generator=_gen(0)).to(dev))
    return model


def _gen(seed: int) -> torch.Generator:
    """Inputs from a CPU generator: the same on every rank whatever each rank's device RNG did."""
    return torch.Generator().manual_seed(seed)


def _time_model(model: Any, spec: BaselineSpec, dev: torch.device, suffix: str, ranks: int
                ) -> list[dict[str, Any]]:
    cfg = model_config(spec.cfg_dict, spec.num_layers)
    what = {"model": type(model).__name__, "attn_implementation": model.config._attn_implementation}
    points, hw = [], hardware_of(gpu_name())
    for b in spec.batches:
        floor = decode_step_floor_ms(cfg, ranks, "tp", b, spec.context_len, hw=hw)
        for mode, timer in ((f"hf-eager-{suffix}", _eager_step), (f"hf-cb-{suffix}", _cb_step)):
            if timer is _cb_step and not hasattr(model, "generate_batch"):
                points.append({"mode": mode, "batch": b, "error": "this transformers has no generate_batch"})
                continue
            try:
                step, extra = timer(model, b, spec, cfg.vocab_size, dev)
                points.append(point(mode, b, spec.context_len, step, floor, False, **extra, **what))
                log.info("%s batch %d: %.3f ms", mode, b, step)
            except torch.cuda.OutOfMemoryError:
                points.append({"mode": mode, "batch": b, "error": "out of memory"})
            except NoSteadyState as e:
                points.append({"mode": mode, "batch": b, "error": str(e)})
            except Exception as e:  # noqa: BLE001 - generate_batch's options move between versions: keep the sweep
                if timer is _eager_step:
                    raise
                points.append({"mode": mode, "batch": b, "error": f"{type(e).__name__}: {e}"[:500]})
            finally:
                gc.collect()
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
    return points


def _eager_step(model: Any, b: int, spec: BaselineSpec, vocab: int, dev: torch.device
                ) -> tuple[float, dict[str, Any]]:
    import inspect

    from transformers import DynamicCache

    # the cache's keyword: `cache` where `past_key_values` is deprecated (5.x's later releases), else the old name
    key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.no_grad():
        cache = DynamicCache()
        ids = torch.randint(0, vocab, (b, spec.context_len), generator=_gen(b)).to(dev)
        for s in range(0, spec.context_len, 256):  # prefill in chunks to bound activation memory
            model(input_ids=ids[:, s: s + 256], use_cache=True, **{key: cache})
        nxt = torch.randint(0, vocab, (b, 1), generator=_gen(b + 1)).to(dev)
        times = []
        for _ in range(spec.warmup + max(5, spec.steps)):
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            logits = model(input_ids=nxt, use_cache=True, **{key: cache}).logits
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            nxt.cpu()
            times.append(time.perf_counter() - t)
    return statistics.median(times[spec.warmup:]) * 1e3, {}


class NoSteadyState(RuntimeError):
    pass


def _cb_step(model: Any, b: int, spec: BaselineSpec, vocab: int, dev: torch.device
             ) -> tuple[float, dict[str, Any]]:
    """Median time between a request's consecutive tokens while every request of the batch is decoding (from the
    last request's first token to the first request's last), from generate_batch's per-token timestamps; without
    them, the difference of two runs' wall times over the difference of their output lengths."""
    from transformers import GenerationConfig

    prompts = torch.randint(0, vocab, (b, spec.context_len), generator=_gen(b)).tolist()
    steps = spec.warmup + max(5, spec.steps)

    def generate(new: int, stamps: bool) -> tuple[float, Any]:
        # no EOS: every request runs its whole length (random weights would stop some early)
        cfg = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
        kw: dict[str, Any] = {"record_timestamps": True} if stamps else {}
        if dev.type == "cpu":  # its cache takes a share of free memory per process: several ranks would take it all
            from transformers import ContinuousBatchingConfig

            pages = b * -(-(spec.context_len + new) // 256) + 2  # its default page of 256 tokens
            kw["continuous_batching_config"] = ContinuousBatchingConfig(num_blocks=pages, max_batch_tokens=1024)
        t = time.perf_counter()
        outs = model.generate_batch(inputs=prompts, generation_config=cfg, progress_bar=False, **kw)
        return time.perf_counter() - t, outs

    # requests prefilled early decode while later ones prefill: enough new tokens that all overlap for a while
    new = 2 * steps + b * spec.context_len // 1024
    for _ in range(2):
        try:
            _, outs = generate(new, True)
            stamps = [getattr(o, "timestamps", None) for o in outs.values()]
        except (TypeError, ValueError):  # a version without record_timestamps (an unexpected keyword)
            stamps = [None]
        if not all(stamps):
            break
        start, end = max(s[0] for s in stamps), min(s[-1] for s in stamps)
        gaps = [y - x for s in stamps for x, y in zip(s, s[1:], strict=False) if x >= start and y <= end]
        if len(gaps) >= steps:
            return statistics.median(gaps) * 1e3, {"method": "token timestamps", "intervals": len(gaps),
                                                   "new_tokens": new}
        new *= 4
    if all(stamps):
        raise NoSteadyState(f"hf-cb: too few steps with every request decoding ({len(gaps)} at {new // 4} new "
                            "tokens, prefill outlasting decoding)")
    short, _ = generate(steps, False)
    long, _ = generate(3 * steps, False)
    return (long - short) / (2 * steps) * 1e3, {"method": "two output lengths"}


def run_throughput(cfg_dict: dict[str, Any], num_layers: int, jobs: list[tuple[list[int], int]],
                   warmup_requests: int = 8) -> dict[str, Any]:
    """`moebius bench throughput --hf-baseline`: the same requests (prompt ids, output length; no EOS) through
    transformers' continuous batching (`init_continuous_batching`: its paged cache and scheduler) on one GPU (the CPU
    without one), every request added at once; wall time from the first added to the last finished, after an
    unmeasured run of the first `warmup_requests`; with the class run and its attention (`model`,
    `attn_implementation`). {"error": ...} where this transformers cannot build or run it."""
    dev = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    try:
        model = _build(BaselineSpec(cfg_dict, num_layers, [], 0, 0, 0), dev)
    except BaselineUnavailable as e:
        return {"error": str(e)}
    what = {"model": type(model).__name__, "attn_implementation": model.config._attn_implementation,
            "method": "continuous batching"}
    try:
        try:
            if warmup_requests:
                _serve_cb(model, jobs[:warmup_requests], dev)
            wall, out = _serve_cb(model, jobs, dev)
        except Exception as e:  # noqa: BLE001 - its continuous batching moves between versions (5.17's paged cache
            # fails DeepSeek-V2's keys, and ran out of memory for gpt-oss-20b on an H100): its generate() instead
            what["method"] = (f"generate() in static batches of {STATIC_BATCH} (continuous batching failed: "
                              f"{type(e).__name__}: {e}"[:300] + ")")
            _serve_static(model, jobs[:warmup_requests], dev)
            wall, out = _serve_static(model, jobs, dev)
    except Exception as e:  # noqa: BLE001 - keep our result
        return {"error": f"{type(e).__name__}: {e}"[:500], **what}
    finally:
        del model
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return {"wall_s": wall, "output_tokens": out, "requests_per_s": len(jobs) / wall,
            "output_tokens_per_s": out / wall, **what}


def _serve_static(model: Any, jobs: list[tuple[list[int], int]], dev: torch.device) -> tuple[float, int]:
    """(wall seconds, output tokens) of the jobs through `generate` in batches of STATIC_BATCH, in order, prompts
    padded on the left, each batch run to its longest request's length (the tokens past a request's own length are
    not counted)."""
    t0 = time.perf_counter()
    for i in range(0, len(jobs), STATIC_BATCH):
        batch = jobs[i:i + STATIC_BATCH]
        width = max(len(p) for p, _ in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in batch], device=dev)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch], device=dev)
        new = max(n for _, n in batch)
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, eos_token_id=None, pad_token_id=0)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return time.perf_counter() - t0, sum(n for _, n in jobs)


def _serve_cb(model: Any, jobs: list[tuple[list[int], int]], dev: torch.device) -> tuple[float, int]:
    """(wall seconds, output tokens) of the jobs through one continuous-batching manager."""
    from transformers import GenerationConfig

    cfg = GenerationConfig(max_new_tokens=max(n for _, n in jobs), do_sample=False, eos_token_id=None,
                           pad_token_id=0)
    kw: dict[str, Any] = {}
    if dev.type == "cpu":  # its cache takes a share of free memory: size it to the work (pages of 256 tokens)
        from transformers import ContinuousBatchingConfig

        pages = sum(-(-(len(p) + n) // 256) for p, n in jobs) + 2
        kw["continuous_batching_config"] = ContinuousBatchingConfig(num_blocks=pages, max_batch_tokens=1024)
    manager = model.init_continuous_batching(generation_config=cfg, **kw)
    manager.start()
    try:
        t0 = time.perf_counter()
        for i, (prompt, n) in enumerate(jobs):
            manager.add_request(prompt, request_id=f"r{i}", max_new_tokens=n)
        done: dict[str, int] = {}
        while len(done) < len(jobs):
            r = manager.get_result(timeout=1)
            if r is None:
                if not manager.is_running():
                    raise RuntimeError(f"its generation thread stopped with {len(jobs) - len(done)} requests left")
                continue
            if r.is_finished():
                if r.error is not None:
                    raise RuntimeError(f"request {r.request_id}: {r.error}")
                done[r.request_id] = len(r.generated_tokens)
        return time.perf_counter() - t0, sum(done.values())
    finally:
        manager.stop(block=True)


def _worker(spec_path: str, out_path: str) -> None:
    """One rank of the tensor-parallel baseline (under torch.distributed.run)."""
    from transformers.distributed import DistributedConfig

    with open(spec_path) as f:
        spec = BaselineSpec(**json.load(f))
    cls, _ = hf_model_class(spec.cfg_dict, spec.num_layers)
    world = int(os.environ["WORLD_SIZE"])
    # what from_pretrained(..., tp_plan="auto") does first: the process group, this rank's device, the mesh
    _, device_map, mesh = cls.prepare_distribute_model(
        DistributedConfig(tp_size=world, tp_plan="auto"))
    dev = torch.device(device_map)
    points = _time_model(_build(spec, dev, mesh, world), spec, dev, f"tp{world}", world)
    if int(os.environ["RANK"]) == 0:
        with open(out_path, "w") as f:
            json.dump(points, f)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s hf-tp: %(message)s")
    _worker(sys.argv[1], sys.argv[2])
