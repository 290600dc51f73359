"""Prometheus metrics of the server (vLLM's names under `moebius:`, plus the layout and its switches). One registry per
server, so that several servers in one process (tests) do not collide; prometheus_client's metrics are thread-safe,
and the engine loop's thread records them."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from moebius.link.messages import RankTimes
from moebius.parallel.layout import MODES

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
                 0.5, 0.75, 1.0, 2.5)
_E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                480.0, 960.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry, self.model_name = CollectorRegistry(), model_name
        r, name = self.registry, ["model_name"]
        self.running = Gauge("moebius:num_requests_running", "Requests generating tokens (their first token is out)",
                             name, registry=r).labels(model_name)
        self.waiting = Gauge("moebius:num_requests_waiting", "Requests admitted that have no token yet", name,
                             registry=r).labels(model_name)
        self.kv_usage = Gauge("moebius:kv_cache_usage_perc", "Fraction of the KV cache in use (all ranks; 1 = full)",
                              name, registry=r).labels(model_name)
        self.prompt_tokens = Counter("moebius:prompt_tokens", "Prompt tokens admitted", name,
                                     registry=r).labels(model_name)
        self.generation_tokens = Counter("moebius:generation_tokens", "Tokens generated", name,
                                         registry=r).labels(model_name)
        self.cache_queries = Counter("moebius:prefix_cache_queries", "Prompt tokens of the samples that finished, "
                                     "looked up in the prefix cache", name, registry=r).labels(model_name)
        self.cache_hits = Counter("moebius:prefix_cache_hits", "Of those, the tokens taken from the prefix cache",
                                  name, registry=r).labels(model_name)
        self.preemptions = Counter("moebius:num_preemptions", "Requests preempted to free KV cache (they recompute "
                                   "their tokens)", name, registry=r).labels(model_name)
        self.success = Counter("moebius:request_success", "Requests finished, by finish reason",
                               [*name, "finished_reason"], registry=r)
        self.ttft = Histogram("moebius:time_to_first_token_seconds", "Seconds from arrival to the first token", name,
                              buckets=_LATENCY_BUCKETS, registry=r).labels(model_name)
        self.tpot = Histogram("moebius:time_per_output_token_seconds", "Seconds between output tokens (a request's "
                              "mean after its first)", name, buckets=_TPOT_BUCKETS, registry=r).labels(model_name)
        self.e2e = Histogram("moebius:e2e_request_latency_seconds", "Seconds from arrival to the last token", name,
                             buckets=_E2E_BUCKETS, registry=r).labels(model_name)
        self.layout = Gauge("moebius:layout", "The active parallel layout (1) and the other (0)", ["layout"],
                            registry=r)
        self.switches = Counter("moebius:switches", "Layout switches asked for (operator or policy), by direction "
                                "(tp_to_ep, ep_to_tp) and outcome (done, refused)", ["direction", "outcome"],
                                registry=r)
        self.switch_seconds = Histogram("moebius:switch_duration_seconds", "A done switch's time on rank 0, by "
                                        "phase: total, weights (expert reshard), kv (KV migration)", ["phase"],
                                        buckets=(0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0),
                                        registry=r)
        self.refusals = Counter("moebius:requests_refused", "Requests refused before the engine saw them, by "
                                "error code: rate_limit_exceeded (429: --max-waiting-requests were waiting), "
                                "shutting_down and engine_dead (503)", [*name, "code"], registry=r)
        self.healthy = Gauge("moebius:engine_healthy", "1 while the engine loop runs, 0 after it failed", registry=r)
        self.healthy.set(1)
        # an info metric: 1 on the label of the weights served (a weight update's version; "" before any)
        self.weight_version = Gauge("moebius:weight_version", "The weights served: 1 on the version given with the "
                                    "last weight update (\"\" before any)", [*name, "version"], registry=r)
        self.weight_version.labels(model_name, "").set(1)
        self._version = ""
        self.rank_step = Histogram("moebius:rank_step_seconds", "Rank 0's time a step, by part: host (scheduling, "
                                   "metadata, launches), device (waiting for a step's tokens), plan (waiting for "
                                   "its next plan from this server, with the rank in a process of its own)",
                                   ["part"], buckets=(0.0001, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.1,
                                                      0.25, 0.5, 1.0), registry=r)

    # ---- what the engine loop records (methods only, so that an engine in a process of its own can relay them) ----
    def aborted(self) -> None:
        self.success.labels(self.model_name, "abort").inc()

    def refused(self, code: str) -> None:
        self.refusals.labels(self.model_name, code).inc()

    def admitted(self, prompt_tokens: int) -> None:
        self.prompt_tokens.inc(prompt_tokens)

    def first_token(self, ttft: float) -> None:
        self.ttft.observe(max(0.0, ttft))

    def generated(self, tokens: int) -> None:
        self.generation_tokens.inc(tokens)

    def state(self, running: int, waiting: int, kv_usage: float, preempted: int) -> None:
        """The engine's state after a step: requests, KV use, and preemptions since the last call."""
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_usage.set(kv_usage)
        self.preemptions.inc(preempted)

    def engine_failed(self) -> None:
        self.healthy.set(0)

    def flush(self) -> None:
        """Recorded as they come (a relay sends what it buffered)."""

    def set_layout(self, mode: str) -> None:
        for m in MODES:
            self.layout.labels(m).set(1 if m == mode else 0)

    def set_weight_version(self, version: str | None) -> None:
        """The weights served now: their version's series 1, the version before's removed."""
        new = version or ""
        if new != self._version:
            self.weight_version.remove(self.model_name, self._version)
            self.weight_version.labels(self.model_name, new).set(1)
            self._version = new

    def switch(self, source: str, target: str, done: bool, phases_ms: dict[str, float | None]) -> None:
        self.switches.labels(f"{source}_to_{target}", "done" if done else "refused").inc()
        for phase, ms in phases_ms.items():
            if done and ms is not None:
                self.switch_seconds.labels(phase).observe(ms / 1e3)

    def finished(self, reason: str | None, arrival: float, first: float | None, last: float | None, tokens: int,
                 now: float) -> None:
        """One request finished: its finish reason, arrival / first / last token times and tokens of its first
        sample (perf_counter seconds)."""
        self.success.labels(self.model_name, reason or "unknown").inc()
        self.e2e.observe(max(0.0, now - arrival))
        if first is not None and last is not None and tokens > 1:
            self.tpot.observe(max(0.0, (last - first) / (tokens - 1)))

    def prefix_cache(self, queried: int, hits: int) -> None:
        """A finished request's prompt tokens over its samples, and those its samples took from the prefix cache."""
        self.cache_queries.inc(queried)
        self.cache_hits.inc(hits)

    def step(self, times: RankTimes) -> None:
        """Where rank 0's time went in the step just taken in (link/messages.py)."""
        for part, ms in (("host", times.host_ms), ("device", times.sync_ms), ("plan", times.wait_ms)):
            self.rank_step.labels(part).observe(ms / 1e3)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
