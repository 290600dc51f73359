"""A small GRPO loop with Moebius as its rollout engine, on the CPU in a few minutes.

The trainer is transformers' Qwen3MoeForCausalLM (a tiny checkpoint this script writes, or `--model`); the engine is
`moebius serve`, started here as a subprocess on 127.0.0.1 with an API key (or reached at `--url`). Every step:

1. sample `--group-size` completions for each of `--prompts-per-step` prompts through SGLang's `/generate`
   (`sampling_params.n`, `return_logprob`), with the engine's log-probability of every sampled token;
2. score them: the reward is the fraction of completion tokens that are lowercase ASCII letters (ids 97..122 of the
   byte vocabulary), which a random tiny model can learn in a few dozen steps;
3. one GRPO step: group-normalised advantages, the token-level ratio of the trainer's log-probabilities to the
   sampling ones, clipped (PPO's surrogate); the trainer's forward also gives the trainer-engine mismatch of the
   sampled tokens' log-probabilities (the same weights: the engine's were pushed at the end of the step before);
4. push every parameter, by its Hugging Face name, through `/update_weights_from_distributed`: the trainer is rank 0
   of a process group it builds as SGLang's trainers do (`init_custom_process_group`), the engine's ranks join it
   through `/init_weights_update_group`; one flattened bucket (every tensor's bytes in one broadcast) per step.

It prints one JSON line a step (reward, mismatch, the engine's layout from `/admin/status`) and a summary line at the
end: `{"summary": {...}}`. `--num-ranks 2` serves on two CPU ranks in auto mode with a low `--switch-high`, so the
engine switches TP <-> EP during the rollouts.

    python examples/grpo.py --steps 30
    python examples/grpo.py --smallest            # the CI setting (tests/test_grpo_example.py)
    python examples/grpo.py --num-ranks 2         # the engine switches layouts during the loop
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from typing import Any

import httpx
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

GROUP = "grpo_weights"
TARGET = range(97, 123)  # the reward's tokens: lowercase ASCII letters in a byte vocabulary
CLIP = 0.2  # PPO's clipping range of the ratio


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_tiny_checkpoint(path: str, seed: int) -> str:
    """A random Qwen3-MoE of the shapes tests/conftest.py writes: byte vocabulary of 300, hidden 64, 2 layers, 8
    experts top-2; transformers' default init (small weights: a near-uniform start that sampling can explore)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=300, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=512,
                         tie_word_embeddings=False, eos_token_id=None, mlp_only_layers=[], decoder_sparse_step=1)
    cfg.architectures = ["Qwen3MoeForCausalLM"]
    torch.manual_seed(seed)
    Qwen3MoeForCausalLM(cfg).float().save_pretrained(path)
    return path


class Engine:
    """The HTTP side: `moebius serve` as a subprocess (or a server at `url`), with its API key."""

    def __init__(self, url: str, api_key: str | None, proc: subprocess.Popen[bytes] | None = None) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.url, self.proc = url, proc
        self.client = httpx.Client(base_url=url, headers=headers, timeout=600)

    @classmethod
    def start(cls, model: str, num_ranks: int, seed: int, log: str) -> Engine:
        port, key = free_port(), os.urandom(8).hex()
        cmd = [sys.executable, "-m", "moebius.entrypoints.cli", "serve", "--model", model, "--host", "127.0.0.1",
               "--port", str(port), "--api-key", key, "--device", "cpu", "--dtype", "float32", "--seed", str(seed),
               "--num-ranks", str(num_ranks), "--disable-uvicorn-access-log"]
        if num_ranks > 1:  # auto mode that switches within a rollout: EP above 4 requests in flight, TP below
            cmd += ["--mode", "auto", "--switch-high", "4", "--switch-low", "2", "--switch-window", "1",
                    "--switch-cooldown", "0"]
        with open(log, "w") as f:
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
        engine = cls(f"http://127.0.0.1:{port}", key, proc)
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"moebius serve exited with {proc.returncode}; its log: {log}")
            try:
                if engine.client.get("/health", timeout=2).status_code == 200:
                    return engine
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"moebius serve did not answer /health within 300 s; its log: {log}")
            time.sleep(0.5)

    def post(self, route: str, body: dict[str, Any]) -> Any:
        r = self.client.post(route, json=body)
        if r.status_code != 200:
            raise RuntimeError(f"POST {route}: {r.status_code} {r.text}")
        return r.json()

    def status(self) -> dict[str, Any]:
        r = self.client.get("/admin/status")
        r.raise_for_status()
        return r.json()

    def close(self) -> None:
        self.client.close()
        if self.proc is not None:
            self.proc.terminate()  # SIGTERM: the server drains and exits
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def call_while(fn: Any, *args: Any) -> threading.Thread:
    """fn(*args) in a thread: an engine call that blocks until the trainer's side of a collective runs here."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["out"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - raised again in the caller by wait()
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.box = box  # type: ignore[attr-defined]
    t.start()
    return t


def wait(t: threading.Thread) -> Any:
    t.join()
    if "error" in t.box:  # type: ignore[attr-defined]
        raise t.box["error"]  # type: ignore[attr-defined]
    return t.box.get("out")  # type: ignore[attr-defined]


def join_update_group(engine: Engine, world_size: int, address: str) -> dist.ProcessGroup:
    """The trainer as rank 0 of a new group with the engine's ranks 1..P: SGLang's `init_custom_process_group` (a
    TCP store on the trainer's port, the group's name as its prefix), while the engine joins over HTTP."""
    port = free_port()
    t = call_while(engine.post, "/init_weights_update_group",
                   {"master_address": address, "master_port": port, "rank_offset": 1, "world_size": world_size,
                    "group_name": GROUP, "backend": "gloo"})
    store, rank, world = next(dist.rendezvous(f"tcp://{address}:{port}", 0, world_size,
                                              timeout=timedelta(seconds=120)))
    made = c10d._new_process_group_helper(world, rank, [], "gloo", store, group_name=GROUP,
                                          timeout=timedelta(seconds=120))
    pg = made[0] if isinstance(made, tuple) else made  # (pg, prefix store) since torch 2.3
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world)}  # group rank = global rank: src=0 is us
    wait(t)
    return pg


def push_weights(engine: Engine, model: torch.nn.Module, pg: dist.ProcessGroup, version: str) -> None:
    """Every parameter in its Hugging Face name, as one flattened bucket (the bytes back to back, one broadcast)."""
    params = [(n, p.detach().contiguous()) for n, p in model.named_parameters()]
    body = {"names": [n for n, _ in params], "dtypes": [str(p.dtype) for _, p in params],
            "shapes": [list(p.shape) for _, p in params], "group_name": GROUP, "weight_version": version,
            "load_format": "flattened_bucket"}
    # the engine checks the metadata first and answers 400 before any broadcast: send, then broadcast while it waits
    t = call_while(engine.post, "/update_weights_from_distributed", body)
    bucket = torch.cat([p.flatten().view(torch.uint8) for _, p in params])
    dist.broadcast(bucket, src=0, group=pg)
    out = wait(t)
    if not out.get("success"):
        raise RuntimeError(f"the engine refused the update: {out}")


def rollout(engine: Engine, prompts: list[list[int]], group_size: int, max_new_tokens: int, seed: int
            ) -> list[dict[str, Any]]:
    """group_size samples of each prompt (temperature 1: the raw log-probabilities are the sampling ones)."""
    sp = [{"n": group_size, "max_new_tokens": max_new_tokens, "temperature": 1.0, "ignore_eos": True,
           "sampling_seed": seed + i} for i in range(len(prompts))]
    out = engine.post("/generate", {"input_ids": prompts, "sampling_params": sp, "return_logprob": True})
    return out if isinstance(out, list) else [out]


def reward(tokens: list[int]) -> float:
    return sum(t in TARGET for t in tokens) / len(tokens)


def token_logprobs(model: torch.nn.Module, seqs: torch.Tensor, n_out: int) -> torch.Tensor:
    """The trainer's log-probability of each sequence's last n_out tokens, (B, n_out)."""
    logits = model(input_ids=seqs, use_cache=False).logits[:, -n_out - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, seqs[:, -n_out:, None])[..., 0]


def grpo_step(model: torch.nn.Module, opt: torch.optim.Optimizer, prompts: list[list[int]],
              samples: list[dict[str, Any]], group_size: int) -> tuple[float, float, float]:
    """One policy-gradient step on a rollout; (mean reward, mean and max |trainer - engine| log-probability)."""
    n_out = len(samples[0]["output_ids"])
    seqs = torch.tensor([prompts[i // group_size] + s["output_ids"] for i, s in enumerate(samples)])
    old = torch.tensor([[lp for lp, _, _ in s["meta_info"]["output_token_logprobs"]] for s in samples])
    rewards = torch.tensor([reward(s["output_ids"]) for s in samples]).view(-1, group_size)
    adv = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)).view(-1, 1)
    new = token_logprobs(model, seqs, n_out)
    gap = (new.detach() - old).abs()
    ratio = torch.exp(new - old)
    loss = -torch.min(ratio * adv, ratio.clamp(1 - CLIP, 1 + CLIP) * adv).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return rewards.mean().item(), gap.mean().item(), gap.max().item()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a Qwen3-MoE Hugging Face directory (default: a tiny random one written here)")
    ap.add_argument("--url", help="a running `moebius serve` of --model (default: one started here); its key: the "
                    "environment's MOEBIUS_API_KEY")
    ap.add_argument("--master-address", default="127.0.0.1", help="this trainer's address as the engine reaches it "
                    "(the update group's TCP store)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--prompts-per-step", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--num-ranks", type=int, default=1, help="the engine's ranks (2: auto mode that switches)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=3e-2)
    ap.add_argument("--smallest", action="store_true", help="the CI setting: 12 steps, 4 prompts x 4 samples x 8")
    args = ap.parse_args(argv)
    if args.smallest:
        args.steps, args.group_size, args.prompts_per_step, args.max_new_tokens = 12, 4, 4, 8
    if args.url and not args.model:  # the trainer must start from the weights the engine serves (same shapes)
        raise SystemExit("--url needs --model: the directory the server at that URL serves")
    if args.group_size < 2:
        raise SystemExit(f"--group-size must be >= 2 (advantages are normalised within a group), got "
                         f"{args.group_size}")

    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(args.seed)
    tmp = tempfile.TemporaryDirectory(prefix="grpo-")
    path = args.model or write_tiny_checkpoint(os.path.join(tmp.name, "model"), args.seed)
    if args.url:
        engine = Engine(args.url, os.environ.get("MOEBIUS_API_KEY"))
    else:
        engine = Engine.start(path, args.num_ranks, args.seed, os.path.join(tmp.name, "serve.log"))
    try:
        model = Qwen3MoeForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager",
                                                    experts_implementation="eager")
        vocab = model.config.vocab_size
        opt = torch.optim.Adam(model.parameters(), lr=args.lr)
        pg = join_update_group(engine, 1 + engine.status()["world_size"], args.master_address)
        push_weights(engine, model, pg, "step-0")  # from here on the engine holds the trainer's weights exactly
        gen = torch.Generator().manual_seed(args.seed)
        history: list[dict[str, Any]] = []
        seen = max((s["t"] for s in engine.status()["timeline"]["switches"]), default=-1.0)  # switches before us
        for step in range(args.steps):
            prompts = torch.randint(0, min(vocab, 256), (args.prompts_per_step, args.prompt_len),
                                    generator=gen).tolist()
            samples = rollout(engine, prompts, args.group_size, args.max_new_tokens, 1000 * args.seed + 100 * step)
            versions = {s["meta_info"]["weight_version"] for s in samples}
            if versions != {f"step-{step}"}:
                raise RuntimeError(f"step {step}: samples from weight versions {versions}, expected step-{step}")
            layout = engine.status()  # after the rollout: auto mode may have switched during it
            r, gap_mean, gap_max = grpo_step(model, opt, prompts, samples, args.group_size)
            push_weights(engine, model, pg, f"step-{step + 1}")
            new = [s for s in layout["timeline"]["switches"] if s["t"] > seen and s["done"]]
            seen = max([seen] + [s["t"] for s in layout["timeline"]["switches"]])
            row = {"step": step, "reward": round(r, 4), "logprob_diff_mean": gap_mean, "logprob_diff_max": gap_max,
                   "mode": layout["mode"], "switched": [f"{s['source']}->{s['target']}" for s in new]}
            history.append(row)
            print(json.dumps(row), flush=True)
        engine.post("/destroy_weights_update_group", {"group_name": GROUP})
        dist.destroy_process_group(pg)
        summary = {"rewards": [h["reward"] for h in history],
                   "logprob_diff_mean": sum(h["logprob_diff_mean"] for h in history) / max(len(history), 1),
                   "logprob_diff_max": max((h["logprob_diff_max"] for h in history), default=0.0),
                   "modes": [h["mode"] for h in history], "switches": sum(len(h["switched"]) for h in history)}
        print(json.dumps({"summary": summary}), flush=True)
        return summary
    finally:
        engine.close()
        tmp.cleanup()


if __name__ == "__main__":
    main()
