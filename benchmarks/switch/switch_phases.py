"""Where a switch's weight time goes, per direction: the local permutes (EP->TP pack, TP->EP unpack) against the
exchanges (the collective transport's all-to-alls of gate/up and of down), summed over the layers with CUDA events
on every rank. Switches back and forth with no requests (weights only), on a preset with dummy weights. Times the
one-stream pass (its hooks wrap `Switcher._move_experts`, which --switch-overlap's pipelined pass does not use), over
either transport (`--switch-transport peer`: the w13 and w2 exchanges each between their own pair of barriers).

    python benchmarks/switch/switch_phases.py --model qwen3-30b-a3b --num-ranks 2 --output phases.json
    python benchmarks/switch/switch_phases.py ... --disable-reshard-kernel (torch's strided copies, not the row copy)

Rows: table "phases", per rank and switch, the phases' sums; table "switch", each switch_mode's answer.
Recorded: benchmarks/results/h200x2-switch-phases.json.

The ranks are spawned processes that import this module again (as __mp_main__), so the timing hooks below are
installed in each.
It reaches into the switch executor's internals (`Switcher._move_experts`, `pass_times`)."""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch

from moebius.bench.results import flatten, gpus_used, params_of, write_result
from moebius.config import EngineConfig
from moebius.frontend.core import EngineCore
from moebius.link.messages import SwitchTimes
from moebius.switch import executor as ex
from moebius.switch.plan import ep_to_tp_pack, tp_to_ep_unpack

_REC: list[tuple[str, list[str], list]] = []
_orig_pass_times = ex.Switcher.pass_times


def _move_experts(self: ex.Switcher, src, dst, target: str, staging) -> None:  # noqa: ANN001 - the executor's own
    P = self.P
    El = (src if target == "tp" else dst).w13_EFD.shape[0]
    splits = [El] * P
    cuda = src.w13_EFD.is_cuda
    ev = [self._mark(cuda)]  # CUDA events on the GPU, the host clock on the CPU (where work is synchronous)
    if target == "tp":
        s13, s2 = ep_to_tp_pack(src.w13_EFD, src.w2_EDF, P, staging, self.options.row_kernel)
        ev.append(self._mark(cuda))
        self.transport.all_to_all(dst.w13_EFD, s13, splits, splits)
        ev.append(self._mark(cuda))
        self.transport.all_to_all(dst.w2_EDF, s2, splits, splits)
        _REC.append(("tp", ["pack_ms", "exchange_w13_ms", "exchange_w2_ms"], ev))
    else:
        r13, r2 = staging
        self.transport.all_to_all(r13, src.w13_EFD, splits, splits)
        ev.append(self._mark(cuda))
        self.transport.all_to_all(r2, src.w2_EDF, splits, splits)
        ev.append(self._mark(cuda))
        tp_to_ep_unpack(r13, r2, P, dst.w13_EFD, dst.w2_EDF, self.options.row_kernel)
        _REC.append(("ep", ["exchange_w13_ms", "exchange_w2_ms", "unpack_ms"], ev))
    ev.append(self._mark(cuda))


def _pass_times(self: ex.Switcher) -> SwitchTimes | None:
    out = _orig_pass_times(self)
    if out is not None and _REC:
        to, names, _ = _REC[0]
        row = {"rank": self.rank, "to": to, "layers": len(_REC), "weights_ms": out.weights_ms}
        for j, name in enumerate(names):
            row[name] = sum(self._elapsed(ev[j], ev[j + 1]) for _, _, ev in _REC) * 1e3
        _REC.clear()
        with open(os.environ["MOEBIUS_PHASES_OUT"], "a") as f:
            f.write(json.dumps(row) + "\n")
    return out


def install_hooks() -> None:
    ex.Switcher._move_experts = _move_experts
    ex.Switcher.pass_times = _pass_times


# Run as a program (and in the rank processes it spawns, which import it as __mp_main__): the hooks go in; imported
# as a module (tests), the switch stays untouched.
if __name__ in ("__main__", "__mp_main__"):
    install_hooks()


def main() -> None:
    ap = argparse.ArgumentParser(prog="python benchmarks/switch/switch_phases.py")
    ap.add_argument("--model", default="qwen3-30b-a3b", help="a preset or path; 'builtin' for the tiny model")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run (host-clock times)")
    ap.add_argument("--num-ranks", type=int, default=2)
    ap.add_argument("--switches", type=int, default=4)
    ap.add_argument("--switch-transport", default="collective", choices=["collective", "peer"],
                    help="the engine's --switch-transport (peer: each exchange between its own two barriers here)")
    ap.add_argument("--output", required=True)
    ap.add_argument("--disable-reshard-kernel", action="store_true",
                    help="the engine's flag: the permutes through torch's strided copies instead of the row copy")
    a = ap.parse_args()

    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        os.environ["MOEBIUS_PHASES_OUT"] = f.name  # inherited by the spawned ranks
    cpu = a.device == "cpu"
    engine = EngineCore(EngineConfig.from_kwargs(
        model=None if a.model == "builtin" else a.model, load_format="auto" if a.model == "builtin" else "dummy",
        num_ranks=a.num_ranks, mode="tp", max_running_requests=64, max_num_batched_tokens=2048, max_model_len=576,
        cuda_graph_max_bs=8, device=a.device, switch_transport=a.switch_transport,
        disable_reshard_kernel=a.disable_reshard_kernel,
        **({"dtype": "float32"} if cpu else {})))
    switches = []
    try:
        for i in range(a.switches):
            switches.append(engine.switch_mode("ep" if i % 2 == 0 else "tp").to_json())
    finally:
        engine.close()
    with open(os.environ["MOEBIUS_PHASES_OUT"]) as f:
        rows = [json.loads(line) for line in f]
    write_result(a.output, tables={"phases": rows, "switch": [flatten(s) for s in switches]},
                 params=params_of(a),
                 gpu=torch.cuda.get_device_name() if not cpu else "cpu", num_gpus=gpus_used(a.num_ranks, a.device),
                 note="a switch's weight time per rank and direction (table phases): the local permute (pack_ms / "
                      "unpack_ms) and the two exchanges (exchange_w13_ms, exchange_w2_ms), summed over the layers, "
                      "against the pass's weights_ms; table switch: each switch_mode's answer")
    for r in rows:
        print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in r.items()}))


if __name__ == "__main__":
    main()
