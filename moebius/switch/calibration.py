"""The calibration of the switch policy, measured at start-up and kept.

Measuring: decode steps of both layouts timed over a few global batch sizes, the same batches with a new prompt's
chunk in each step (mixed steps: step pieces, or eager past their largest bucket), and a switch each way with nothing
in flight, through the engine itself: real requests served by `step()`, so a step's time holds everything a served
step costs (graphs, communicators, sampling, the front end's own work). The policy reads the decode steps; `bench
simulate` both.

The profile: those step times and the switch's cost, kept in a JSON file keyed by what they depend on (model, its
layers, ranks, GPU, dtype, how steps run) so that a restart reuses them. The policy reads its crossover and curves
from it; `bench simulate` the mixed steps too.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from tqdm import tqdm

from moebius.link.messages import SwitchOutcome
from moebius.sampling_params import SamplingParams
from moebius.switch.policy import StepCurve, crossover

FORMAT = 2  # 2: mixed steps (format 1 files, without them, are still read)


def weights_label(dtype: str, quantization: str | None, fp8_activations: bool = False, scope: str = "all") -> str:
    """A profile key's dtype: the engine's, and its --quantization where it holds quantized rows (their steps and
    switches take other times: a bf16 profile is not an FP8 engine's), FP8's W8A8 (--fp8-activations) apart from
    its default W8A16, and FP8's dense weights in the dtype (--quantization-scope experts) apart from FP8 rows.
    (Before a740521 W8A8 was the default and the bare "+fp8"; a profile saved then is re-measured or read as W8A16's:
    its times, never its tokens.)"""
    if not quantization:
        return dtype
    return (f"{dtype}+{quantization}" + ("-w8a8" if quantization == "fp8" and fp8_activations else "")
            + ("-experts" if scope == "experts" and quantization == "fp8" else ""))


@dataclass(frozen=True)
class CalibrationKey:
    model: str  # the model's path or preset name, or "builtin"
    num_layers: int
    num_ranks: int
    device: str  # the GPU's name, or "cpu"
    dtype: str
    # how the engine runs its steps (token budget, CUDA graph settings, expert kernel): what else sets a step's time;
    # profiles kept before it was part of the key read as "" and are measured anew
    steps: str = ""

    def file_name(self) -> str:
        digest = hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]
        tail = os.path.basename(self.model.rstrip("/")) or "model"
        return f"{tail}-{self.num_layers}l-p{self.num_ranks}-{digest}.json"


@dataclass
class Calibration:
    key: CalibrationKey
    context_len: int  # cached tokens per request in the timed steps
    batches: list[int]  # global decode batches timed
    tp_ms: list[float]
    ep_ms: list[float]
    switch_ms: dict[str, float] = field(default_factory=dict)  # target layout -> ms of a switch with nothing in flight
    # mixed steps: mixed_batches[i] requests decoding beside one new prompt of context_len tokens (none: not measured)
    mixed_batches: list[int] = field(default_factory=list)
    tp_mixed_ms: list[float] = field(default_factory=list)
    ep_mixed_ms: list[float] = field(default_factory=list)
    # tokens of KV each layout holds engine-wide (TP: a rank's pool, every request on every rank; EP: the ranks'
    # pools together), by the family's KV spec: what the policy's switch must fit (empty: not known)
    kv_tokens: dict[str, int] = field(default_factory=dict)

    def curves(self) -> tuple[StepCurve, StepCurve]:
        return StepCurve(tuple(self.batches), tuple(self.tp_ms)), StepCurve(tuple(self.batches), tuple(self.ep_ms))

    def mixed_curves(self) -> tuple[StepCurve, StepCurve] | None:
        """Mixed step time by the step's tokens (decodes + the chunk), or None where not measured."""
        if not self.mixed_batches:
            return None
        tokens = tuple(b + self.context_len for b in self.mixed_batches)
        return StepCurve(tokens, tuple(self.tp_mixed_ms)), StepCurve(tokens, tuple(self.ep_mixed_ms))

    def crossover(self) -> float | None:
        """See `policy.crossover`: where EP starts to win (0.0: everywhere; None: nowhere measured)."""
        return crossover(*self.curves())

    def summary(self) -> str:
        x = self.crossover()
        where = ("EP is faster at every batch measured" if x == 0.0 else
                 "TP is faster at every batch measured" if x is None else f"EP is faster from batch {x:.1f}")
        rows = _rows(self.batches, self.tp_ms, self.ep_ms)
        mixed = _rows(self.mixed_batches, self.tp_mixed_ms, self.ep_mixed_ms)
        mixed = f"; with a {self.context_len}-token prompt beside them {mixed}" if mixed else ""
        return f"{where} ({rows}){mixed}; switch to TP {self.switch_ms.get('tp', 0):.1f} ms, to EP " \
               f"{self.switch_ms.get('ep', 0):.1f} ms"

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, **asdict(self)}

    @staticmethod
    def from_json(d: dict[str, Any]) -> Calibration:
        if d.get("format") not in (1, FORMAT):
            raise ValueError(f"calibration file format {d.get('format')!r}, expected 1 or {FORMAT}")
        return Calibration(CalibrationKey(**d["key"]), d["context_len"], list(d["batches"]), list(d["tp_ms"]),
                           list(d["ep_ms"]), dict(d["switch_ms"]), list(d.get("mixed_batches", [])),
                           list(d.get("tp_mixed_ms", [])), list(d.get("ep_mixed_ms", [])),
                           {m: int(n) for m, n in d.get("kv_tokens", {}).items()})


def _rows(batches: list[int], tp_ms: list[float], ep_ms: list[float]) -> str:
    return ", ".join(f"{b}: TP {t:.2f} / EP {e:.2f} ms" for b, t, e in zip(batches, tp_ms, ep_ms, strict=True))


def default_dir() -> str:
    return os.path.join(os.path.expanduser("~"), ".cache", "moebius", "calibration")


def load(directory: str, key: CalibrationKey) -> Calibration | None:
    """The profile kept for `key`, or None (none kept, or an unreadable file: measured again)."""
    path = os.path.join(directory, key.file_name())
    try:
        with open(path) as f:
            cal = Calibration.from_json(json.load(f))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return cal if cal.key == key else None


def save(directory: str, cal: Calibration) -> str:
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, cal.key.file_name())
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(cal.to_json(), f, indent=1)
    os.replace(tmp, path)
    return path


# ---- measuring ----
DEFAULT_BATCHES = (1, 4, 16, 64, 128, 256, 512, 1024, 2048)


class Engine(Protocol):
    """What calibration asks of the engine's front end (`EngineCore`)."""

    @property
    def mode(self) -> str: ...

    def switch_mode(self, target: str, reason: str = "operator") -> SwitchOutcome: ...

    def add_request(self, prompt: list[int], params: SamplingParams) -> str: ...

    def step(self) -> Sequence[Any]: ...

    def abort(self, request_id: str) -> None: ...

    def has_unfinished(self) -> bool: ...


def calibrate(core: Engine, key: CalibrationKey, max_batch: int, max_context: int, vocab: int, kv_tokens: int,
              budget: int, batches: tuple[int, ...] = DEFAULT_BATCHES, context: int = 256, steps: int = 8,
              warmup: int = 3, progress: bool = True, capacity: dict[str, int] | None = None) -> Calibration:
    """Time both layouts (the engine must be idle, the policy off) at the global batches up to `max_batch`, each
    request holding about `context` tokens (at most half `max_context`); ends in the layout it started in. A batch
    whose KV would not fit `kv_tokens` (a rank's pool in the smaller layout) is left out. budget: tokens a step.
    capacity: each layout's KV tokens engine-wide, as the engine's pools hold them (kept as `kv_tokens`)."""
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
                       [mixed["tp"][b] for b in mixed_batches], [mixed["ep"][b] for b in mixed_batches],
                       dict(capacity or {}))


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
    if not out.done:
        raise RuntimeError(f"calibration: the switch to {target} was refused: {out.reason}")
    return out.total_ms or 0.0
