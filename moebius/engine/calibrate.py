"""Start-up calibration of the switch policy: decode steps of both layouts timed over a few global batch sizes, and
a switch each way with nothing in flight, through the engine itself (its graphs, its communicators)."""

from __future__ import annotations

from typing import Any, Protocol

from tqdm import tqdm

from moebius.switch.calibration import Calibration, CalibrationKey

DEFAULT_BATCHES = (1, 4, 16, 64, 128, 256, 512, 1024, 2048)


class Engine(Protocol):
    """What calibration asks of the engine's front end (`EngineCore`)."""

    @property
    def mode(self) -> str: ...

    def switch_mode(self, target: str, reason: str = "operator") -> dict[str, Any]: ...

    def query(self, name: str, **args: Any) -> list[Any]: ...


def calibrate(core: Engine, key: CalibrationKey, max_batch: int, max_context: int,
              batches: tuple[int, ...] = DEFAULT_BATCHES, context: int = 256, steps: int = 5, warmup: int = 2,
              progress: bool = True) -> Calibration:
    """Time both layouts (the engine must be idle) at the global batches up to `max_batch` with `context` (at most
    `max_context`) cached tokens a request; ends in the layout it started in. Batches that do not fit a layout's KV
    pool are left out."""
    context = max(1, min(context, max_context))
    batches = tuple(b for b in batches if b <= max_batch) or (1,)
    start = core.mode
    order = [start, "ep" if start == "tp" else "tp"]
    times: dict[str, dict[int, float]] = {m: {} for m in order}
    switch_ms: dict[str, float] = {}
    bar = tqdm(total=2 * len(batches), desc="calibrating the switch policy", unit="step", disable=not progress)
    try:
        for mode in order:
            if core.mode != mode:
                switch_ms[mode] = _switch(core, mode)
            for b in batches:
                res = core.query("bench_decode", batch=b, context=context, steps=steps, warmup=warmup, graphs=True)
                if not any("error" in r for r in res):
                    times[mode][b] = max(r["step_ms"] for r in res)  # lockstep: the slowest rank's step
                bar.update(1)
        switch_ms[start] = _switch(core, start)
    finally:
        bar.close()
    both = [b for b in batches if b in times["tp"] and b in times["ep"]]
    if not both:
        raise RuntimeError(f"calibration: no batch of {list(batches)} fits both layouts with {context} cached tokens "
                           "a request")
    return Calibration(key, context, both, [times["tp"][b] for b in both],
                       [times["ep"][b] for b in both], switch_ms)


def _switch(core: Engine, target: str) -> float:
    out = core.switch_mode(target, reason="calibration")
    if not out.get("done"):
        raise RuntimeError(f"calibration: the switch to {target} was refused: {out.get('reason')}")
    return float(out.get("total_ms", 0.0))
