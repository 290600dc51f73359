"""What `moebius bench serve` measures, from its request records: percentiles, the run's summary, time bins, the
server's timeline put on the run's clock, and the printed table (pure: no I/O)."""

from __future__ import annotations

import itertools
import math
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

Row = dict[str, Any]


@dataclass
class Rec:
    """One request: what is sent, and what happened (times in seconds from the run's start)."""

    index: int
    scheduled_s: float
    prompt: list[int] | str = field(repr=False)
    prompt_len: int | None  # of a text prompt: None until the server's usage says
    output_len: int
    sent_s: float | None = None
    first_s: float | None = None
    end_s: float | None = None
    chunk_s: list[float] = field(default_factory=list)  # each chunk that carried tokens
    chunk_tokens: list[int] = field(default_factory=list)
    output_tokens: int = 0
    tokens_from: str = "none"  # token_ids (counted per chunk), usage (the total only), chunks (one a chunk)
    status: int | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None

    def ttft_ms(self) -> float | None:
        return None if self.first_s is None or self.sent_s is None else (self.first_s - self.sent_s) * 1e3

    def tpot_ms(self) -> float | None:
        if self.first_s is None or self.end_s is None or self.output_tokens < 2:
            return None
        return (self.end_s - self.first_s) / (self.output_tokens - 1) * 1e3

    def e2el_ms(self) -> float | None:
        return None if self.end_s is None or self.sent_s is None else (self.end_s - self.sent_s) * 1e3

    def itl_ms(self) -> list[tuple[float, float]]:
        """(s, ms) of every gap between two chunks, timed at its end."""
        return [(b, (b - a) * 1e3) for a, b in zip(self.chunk_s, self.chunk_s[1:], strict=False)]

    def row(self, chunks: bool = False) -> Row:
        """The request's table row; `chunks`: with every chunk's time and tokens (a token's worth of numbers each:
        megabytes for a long run)."""
        d = {k: v for k, v in asdict(self).items() if k != "prompt" and (chunks or not k.startswith("chunk_"))}
        if chunks:
            d["chunk_s"] = [round(t, 6) for t in self.chunk_s]  # microseconds are plenty
        return {**d, "ttft_ms": self.ttft_ms(), "tpot_ms": self.tpot_ms(), "e2el_ms": self.e2el_ms()}


# ---- pure helpers: percentiles, the summary, bins, the timeline's clock ----

def percentile(xs: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100), linear between ranks (numpy's default); None when empty."""
    if not xs:
        return None
    s, k = sorted(xs), (len(xs) - 1) * q / 100
    lo = math.floor(k)
    return s[lo] + (s[min(lo + 1, len(s) - 1)] - s[lo]) * (k - lo)


def stats(xs: Sequence[float]) -> dict[str, float | None]:
    return {"mean": statistics.fmean(xs) if xs else None, **{f"p{q}": percentile(xs, q) for q in (50, 90, 99)}}


def token_gaps(r: Rec) -> list[tuple[float, float]]:
    """(s, ms) per output token after the first chunk: a chunk's gap shared by the tokens it carries."""
    return [(t, ms / n) for (t, ms), n in zip(r.itl_ms(), r.chunk_tokens[1:], strict=True) for _ in range(n)]


def summarize(recs: Sequence[Rec], duration: float, slo: dict[str, float]) -> Row:
    """The run's aggregates (over the requests that succeeded) and its failures."""
    good, d = [r for r in recs if r.ok], max(duration, 1e-9)
    out_tok, in_tok = sum(r.output_tokens for r in good), sum(r.prompt_len or 0 for r in good)
    meets = [r for r in good if (r.ttft_ms() or 0) <= slo.get("ttft", math.inf)
             and (r.tpot_ms() or 0) <= slo.get("tpot", math.inf)]  # one token: no TPOT to miss
    errors = Counter(r.error or f"HTTP {r.status}" for r in recs if not r.ok)
    return {"requests": len(recs), "completed": len(good), "failed": len(recs) - len(good),
            "errors": [f"{n} x {e}" for e, n in errors.most_common()], "duration_s": duration,
            "input_tokens": in_tok, "output_tokens": out_tok, "request_throughput": len(good) / d,
            "output_throughput": out_tok / d, "total_token_throughput": (in_tok + out_tok) / d,
            "goodput": len(meets) / d if slo else None,
            "send_lag_ms_max": max(((r.sent_s or 0) - r.scheduled_s) * 1e3 for r in recs),
            **{k: stats([x for r in good if (x := f(r)) is not None])
               for k, f in (("ttft_ms", Rec.ttft_ms), ("tpot_ms", Rec.tpot_ms), ("e2el_ms", Rec.e2el_ms))},
            "itl_ms": stats([ms for r in good for _, ms in r.itl_ms()])}


def layout_changes(samples: Sequence[Row], switches: Sequence[Row] = ()) -> list[tuple[float, str]]:
    """(run_t_s, layout) from each sample and each switch done, in time order: a layout holds until the next."""
    marks = [(s["run_t_s"], s["mode"]) for s in samples] + [(w["run_t_s"], w["target"]) for w in switches if w["done"]]
    return sorted((t, m) for t, m in marks if t is not None)


def layouts_in(changes: Sequence[tuple[float, str]], lo: float, hi: float) -> list[str]:
    """The layouts in effect during [lo, hi)."""
    before = [m for t, m in changes if t < lo][-1:]
    return sorted(set(before + [m for t, m in changes if lo <= t < hi]))


def step_intervals(samples: Sequence[Row]) -> list[tuple[float, float, int]]:
    """(end run_t_s, seconds, engine steps) between consecutive timeline samples that ran steps (samples carry the
    server's step count since it has one; older ones give nothing)."""
    marks = sorted((s["run_t_s"], s["steps"]) for s in samples
                   if s.get("run_t_s") is not None and s.get("steps") is not None)
    return [(t1, t1 - t0, n1 - n0) for (t0, n0), (t1, n1) in itertools.pairwise(marks) if n1 > n0]


def step_ms(intervals: Sequence[tuple[float, float, int]], lo: float = -math.inf, hi: float = math.inf
            ) -> float | None:
    """The server's mean step time (ms) over the intervals ending in [lo, hi); None without steps there."""
    spans = [(dt, n) for t, dt, n in intervals if lo <= t < hi]
    steps = sum(n for _, n in spans)
    return 1e3 * sum(dt for dt, _ in spans) / steps if steps else None


# the timeline's cumulative seconds read per step (ms): rank 0's (link/messages.py RankTimes), then the front
# end's process CPU (all its threads: the engine process's, or with --engine-process off the whole server's) and its
# engine thread's
PER_STEP = {"rank_host_ms": "rank_host_s", "rank_sync_ms": "rank_sync_s", "rank_wait_ms": "rank_wait_s",
            "server_cpu_ms": "cpu_s", "engine_cpu_ms": "thread_cpu_s"}


def per_step_ms(samples: Sequence[Row], lo: float = -math.inf, hi: float = math.inf) -> dict[str, float | None]:
    """Means a step (ms) between the timeline samples that ran steps, ending in [lo, hi): rank 0's host,
    device-sync and plan-wait time, the server process's CPU and its engine thread's; None where the server's
    samples do not carry them."""
    marks = sorted((s["run_t_s"], s["steps"], *(s.get(k) for k in PER_STEP.values())) for s in samples
                   if s.get("run_t_s") is not None and s.get("steps") is not None)
    spans = [(b[1] - a[1], [(y - x) if None not in (x, y) else None for x, y in zip(a[2:], b[2:], strict=True)])
             for a, b in itertools.pairwise(marks) if b[1] > a[1] and lo <= b[0] < hi]
    steps = sum(n for n, _ in spans)
    out: dict[str, float | None] = {}
    for i, name in enumerate(PER_STEP):
        parts = [d[i] for _, d in spans]
        out[name] = 1e3 * sum(parts) / steps if steps and parts and None not in parts else None
    return out


def bins_of(recs: Sequence[Rec], bin_s: float, duration: float,
            changes: Sequence[tuple[float, str]] = (), samples: Sequence[Row] = ()) -> list[Row]:
    """Bins covering [0, duration]: TTFT over the requests arriving (scheduled) in a bin, TPOT over the tokens
    emitted in it (a chunk's gap per token), ITL over the chunk gaps ending in it, tokens and completions in it, and
    the server's mean step time from its timeline `samples` (put on the run's clock by `align`)."""
    intervals = step_intervals(samples)
    good = [r for r in recs if r.ok]
    per = {"tpot_ms": [g for r in good for g in token_gaps(r)], "itl_ms": [g for r in good for g in r.itl_ms()]}
    emitted = [(t, n) for r in good for t, n in zip(r.chunk_s, r.chunk_tokens, strict=True)]
    rows = []
    for k in range(int(duration // bin_s) + 1):
        lo, hi = k * bin_s, (k + 1) * bin_s
        tokens = sum(n for t, n in emitted if lo <= t < hi)
        row: Row = {"bin_start_s": lo, "bin_end_s": hi, "arrivals": sum(lo <= r.scheduled_s < hi for r in recs),
                    "completed": sum(r.end_s is not None and lo <= r.end_s < hi for r in good),
                    "output_tokens": tokens, "output_throughput": tokens / bin_s,
                    "modes": layouts_in(changes, lo, hi), "step_ms": step_ms(intervals, lo, hi)}
        xs = {"ttft_ms": [x for r in good if lo <= r.scheduled_s < hi and (x := r.ttft_ms()) is not None],
              **{name: [ms for t, ms in gaps if lo <= t < hi] for name, gaps in per.items()}}
        rows.append(row | {f"{name}.{q}": v for name, vals in xs.items() for q, v in stats(vals).items()})
    return rows


def align(samples: list[Row], switches: list[Row], before_t: float, first_sent: float | None) -> float | None:
    """Put the server's timeline on the run's clock (`run_t_s`): its first busy sample after the run began is taken
    as the first request's arrival (the server reports no clock: off by about one step). Returns the offset."""
    busy = [s["t"] for s in samples if s["t"] > before_t and s["running"] + s["waiting"] > 0]
    offset = None if not busy or first_sent is None else min(busy) - first_sent
    for x in samples + switches:
        x["run_t_s"] = None if offset is None else x["t"] - offset
    return offset


REPORT = [("Successful requests", "completed"), ("Failed requests", "failed"), ("Benchmark duration (s)",
          "duration_s"), ("Total input tokens", "input_tokens"), ("Total generated tokens", "output_tokens"),
          ("Request throughput (req/s)", "request_throughput"), ("Request goodput (req/s)", "goodput"),
          ("Output token throughput (tok/s)", "output_throughput"),
          ("Total token throughput (tok/s)", "total_token_throughput")]
LATENCIES = [("ttft_ms", "Time to First Token"), ("tpot_ms", "Time per Output Token (excl. 1st token)"),
             ("itl_ms", "Inter-token Latency"), ("e2el_ms", "End-to-end Latency")]


def report(s: Row) -> str:
    """vLLM's `bench serve` table."""
    def line(k: str, v: Any) -> str:
        return f"{k + ':':<40}{'-' if v is None else f'{v:.2f}' if isinstance(v, float) else v:>16}"

    lines = [f"{' Serving Benchmark Result ':=^56}"] + [line(k, s[key]) for k, key in REPORT if s[key] is not None]
    for key, name in LATENCIES:
        lines.append(f"{' ' + name + ' ':-^56}")
        lines += [line(f"{label} {key.split('_')[0].upper()} (ms)", s[f"{key}.{q}"])
                  for q, label in (("mean", "Mean"), ("p50", "Median"), ("p90", "P90"), ("p99", "P99"))]
    server = [(name, s.get(key)) for name, key in (("Step (ms)", "step_ms"), ("Rank host a step (ms)", "rank_host_ms"),
                                                    ("Rank device sync a step (ms)", "rank_sync_ms"),
                                                    ("Rank wait for its plan (ms)", "rank_wait_ms"),
                                                    ("Front end CPU a step (ms)", "server_cpu_ms"),
                                                    ("Engine thread CPU a step (ms)", "engine_cpu_ms"),
                                                    ("HTTP process CPU a step (ms)", "http_cpu_ms"))]
    if any(v is not None for _, v in server):  # the server's own timeline (/admin/status)
        lines.append(f"{' Server ':-^56}")
        lines += [line(name, v) for name, v in server if v is not None]
    return "\n".join(lines + [f"error: {e}" for e in s["errors"][:5]] + ["=" * 56])
