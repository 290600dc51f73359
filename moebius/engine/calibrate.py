"""Start-up calibration of the switch policy: decode steps of both layouts timed over a few global batch sizes, the
same batches with a new prompt's chunk in each step (mixed steps: step pieces, or eager past their largest bucket),
and a switch each way with nothing in flight, through the engine itself: real requests served by `step()`, so a
step's time holds everything a served step costs (graphs, communicators, sampling, the front end's own work). The
policy reads the decode steps; `bench simulate` both."""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from typing import Any, Protocol

from tqdm import tqdm

from moebius.sampling_params import SamplingParams
from moebius.switch.calibration import Calibration, CalibrationKey

DEFAULT_BATCHES = (1, 4, 16, 64, 128, 256, 512, 1024, 2048)


class Engine(Protocol):
    """What calibration asks of the engine's front end (`EngineCore`)."""

    @property
    def mode(self) -> str: ...

    def switch_mode(self, target: str, reason: str = "operator") -> dict[str, Any]: ...

    def add_request(self, prompt: list[int], params: SamplingParams) -> str: ...

    def step(self) -> Sequence[Any]: ...

    def abort(self, request_id: str) -> None: ...

    def has_unfinished(self) -> bool: ...


def calibrate(core: Engine, key: CalibrationKey, max_batch: int, max_context: int, vocab: int, kv_tokens: int,
              budget: int, batches: tuple[int, ...] = DEFAULT_BATCHES, context: int = 256, steps: int = 8,
              warmup: int = 3, progress: bool = True) -> Calibration:
    """Time both layouts (the engine must be idle, the policy off) at the global batches up to `max_batch`, each
    request holding about `context` tokens (at most half `max_context`); ends in the layout it started in. A batch
    whose KV would not fit `kv_tokens` (a rank's pool in the smaller layout) is left out. budget: tokens a step."""
    context = max(1, min(context, max_context // 2))

    def length(b: int) -> int:  # tokens a request reaches: it decodes while the batch's other prompts prefill
        return context + -(-b * context // budget) + warmup + steps + 2

    batches = tuple(b for b in batches if b <= max_batch and b * length(b) <= kv_tokens
                    and length(b) <= max_context) or (1,)
    start = core.mode
    order = [start, "ep" if start == "tp" else "tp"]
    times: dict[str, dict[int, float]] = {m: {} for m in order}
    mixed: dict[str, dict[int, float]] = {m: {} for m in order}  # with a new prompt of `context` tokens a step
    switch_ms: dict[str, float] = {}
    bar = tqdm(total=2 * len(batches), desc="calibrating the switch policy", unit="batch", disable=not progress)
    try:
        for mode in order:
            if core.mode != mode:
                switch_ms[mode] = _switch(core, mode)
            for b in batches:
                times[mode][b] = _served_step_ms(core, b, context, length(b), steps, warmup, vocab)
                if b < max_batch and b + context <= budget:  # room for the new prompt beside the batch
                    mixed[mode][b] = _served_step_ms(core, b, context, length(b), steps, warmup, vocab, context)
                bar.update(1)
        switch_ms[start] = _switch(core, start)
    finally:
        bar.close()
    mixed_batches = [b for b in batches if b in mixed["tp"]]
    return Calibration(key, context, list(batches), [times["tp"][b] for b in batches],
                       [times["ep"][b] for b in batches], switch_ms, mixed_batches,
                       [mixed["tp"][b] for b in mixed_batches], [mixed["ep"][b] for b in mixed_batches])


def _served_step_ms(core: Engine, batch: int, context: int, length: int, steps: int, warmup: int, vocab: int,
                    chunk: int = 0) -> float:
    """ms a step of `batch` requests decoding with about `context` tokens each takes, as `step()` serves them (each
    may reach `length` tokens: none ends before the timed steps are through). chunk: before each step a new request
    of `chunk` prompt tokens arrives (one token out: it ends with the step that prefills it), so every step is
    mixed."""
    rng = random.Random(batch)
    params = SamplingParams(temperature=0.0, max_tokens=length - context, ignore_eos=True)
    ids = {core.add_request([rng.randrange(vocab) for _ in range(context)], params) for _ in range(batch)}
    started: set[str] = set()
    while len(started) < batch:  # prefill: until every request has its first token
        started |= {o.request_id for o in core.step() if o.outputs[0].token_ids}
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    def step() -> None:
        if chunk:
            core.add_request([rng.randrange(vocab) for _ in range(chunk)], one)
        core.step()

    for _ in range(warmup):
        step()
    t = time.perf_counter()
    for _ in range(steps):
        step()
    ms = (time.perf_counter() - t) / steps * 1e3
    for rid in ids:
        core.abort(rid)
    while core.has_unfinished():
        core.step()
    return ms


def _switch(core: Engine, target: str) -> float:
    out = core.switch_mode(target, reason="calibration")
    if not out.get("done"):
        raise RuntimeError(f"calibration: the switch to {target} was refused: {out.get('reason')}")
    return float(out.get("total_ms", 0.0))
