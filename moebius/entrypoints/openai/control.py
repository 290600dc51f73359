"""The operator's side of the server (`/admin/...`): the calls the routes make on the engine thread through
`EngineLoop.call`, each a module-level function of (engine, loop, *args) (with the engine in a process of its own, the
call is sent there by name)."""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from moebius.config import EngineConfig
from moebius.switch.auto import build as build_auto
from moebius.switch.auto import needs_calibration
from moebius.worker.update_group import check_broadcast

if TYPE_CHECKING:
    from moebius.entrypoints.openai.engine_loop import EngineLoop
    from moebius.frontend.core import EngineCore

STATUS_TAIL = 100  # timeline samples and switches that /admin/status returns


def status(engine: EngineCore, loop: EngineLoop) -> dict[str, Any]:
    """What GET /admin/status reports (run on the engine thread through EngineLoop.call)."""
    tl = engine.timeline
    samples = list(itertools.islice(reversed(tl.samples), STATUS_TAIL))[::-1]
    switches = list(itertools.islice(reversed(tl.switches), STATUS_TAIL))[::-1]
    return {"mode": engine.mode, "policy": engine.auto.note if engine.auto is not None else None,
            "kv": engine.kv_stats(), "running": loop.running, "waiting": loop.waiting, "in_flight": loop.in_flight,
            "unfinished": engine.has_unfinished(), "world_size": engine.world_size, "paused": loop.paused,
            "weight_version": engine.weight_version, "memory_released": sorted(engine.released),
            "steps_in_flight": engine.steps_in_flight, "policy_settings": policy_settings(engine, loop),
            "last_switch": engine.last_switch.to_json() if engine.last_switch is not None else None,
            "timeline": {"samples": [asdict(s) for s in samples], "switches": [asdict(s) for s in switches]}}


def switch(engine: EngineCore, loop: EngineLoop, mode: str) -> dict[str, Any]:
    """POST /admin/switch: the operator's switch (its outcome)."""
    return engine.switch_mode(mode, reason="operator").to_json()


def pause(engine: EngineCore, loop: EngineLoop, mode: str = "keep", clear_cache: bool = False) -> None:
    """POST /admin/pause (mode keep), /pause_generation and /pause (mode abort unless given): no step runs until
    resume (requests keep coming in); abort ends every request with the tokens it had, retract frees their KV
    (`EngineCore.pause_generation`). clear_cache: the prefix cache flushed too (vLLM's /pause does by default)."""
    loop.pause(mode)
    if clear_cache:
        engine.reset_prefix_cache()


def resume(engine: EngineCore, loop: EngineLoop) -> None:
    loop.resume()


def is_paused(engine: EngineCore, loop: EngineLoop) -> bool:
    return engine.paused


def release_memory(engine: EngineCore, loop: EngineLoop, tags: list[str] | None, keep_weights: bool
                   ) -> dict[str, Any]:
    """POST /release_memory_occupation, /sleep: the buffer's memory under `tags` given back, addresses kept
    (`EngineCore.release_memory_occupation`); what rank 0 gave back."""
    return dataclasses.asdict(engine.release_memory_occupation(tags, keep_weights))


def resume_memory(engine: EngineCore, loop: EngineLoop, tags: list[str] | None) -> dict[str, Any]:
    """POST /resume_memory_occupation, /wake_up."""
    return dataclasses.asdict(engine.resume_memory_occupation(tags))


def is_sleeping(engine: EngineCore, loop: EngineLoop) -> bool:
    return bool(engine.released)


def abort_all(engine: EngineCore, loop: EngineLoop) -> int:
    """Every request in flight ends with finish_reason abort and the tokens it had; how many."""
    return loop.abort_all()


def abort_requests(engine: EngineCore, loop: EngineLoop, request_ids: list[str]) -> int:
    """These engine requests end with finish_reason abort and the tokens they had (their answers go out); how many
    were live."""
    return loop.abort_requests(request_ids)


def flush_cache(engine: EngineCore, loop: EngineLoop) -> int:
    """The prefix cache's pages dropped on every rank (summed)."""
    return engine.reset_prefix_cache()


def weight_version(engine: EngineCore, loop: EngineLoop) -> str | None:
    return engine.weight_version


def update_weights_from_disk(engine: EngineCore, loop: EngineLoop, path: str, version: str | None,
                             abort_first: bool) -> dict[str, Any]:
    """New weights from a safetensors directory, between two steps (after the steps in flight; a switch asked for
    runs after it); abort_first: every request in flight ends first (SGLang's abort_all_requests). The prefix cache
    is always flushed (its pages hold the old weights' KV). No version given: the version stays (as SGLang)."""
    aborted = loop.abort_all() if abort_first else 0
    outcome = engine.update_weights_from_disk(path, version if version is not None else engine.weight_version)
    return {"views": outcome.views, "flushed_pages": outcome.flushed_pages, "aborted": aborted}


def update_weights_from_tensor(engine: EngineCore, loop: EngineLoop, description: dict[str, Any],
                               version: str | None, abort_first: bool) -> dict[str, Any]:
    """New weights from tensors a process of this machine exported by handle (`link/tensor_handles.py`; the
    description, names, shapes and dtypes checked before any request is aborted); as update_weights_from_disk for
    abort_first and the version."""
    engine.check_handles(description)
    aborted = loop.abort_all() if abort_first else 0
    outcome = engine.update_weights_from_handles(description,
                                                 version if version is not None else engine.weight_version)
    return {"views": outcome.views, "flushed_pages": outcome.flushed_pages, "aborted": aborted}


def init_weights_update_group(engine: EngineCore, loop: EngineLoop, master_address: str, master_port: int,
                              rank_offset: int, world_size: int, group_name: str, backend: str | None) -> None:
    """Join a trainer's process group (blocks the engine thread until the trainer and every rank are in)."""
    engine.init_weights_update_group(master_address, master_port, rank_offset, world_size, group_name,
                                     backend or ("nccl" if engine.device == "cuda" else "gloo"))


def update_weights_from_distributed(engine: EngineCore, loop: EngineLoop, names: list[str], dtypes: list[str],
                                    shapes: list[list[int]], group_name: str, version: str | None,
                                    abort_first: bool, load_format: str | None = None) -> dict[str, Any]:
    """New weights the trainer broadcasts in the group (checked first: a ValueError before the trainer may send);
    as update_weights_from_disk for abort_first and the version."""
    if abort_first:  # a refused update aborts nothing: the metadata checked before the requests end
        check_broadcast(engine.model_config, group_name, names, dtypes, shapes, load_format)
    aborted = loop.abort_all() if abort_first else 0
    outcome = engine.update_weights_from_distributed(names, dtypes, shapes, group_name,
                                                     version if version is not None else engine.weight_version,
                                                     load_format)
    return {"views": outcome.views, "flushed_pages": outcome.flushed_pages, "aborted": aborted}


def destroy_weights_update_group(engine: EngineCore, loop: EngineLoop, group_name: str) -> None:
    engine.destroy_weights_update_group(group_name)


POLICY_SETTINGS = ("policy", "profile", "high", "low", "window", "cooldown")  # the engine's switch_* flags


def policy_settings(engine: EngineCore, loop: EngineLoop) -> dict[str, Any]:
    """The auto-mode settings in effect: those /admin/policy last applied, else the engine's flags."""
    if loop.policy_settings is not None:
        return dict(loop.policy_settings)
    return {k: getattr(engine.config, f"switch_{k}") for k in POLICY_SETTINGS}


def set_policy(engine: EngineCore, loop: EngineLoop, body: dict[str, Any]) -> dict[str, Any]:
    """POST /admin/policy (on the engine thread): auto mode off ({"policy": "off"}: its settings are kept for the next
    call), or on with the settings in effect (`policy_settings`) changed where the body gives one (the engine's
    flags' names without `switch_`: policy, profile, high, low, window, cooldown); null or absent: as it was."""
    given = {k: v for k, v in body.items() if v is not None}
    if given.get("policy") == "off":
        if others := {k: v for k, v in given.items() if k != "policy"}:
            raise ValueError(f'policy "off" takes no other setting, got {others}')
        engine.set_auto(None)
        return {"policy": None}
    if engine.world_size == 1:
        raise ValueError("one rank: both layouts are the same, there is nothing for a policy to decide")
    settings = {**policy_settings(engine, loop), **given}
    try:
        cfg = EngineConfig.from_kwargs(**{**dataclasses.asdict(engine.config),
                                          **{f"switch_{k}": v for k, v in settings.items()}})
    except ValueError as e:  # the flags' names, as the body spells them; and the settings it was checking
        raise ValueError(f"{str(e).replace('switch_', '')} (the policy's settings would be {settings})") from None
    calibration = engine.kept_calibration() if needs_calibration(cfg) else None
    if needs_calibration(cfg) and calibration is None:
        raise ValueError("no calibration is kept for this engine: give high (T_h), or run moebius calibrate first")
    auto = build_auto(cfg, calibration)
    engine.set_auto(auto)
    loop.policy_settings = settings  # only once applied: a refused call changes nothing
    return {"policy": auto.note, "settings": settings}
