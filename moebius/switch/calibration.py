"""A calibration profile: decode step times of both layouts over a few global batch sizes, the same batches' steps
with a new prompt's chunk beside them (mixed steps: step pieces or eager), and the switch's cost, measured at start-up
(`engine/calibrate.py`), kept in a JSON file keyed by what they depend on (model, its layers, ranks, GPU, dtype, how
steps run) so that a restart reuses them. The policy reads its crossover and curves from it; `bench simulate` the
mixed steps too.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from moebius.switch.policy import StepCurve, crossover

FORMAT = 2  # 2: mixed steps (format 1 files, without them, are still read)


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
                           list(d.get("tp_mixed_ms", [])), list(d.get("ep_mixed_ms", [])))


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
