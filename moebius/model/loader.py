"""Fill a layout's weight views: from a local safetensors checkpoint (single file or sharded), or dummy weights."""

from __future__ import annotations

import glob
import json
import os
import zlib

import torch
from safetensors import safe_open

from moebius.config import ConfigError, ModelConfig
from moebius.layers.rotary import rope_table
from moebius.memory.umm import UnifiedMemory
from moebius.model.weights import ParamSpec, spec_view


class Checkpoint:
    """Lazy access to the tensors of a Hugging Face safetensors checkpoint directory."""

    def __init__(self, path: str) -> None:
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index) as f:
                weight_map: dict[str, str] = json.load(f)["weight_map"]
            self._where = {k: os.path.join(path, v) for k, v in weight_map.items()}
        else:
            files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
            if not files:
                raise ConfigError(f"no *.safetensors files in {path!r} (use --load-format dummy for random weights)")
            self._where = {}
            for file in files:
                with safe_open(file, framework="pt") as f:
                    self._where.update({k: file for k in f.keys()})  # noqa: SIM118 (safe_open has no __iter__)
        self._open: dict[str, object] = {}
        self.path = path

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The tensor `name`; KeyError if absent, ConfigError naming it if its shape is not `shape`."""
        file = self._where[name]
        if file not in self._open:
            if not os.path.isfile(file):
                raise ConfigError(f"checkpoint file {file!r} (holding {name}) is missing")
            self._open[file] = safe_open(file, framework="pt")
        t = self._open[file].get_tensor(name)  # type: ignore[attr-defined]
        if tuple(t.shape) != tuple(shape):
            raise ConfigError(f"tensor {name} in {self.path!r} has shape {tuple(t.shape)}, expected {tuple(shape)}")
        return t


class DummyCheckpoint:
    """Random weights of any asked-for shape, generated on the device from (seed, tensor name).

    Every rank draws the same full tensor for a name and cuts its own shard, so all layouts of all ranks see one
    consistent model. Norm weights are ones.
    """

    def __init__(self, seed: int, device: torch.device, std: float = 0.02) -> None:
        self.seed, self.device, self.std = seed, device, std
        self.path = "<dummy>"
        self._gen = torch.Generator(device=device)

    def __contains__(self, name: str) -> bool:
        return True

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name.endswith("norm.weight"):
            return torch.ones(shape, device=self.device)
        self._gen.manual_seed((self.seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
        return torch.randn(shape, generator=self._gen, device=self.device) * self.std


def load_weights(umm: UnifiedMemory, specs: list[ParamSpec], ckpt: Checkpoint | DummyCheckpoint,
                 dtype: torch.dtype, cfg: ModelConfig) -> None:
    """Cut every view's shard from the checkpoint's full tensors (names checked, shapes checked), then RoPE."""

    def fetch(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name not in ckpt:
            raise KeyError(name)
        return ckpt.get(name, shape)

    for s in specs:
        view = spec_view(umm, s, torch.float32 if s.load is None else dtype)
        if s.load is None:  # the RoPE table
            view.copy_(rope_table(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, umm.device))
            continue
        try:
            t = s.load(fetch)
        except KeyError as e:
            raise ConfigError(f"checkpoint {ckpt.path!r} is missing tensor {e.args[0]}") from None
        view.copy_(t)
