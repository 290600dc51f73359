"""`moebius bench serve`: an asynchronous load generator for any OpenAI-compatible server (`moebius serve`, vLLM, ...).
Requests arrive as a Poisson process (`--request-rate`, `--num-prompts`, seeded length distributions), as the bursty
trace of `moebius bench bursty` (`--trace bursty`, shaped by its workload flags `--burst1-rate` ... `--scale`), or as
a JSONL file says (`--replay`). Each is streamed from /v1/completions as token ids (`ignore_eos`: exactly
`max_tokens`). Reports TTFT, TPOT, ITL, end-to-end latency, throughput, goodput and failures, for the run and in time
bins, with the server's layout timeline (`GET /admin/status`, where it has one). JSON + PNG.

    moebius bench serve --base-url http://127.0.0.1:8000 --num-prompts 200 --request-rate 20 \\
        --prompt-len-dist uniform --prompt-len-range 64,512 --output-len 128 --output benchmarks/results/serve.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import logging
import math
import random
import time
from collections.abc import AsyncIterator
from typing import Any

from moebius.bench import bursty
from moebius.bench.results import default_num_gpus, gpu_name, params_of, save_result, summary_of
from moebius.bench.serve_stats import (
    Rec,
    Row,
    align,
    bins_of,
    layout_changes,
    per_step_ms,
    report,
    step_intervals,
    step_ms,
    summarize,
)
from moebius.bench.workload import lognormal, prompts_of

log = logging.getLogger("moebius")


# ---- the workload ----

def lengths(rng: random.Random, n: int, dist: str, mid: int, span: tuple[int, int] | None, what: str) -> list[int]:
    if dist == "fixed":
        return [mid] * n
    if span is None:
        raise ValueError(f"--{what}-len-dist {dist} needs --{what}-len-range A,B")
    lo, hi = span
    if dist == "uniform":
        return [rng.randint(lo, hi) for _ in range(n)]
    return lognormal(rng, n, median=mid, p99=hi, lo=lo, hi=hi)


def replay(path: str, rng: random.Random, vocab: int) -> list[Rec]:
    recs = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            try:
                if line.strip():
                    o = json.loads(line)
                    prompt = o.get("prompt_token_ids", o.get("prompt"))
                    prompt = prompts_of(rng, [int(o["prompt_len"])], vocab)[0] if prompt is None else prompt
                    recs.append(Rec(0, float(o["arrival_s"]), prompt, len(prompt) if isinstance(prompt, list) else
                                    None, int(o["output_len"])))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{n}: {e!r} (want arrival_s, output_len and one of prompt_len, prompt, "
                                 "prompt_token_ids)") from None
    recs.sort(key=lambda r: r.scheduled_s)
    for i, r in enumerate(recs):
        r.index = i
    return recs


def workload(a: argparse.Namespace) -> list[Rec]:
    rng = random.Random(a.seed)
    if a.replay:
        return replay(a.replay, rng, a.vocab_size)
    if a.trace == "bursty":
        return [Rec(i, j.arrival, j.prompt, len(j.prompt), j.output_len)
                for i, j in enumerate(bursty.jobs_of(a, a.vocab_size))]
    gaps = [rng.expovariate(a.request_rate) if math.isfinite(a.request_rate) else 0.0 for _ in range(a.num_prompts)]
    times = list(itertools.accumulate(gaps))
    plens = lengths(rng, a.num_prompts, a.prompt_len_dist, a.prompt_len, a.prompt_len_range, "prompt")
    olens = lengths(rng, a.num_prompts, a.output_len_dist, a.output_len, a.output_len_range, "output")
    prompts = prompts_of(rng, plens, a.vocab_size)
    return [Rec(i, t, p, len(p), o) for i, (t, p, o) in enumerate(zip(times, prompts, olens, strict=True))]


# ---- the client ----

class Timeline:
    """The server's layout timeline from /admin/status, de-duplicated by `t` (a switch's later copy carries its
    device times: it replaces the first)."""

    def __init__(self) -> None:
        self.samples: dict[float, Row] = {}
        self.switches: dict[float, Row] = {}
        self.available: bool | None = None  # None: not asked yet; False: no /admin/status there
        self.world_size: int | None = None
        self.http_cpu: list[tuple[int, float]] = []  # (engine steps so far, the HTTP process's CPU s) per read

    def http_cpu_ms(self) -> float | None:
        """The HTTP process's mean CPU a step (ms) between the first and the last read: the run's."""
        if len(self.http_cpu) < 2 or self.http_cpu[-1][0] <= self.http_cpu[0][0]:
            return None
        (n0, c0), (n1, c1) = self.http_cpu[0], self.http_cpu[-1]
        return 1e3 * (c1 - c0) / (n1 - n0)

    async def read(self, client: Client) -> None:
        if self.available is False:
            return
        try:
            status, st = await client.get_json("/admin/status", timeout=10)
            if status == 404 and not self.available:  # a server without it: stop asking
                self.available = False
            if status != 200:
                return
            self.available = True
            self.world_size = st.get("world_size", self.world_size)
            tl = st.get("timeline") or {}
            self.samples.update({s["t"]: s for s in tl.get("samples", [])})
            self.switches.update({s["t"]: s for s in tl.get("switches", [])})
            if st.get("http_cpu_s") is not None and tl.get("samples"):
                self.http_cpu.append((tl["samples"][-1].get("steps") or 0, st["http_cpu_s"]))
        except Exception as e:  # a slow, gone or odd status must not end the run
            log.warning("GET /admin/status: %r", e)


class Client:
    """The HTTP side of the load generator, on aiohttp: its C HTTP parser streams a chunk for a fraction of the CPU
    httpx (pure-Python h11) took, whose client fell seconds behind its send schedule at hundreds of streams, so that
    the run measured the client (docs/performance-history.md, "The served step at 384 streams";
    benchmarks/results/h200-p1-serve-steady384-ahead.json against h200-p1-serve-steady384-aiohttp.json)."""

    def __init__(self, base_url: str, api_key: str | None, request_timeout: float) -> None:
        try:
            import aiohttp
        except ImportError:
            raise ValueError("`moebius bench serve` needs aiohttp: pip install 'moebius[bench]'") from None

        self.base = base_url.rstrip("/")
        self.session = aiohttp.ClientSession(
            headers={"Authorization": f"Bearer {api_key}"} if api_key else {},
            connector=aiohttp.TCPConnector(limit=0),  # no request waits for a socket
            # per read, as a stream's tokens come: a long stream is not cut at a total
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=60, sock_read=request_timeout))

    async def get_json(self, path: str, timeout: float | None = None) -> tuple[int, Any]:
        """(HTTP status, the JSON body; None unless 200)."""
        import aiohttp

        kw = {"timeout": aiohttp.ClientTimeout(total=timeout)} if timeout else {}
        async with self.session.get(self.base + path, **kw) as resp:
            return resp.status, (await resp.json(content_type=None) if resp.status == 200 else None)

    async def events(self, path: str, body: dict[str, Any], r: Rec) -> AsyncIterator[bytes]:
        """POST `body` and yield the `data:` payload of each server-sent event (r.status: the HTTP status)."""
        async with self.session.post(self.base + path, json=body) as resp:
            r.status = resp.status
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {(await resp.read()).decode(errors='replace')[:200]}")
            rest = b""
            async for piece in resp.content.iter_any():  # (whole lines: an event may outgrow readline's limit)
                *lines, rest = (rest + piece).split(b"\n")
                for line in lines:
                    if line.startswith(b"data:"):
                        yield line[5:].strip()

    async def close(self) -> None:
        await self.session.close()


async def send(client: Client, a: argparse.Namespace, model: str, r: Rec, t0: float) -> None:
    body = {"model": model, "prompt": r.prompt, "max_tokens": r.output_len, "ignore_eos": True,
            "temperature": a.temperature, "stream": True, "stream_options": {"include_usage": True},
            **({} if a.no_token_ids else {"return_token_ids": True})}
    usage: Row = {}
    done, r.sent_s = False, time.perf_counter() - t0
    try:
        stream = client.events("/v1/completions", body, r)
        async with contextlib.aclosing(stream):
            async for data in stream:
                if done := data == b"[DONE]":
                    break
                if not data:
                    continue
                now, ev = time.perf_counter() - t0, json.loads(data)
                if "error" in ev:
                    r.error = f"stream error: {json.dumps(ev['error'])[:200]}"
                usage = ev.get("usage") or usage
                n = 0
                for c in ev.get("choices") or []:
                    r.tokens_from = "token_ids" if "token_ids" in c else r.tokens_from
                    n += len(c.get("token_ids") or []) if "token_ids" in c else int(bool(c.get("text")))  # 1 a chunk
                if n:
                    r.first_s = now if r.first_s is None else r.first_s
                    r.chunk_s.append(now)
                    r.chunk_tokens.append(n)
    except Exception as e:  # an HTTP error, transport errors, bad JSON: the request failed, the run goes on
        r.error = str(e) if isinstance(e, RuntimeError) else f"{type(e).__name__}: {e}"[:300]
    r.end_s = time.perf_counter() - t0
    r.error = r.error or (None if done else "the stream ended before [DONE]")
    r.output_tokens = sum(r.chunk_tokens)
    if r.tokens_from != "token_ids":
        r.tokens_from = "usage" if usage.get("completion_tokens") is not None else "chunks"
        r.output_tokens = usage.get("completion_tokens", r.output_tokens)
    r.prompt_len = usage.get("prompt_tokens", r.prompt_len)


async def run(a: argparse.Namespace, recs: list[Rec]) -> tuple[str, float, Timeline, float]:
    """Send every request at its time; (model name, duration s, the timeline, its last sample's `t` before)."""
    client = Client(a.base_url, a.api_key, a.request_timeout)
    try:
        model = a.model_name
        if model is None:
            try:
                status, models = await client.get_json("/v1/models")
                if status != 200:
                    raise RuntimeError(f"HTTP {status}")
                card = models["data"][0]
            except Exception as e:  # the CLI's error line, not a traceback
                raise ValueError(f"GET {a.base_url}/v1/models: {type(e).__name__}: {e} (is the server up? "
                                 "--api-key? or give --model-name)") from None
            model, limit = card["id"], card.get("max_model_len") or math.inf
            if too_long := sum((r.prompt_len or 0) + r.output_len > limit for r in recs):
                log.warning("%d requests are longer than the server's max_model_len %s: they fail", too_long, limit)
        tl, stop = Timeline(), asyncio.Event()
        await tl.read(client)
        before_t = max(tl.samples, default=-math.inf)

        async def poll() -> None:
            while not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), a.status_every)
                await tl.read(client)

        gate = asyncio.Semaphore(a.max_concurrency or len(recs))  # a wait here shows as send lag (sent - scheduled)
        poller, t0, tasks = asyncio.create_task(poll()), time.perf_counter(), []

        async def one(r: Rec) -> None:
            async with gate:
                await send(client, a, model, r, t0)

        for r in recs:
            await asyncio.sleep(max(0.0, r.scheduled_s - (time.perf_counter() - t0)))
            tasks.append(asyncio.create_task(one(r)))
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        stop.set()
        await poller
        await tl.read(client)
    finally:
        await client.close()
    return model, duration, tl, before_t


# ---- output ----

def plot(path: str, bins: list[Row], changes: list[tuple[float, str]], switches: list[Row], title: str) -> None:
    """TTFT and TPOT per bin (mean and p99); EP shaded and switches dashed, from the timeline."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(9, 5), sharex=True)
    mid, end = [(b["bin_start_s"] + b["bin_end_s"]) / 2 for b in bins], bins[-1]["bin_end_s"]
    for ax, key, unit in ((axes[0], "ttft_ms", "TTFT (ms)"), (axes[1], "tpot_ms", "TPOT (ms)")):
        for q in ("mean", "p99"):
            pts = [(x, b[f"{key}.{q}"]) for x, b in zip(mid, bins, strict=True) if b[f"{key}.{q}"] is not None]
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=q)
        for (t, mode), e in zip(changes, [t for t, _ in changes[1:]] + [end], strict=False):  # none without a status
            if mode == "ep" and e > 0:
                ax.axvspan(max(t, 0), min(e, end), color="tab:orange", alpha=0.15, lw=0)
        for w in switches:
            if w["done"] and w["run_t_s"] is not None and 0 <= w["run_t_s"] <= end:
                ax.axvline(w["run_t_s"], color="tab:red", lw=0.8, ls="--")
        ax.set_xlim(0, end)
        ax.set_ylabel(unit)
        ax.legend()
    axes[1].set_xlabel("seconds (shaded: EP; dashed: switches)")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_slo(text: str | None) -> dict[str, float]:
    """--goodput "ttft:MS,tpot:MS" (either optional) -> {"ttft": ms, "tpot": ms}."""
    slo = {}
    for part in filter(None, (text or "").split(",")):
        key, _, ms = part.partition(":")
        if key.strip() not in ("ttft", "tpot") or not ms:
            raise ValueError(f"--goodput {text!r}: want ttft:MS,tpot:MS (either optional)")
        slo[key.strip()] = float(ms)
    return slo


def span(text: str) -> tuple[int, int]:
    lo, hi = (int(x) for x in text.split(","))
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"want A,B with 1 <= A <= B, got {text!r}")
    return lo, hi


class _Help(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    pass


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="load an OpenAI-compatible server: Poisson, bursty or replayed arrivals; TTFT, "
                       "TPOT, ITL, throughput, goodput with the layout timeline", description=__doc__,
                       formatter_class=_Help)
    s = p.add_argument_group("server")
    s.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server's root")
    s.add_argument("--api-key", default=None, help="sent as a Bearer token")
    s.add_argument("--model-name", default=None, help="the `model` sent (None: the first of GET /v1/models)")
    s.add_argument("--vocab-size", type=int, default=256, help="token ids are drawn from [0, V) (256: the built-in "
                   "demo model's byte tokens; give the served model's vocabulary size)")
    s.add_argument("--temperature", type=float, default=0.0, help="sampling temperature of every request")
    s.add_argument("--no-token-ids", action="store_true", help="do not ask for `return_token_ids` (a server that "
                   "refuses it): a chunk with text counts as one token, the total comes from usage")
    s.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most (None: no limit)")
    s.add_argument("--request-timeout", type=float, default=3600.0,
                   help="seconds a request may wait for its next bytes (a stream may run longer)")
    s.add_argument("--server-args", default=None, help="how the server was started (its flags), recorded in the "
                   "result's params: the server's settings are not otherwise in the result")
    s.add_argument("--status-every", type=float, default=1.0, help="seconds between GET /admin/status reads of the "
                   "layout timeline (it returns the newest 100 samples)")
    w = p.add_argument_group("arrivals (Poisson unless --trace bursty or --replay)")
    w.add_argument("--trace", choices=["poisson", "bursty"], default="poisson",
                   help="bursty: `moebius bench bursty`'s trace, shaped by the workload flags below")
    w.add_argument("--replay", default=None, help="JSONL, a line a request: {\"arrival_s\": s, \"output_len\": n, "
                   "and \"prompt_len\": n or \"prompt\": text or ids or \"prompt_token_ids\": ids}")
    w.add_argument("--num-prompts", type=int, default=100, help="requests of the Poisson mode")
    w.add_argument("--request-rate", type=float, default=math.inf, help="requests/s; inf: all at once")
    for what, n in (("prompt", 128), ("output", 64)):
        w.add_argument(f"--{what}-len-dist", choices=["fixed", "uniform", "lognormal"], default="fixed",
                       help=f"fixed: --{what}-len; uniform: in the range; lognormal: median --{what}-len, p99 at "
                       "the range's end, clipped to the range")
        w.add_argument(f"--{what}-len", type=int, default=n, help=f"{what} tokens (fixed), or the median")
        w.add_argument(f"--{what}-len-range", type=span, default=None, metavar="A,B", help="bounds, inclusive")
    p.add_argument("--goodput", default=None, metavar="ttft:MS,tpot:MS",
                   help="SLOs a request must meet to count in goodput (either optional)")
    p.add_argument("--save-chunks", action="store_true", help="keep every streamed chunk's time and tokens in the "
                   "request table (chunk_s, chunk_tokens; large for long runs)")
    p.add_argument("--output", default=None,
                    help="JSON path, its plot (PNG) beside it (default: the results are printed, no file written)")
    bursty.add_workload_args(p)  # --trace bursty's shape, and --bin-s and --seed for every mode
    p.set_defaults(func=main)


def main(a: argparse.Namespace) -> int:
    slo = parse_slo(a.goodput)
    if a.replay and a.trace == "bursty":
        raise ValueError("give --trace bursty or --replay, not both")
    if min(a.request_rate, a.num_prompts, a.vocab_size, a.bin_s, a.status_every) <= 0:
        raise ValueError("--request-rate, --num-prompts, --vocab-size, --bin-s, --status-every must be positive")
    recs = workload(a)
    if not recs:
        raise ValueError("the workload has no requests")
    model, duration, tl, before_t = asyncio.run(run(a, recs))
    # from the last sample before the run on (the layout it started in): not the server's older history
    samples, switches = (sorted((x for x in d.values() if x["t"] >= before_t), key=lambda x: x["t"])
                         for d in (tl.samples, tl.switches))
    offset = align(samples, switches, before_t, min((r.sent_s for r in recs if r.sent_s is not None), default=None))
    summary = {**summarize(recs, duration, slo), "timeline_samples": len(samples), "timeline_offset_s": offset,
               "step_ms": step_ms(step_intervals(samples), 0.0, duration), **per_step_ms(samples, 0.0, duration),
               "http_cpu_ms": tl.http_cpu_ms(),
               "switches_done": sum(w["done"] and w["run_t_s"] is not None and w["run_t_s"] >= 0 for w in switches),
               "status_available": bool(tl.available)}
    changes = layout_changes(samples, switches)
    bins, gpu = bins_of(recs, a.bin_s, duration, changes, samples), gpu_name()
    where = "replay " + a.replay if a.replay else a.trace if a.trace == "bursty" else f"Poisson {a.request_rate:g}/s"
    result = save_result(
        a.output, lambda _, png: plot(png, bins, changes, switches, f"{where}: {model}"),
        tables={"request": [r.row(a.save_chunks) for r in recs], "bin": bins, "timeline": samples,
                "switch": switches},
        summary=summary, params=params_of(a, model=model), gpu=gpu,
        num_gpus=tl.world_size if tl.world_size and gpu != "cpu" else default_num_gpus(),
        note=f"{len(recs)} requests ({where}) streamed from {a.base_url}/v1/completions (model {model}); TTFT from "
             f"send to the first token chunk, TPOT (end - first) / (tokens - 1), ITL every chunk gap; bins of "
             f"{a.bin_s:g} s (TTFT by arrival, TPOT / ITL by emission); timeline from /admin/status, run_t_s aligned "
             f"on its first busy sample; gpu / num_gpus: this host's.")
    print(report(summary_of(result)))
    return 0
