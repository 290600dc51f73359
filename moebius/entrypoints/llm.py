"""The offline API: `LLM(model=..., **engine_flags).generate(prompts, SamplingParams(...))`, plus a step-level
interface (add_request / step / abort / has_unfinished) for drivers that interleave their own work.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NoReturn

import torch
from tqdm import tqdm

from moebius.config import EngineConfig
from moebius.entrypoints.admin import AdminServer
from moebius.frontend.chat import chat_conversations
from moebius.frontend.core import EngineClosedError, EngineCore, EngineStateError, Prompt, is_token_id
from moebius.link.messages import MemoryOutcome, SwitchOutcome, UpdateOutcome
from moebius.outputs import RequestOutput
from moebius.sampling_params import RequestOutputKind, SamplingParams


class LLM:
    """A Moebius engine in this process. Every engine flag (see `moebius generate --help`) is a keyword argument,
    with underscores for dashes: `LLM(model=path, dtype="float32", device="cpu", block_size=16)`."""

    def __init__(self, model: str | None = None, **engine_flags: Any) -> None:
        self.config = EngineConfig.from_kwargs(model=model, **engine_flags)
        self.engine = EngineCore(self.config)
        self.tokenizer = self.engine.tokenizer
        self._others: list[RequestOutput] = []  # outputs of step-level requests that came while generate() ran
        self._closed = False
        c = self.config
        # operator endpoints (--admin-port): what they ask for runs here, between two steps
        try:
            self.admin = (AdminServer(self.engine, c.admin_host, c.admin_port, c.api_key) if c.admin_port is not None
                          else None)
        except Exception:
            self.engine.close()  # the ranks are up: do not leave them behind
            raise

    # ---- batch API ----
    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate for every prompt; outputs in input order. A bad prompt raises before any is admitted; a call
        interrupted (Ctrl-C, an engine error) leaves none of its requests running."""
        self._check_open()
        if isinstance(prompts, str) or (isinstance(prompts, list | tuple) and prompts and is_token_id(prompts[0])):
            prompts = [prompts]  # one prompt (text, or a list of token ids)
        if not isinstance(prompts, list | tuple):
            raise TypeError(f"prompts must be a string, a list of token ids, or a list of those; got "
                            f"{type(prompts).__name__}")
        if not isinstance(use_tqdm, bool):
            raise TypeError(f"use_tqdm must be True or False, got {use_tqdm!r}")
        if self.engine.paused:  # nothing could resume it while generate() waits
            raise RuntimeError("generation is paused (pause_generation): generate() would wait forever; call "
                               "resume_generation() first")
        if self.engine.released:
            raise EngineStateError(f"the engine's memory is released ({', '.join(sorted(self.engine.released))}): "
                               "generate() would wait forever; call resume_memory_occupation() first")
        prompts = list(prompts)
        params = _params_for(sampling_params, len(prompts))
        checked = []
        for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
            try:
                checked.append(self.engine.validate(p, sp))
            except (ValueError, TypeError) as e:
                raise type(e)(f"prompt {i}: {e}") from None
        final = RequestOutputKind.FINAL_ONLY  # one output a request: the others would only be dropped here
        ids: list[str] = []
        try:
            for p, sp, c in zip(prompts, params, checked, strict=True):
                ids.append(self.engine.add_request(p, sp, validated=c, output_kind=final))
            return self._run(ids, use_tqdm)
        except BaseException:
            self._forget(ids)
            raise

    def _forget(self, ids: list[str]) -> None:
        """End the requests of a generate() that did not return; their outputs go to no one."""
        if not self.engine.closed:
            self.engine.discard(ids)

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = False) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation or a list of them, then generate. A message is
        a dict with a "role" and a "content": a string, or a list of text parts ({"type": "text", "text": ...},
        joined by newlines, as the server takes them)."""
        self._check_open()
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer with a chat template (the model directory has no tokenizer.json "
                             "nor tiktoken.model)")
        convs = chat_conversations(messages)
        prompts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=True) for c in convs]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        """Step until these requests finished; other requests' outputs wait for the next step() call."""
        wanted = set(ids)
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generate", unit="req", disable=not use_tqdm)
        try:
            while len(done) < len(ids):
                for out in self.step():
                    if out.request_id in wanted:
                        if out.finished:
                            done[out.request_id] = out
                            bar.update(1)
                    else:
                        self._others.append(out)
        finally:
            bar.close()
        return [done[i] for i in ids]

    # ---- step-level API ----
    def add_request(self, prompt: Prompt, sampling_params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Admit one request (ValueError / TypeError for bad input; nothing else is affected); returns its id. It
        runs on a copy of sampling_params: changing that object afterwards changes no request admitted."""
        self._check_open()
        return self.engine.add_request(prompt, sampling_params, request_id)

    def step(self) -> list[RequestOutput]:
        """Run one engine step; the outputs of the requests that got tokens or finished in it, each as its
        `SamplingParams.output_kind` asks (default: everything so far)."""
        self._check_open()
        if self.admin is None:
            outs = self.engine.step()
        else:
            self.admin.poll()  # operator switches happen here, between two steps
            outs = self.engine.step()
            self.admin.publish()
        waiting, self._others = self._others, []  # (after the step: a step that raises loses none of them)
        return waiting + outs

    def abort(self, request_id: str) -> None:
        self._check_open()
        self.engine.abort(request_id)

    def has_unfinished(self) -> bool:
        """Whether step() has work (never after close())."""
        return not self._closed and (bool(self._others) or self.engine.has_unfinished())

    def switch_mode(self, mode: str) -> SwitchOutcome:
        """Switch live to "tp" or "ep" between two steps; requests in flight continue where they were. Returns the
        outcome: done (or why not: `reason`), where the host's time went and the pass's device times (`device`:
        weights, KV, span, total, in ms)."""
        self._check_open()
        return self.engine.switch_mode(mode)

    def pause_generation(self, mode: str = "abort") -> None:
        """Stop stepping until resume_generation(), around a weight update (vLLM's and SGLang's semantics): mode
        "abort" ends every request now with finish_reason "abort" and the tokens it had; "retract" sends every request
        back to waiting with its KV freed, to recompute prompt + output so far after resume (under the weights of
        then); "keep" (or SGLang's "in_place") leaves them as they are, to continue after resume; "wait" runs them to
        their end first. New requests are taken while paused and wait; step() runs no step. The outputs this produces
        come with the next step()."""
        self._check_open()
        self._others += self.engine.pause_generation(mode)

    def resume_generation(self) -> None:
        """Steps run again (a no-op when not paused)."""
        self._check_open()
        self.engine.resume_generation()

    @property
    def is_paused(self) -> bool:
        """Whether pause_generation() holds the engine."""
        return self.engine.paused

    def abort_all(self) -> list[str]:
        """Abort every request in flight (finish_reason "abort", the tokens each had; outputs with the next step());
        returns their ids."""
        self._check_open()
        return self.engine.abort_all()

    def release_memory_occupation(self, tags: Sequence[str] | None = None, keep_weights: bool = True
                                  ) -> MemoryOutcome:
        """Free the GPU memory of the weights and / or the KV cache (`tags`: "weights", "kv_cache"; None: both) for a
        trainer that shares the GPU, keeping every address, so resume_memory_occupation() brings the engine back
        with its CUDA graphs as they were (SGLang's call). keep_weights: the weights wait in host memory and come
        back on resume; False drops them (then update the weights after resume). No step runs while anything is
        released; releasing the KV cache needs no request in flight. Returns what rank 0 gave back."""
        self._check_open()
        return self.engine.release_memory_occupation(tags, keep_weights)

    def resume_memory_occupation(self, tags: Sequence[str] | None = None) -> MemoryOutcome:
        """Take the released memory back (`tags`; None: all), at the same addresses."""
        self._check_open()
        return self.engine.resume_memory_occupation(tags)

    def sleep(self, level: int = 1) -> MemoryOutcome:
        """vLLM's name: level 1 releases the weights (kept in host memory) and the KV cache; level 2 drops the
        weights as well (update them after wake_up)."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        return self.release_memory_occupation(None, keep_weights=level == 1)

    def wake_up(self, tags: Sequence[str] | None = None) -> MemoryOutcome:
        """vLLM's name for resume_memory_occupation."""
        return self.resume_memory_occupation(tags)

    def is_sleeping(self) -> bool:
        """Whether any memory is released (vLLM's name)."""
        self._check_open()
        return bool(self.engine.released)

    @property
    def mode(self) -> str:
        return self.engine.mode

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                       weight_version: str | None = None) -> UpdateOutcome:
        """Write new weights into the running engine between two steps: `(name, tensor)` pairs in the Hugging Face
        checkpoint's names (experts one by one, or transformers 5's fused `mlp.experts.gate_up_proj` /
        `down_proj`: a trainer's `model.named_parameters()`), any subset of the model, any floating dtype. Each
        name, shape and dtype is checked before a byte is written (ValueError / TypeError naming the first bad one;
        the old weights stay). Both layouts' views are rewritten in place (a later switch moves the new experts),
        the prefix cache is flushed, and requests in flight continue on the new weights. `weight_version` is
        reported on every output from now on (`RequestOutput.weight_version`) and by `weight_version`. With rank
        processes, CUDA tensors reach them by CUDA IPC handle (no copy through the host), CPU ones through one
        shared-memory segment."""
        self._check_open()
        return self.engine.update_weights(named_tensors, weight_version)

    def update_weights_from_handles(self, description: Mapping[str, Any], weight_version: str | None = None
                                    ) -> UpdateOutcome:
        """`update_weights` with tensors another process of this machine exported by handle (its
        `moebius.link.tensor_handles.export_tensors(named_tensors)` description: CUDA tensors by IPC handle, CPU
        ones in shared memory), read where they lie; the exporter keeps them until this returns. ValueError naming
        what is wrong in the description (or a name, shape, dtype) before anything is opened."""
        self._check_open()
        return self.engine.update_weights_from_handles(description, weight_version)

    def update_weights_from_disk(self, path: str, weight_version: str | None = None) -> UpdateOutcome:
        """`update_weights` with every tensor of a safetensors directory of the same architecture and shapes (its
        files and config.json checked first; ConfigError naming what is wrong)."""
        self._check_open()
        return self.engine.update_weights_from_disk(path, weight_version)

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str, backend: str = "gloo") -> None:
        """Join a trainer's process group for `update_weights_from_distributed` (SGLang's protocol): the trainer is
        rank 0 of `world_size` (1 + the engine's ranks, usually), hosting the TCP store on master_address:master_port;
        the engine's rank r is `rank_offset + r`. Blocks until every member joined: the trainer joins at the same
        time (SGLang's `init_custom_process_group`, plain torch.distributed). gloo on CPUs, nccl on GPUs."""
        self._check_open()
        self.engine.init_weights_update_group(master_address, master_port, rank_offset, world_size, group_name,
                                              backend)

    def update_weights_from_distributed(self, names: Sequence[str], dtypes: Sequence[str],
                                        shapes: Sequence[Sequence[int]], group_name: str | None = None,
                                        weight_version: str | None = None, load_format: str | None = None
                                        ) -> UpdateOutcome:
        """`update_weights` with tensors the trainer's rank 0 broadcasts in the group, one `dist.broadcast(t, src=0)`
        each in the order of `names` (dtypes as "bfloat16" or "torch.bfloat16"). The metadata is checked before any
        rank receives: a bad name, shape or dtype raises ValueError naming it, the trainer must then not broadcast,
        and the old weights stay. load_format "flattened_bucket" (SGLang's): one uint8 broadcast of every tensor's
        bytes back to back, in the order of `names`."""
        self._check_open()
        return self.engine.update_weights_from_distributed(names, dtypes, shapes, group_name, weight_version,
                                                           load_format)

    def destroy_weights_update_group(self, group_name: str) -> None:
        """Leave the trainer's process group `group_name` (the trainer destroys its side too)."""
        self._check_open()
        self.engine.destroy_weights_update_group(group_name)

    @property
    def weight_version(self) -> str | None:
        """The version given with the last weight update (None before any)."""
        return self.engine.weight_version

    def reset_prefix_cache(self) -> int:
        """Forget every cached page (vLLM's name); returns how many pages were dropped, summed over ranks."""
        self._check_open()
        return self.engine.reset_prefix_cache()

    def kv_stats(self) -> dict[str, object]:
        """KV-cache tokens free / in total the engine holds in its layout (TP: one rank's, every rank holds every
        request; EP: summed over ranks), "capacity" by layout, "per_rank"; requests preempted so far."""
        self._check_open()
        return self.engine.kv_stats()

    def close(self) -> None:
        """Stop the rank processes (if any) and the admin endpoints. Every later call but close() raises
        EngineClosedError (a RuntimeError); a second close() does nothing."""
        if self._closed:
            return
        self._closed = True
        if self.admin is not None:
            self.admin.close()
        self.engine.close()

    def _check_open(self) -> None:
        if self._closed:
            _closed()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _closed() -> NoReturn:
    raise EngineClosedError("this LLM was closed (LLM.close()): it runs nothing any more; build a new LLM")


def _params_for(sampling_params: object, n: int) -> list[SamplingParams]:
    """One SamplingParams a prompt: the one given for all, the default, or a list of them (TypeError for anything
    else, ValueError for a list of another length)."""
    if sampling_params is None:
        return [SamplingParams()] * n
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * n
    if not isinstance(sampling_params, list | tuple):
        raise TypeError(f"sampling_params must be SamplingParams or a list of them (one a prompt), got "
                        f"{type(sampling_params).__name__}")
    for i, sp in enumerate(sampling_params):
        if not isinstance(sp, SamplingParams):
            raise TypeError(f"sampling_params[{i}] must be SamplingParams, got {type(sp).__name__}")
    if len(sampling_params) != n:
        raise ValueError(f"got {len(sampling_params)} sampling params for {n} prompts")
    return list(sampling_params)
