"""The `moebius` command line: `moebius generate` runs prompts offline and writes JSONL results; `moebius serve` serves
an OpenAI-compatible HTTP API (moebius/entrypoints/openai/)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import time
from typing import Any

from moebius import __version__
from moebius.config import ConfigError, EngineConfig
from moebius.sampling_params import SamplingParams

# Sampling flags: the defaults of every prompt, with SamplingParams' own defaults (the API's, as in vLLM). A request's
# seed comes from its JSONL line ("seed"), or is drawn from the engine's --seed, so runs are reproducible.
SAMPLING_FLAGS: list[tuple[str, type, str]] = [
    ("max_tokens", int, "most tokens to generate per prompt"),
    ("min_tokens", int, "generate at least this many tokens before EOS / stop tokens may end a request"),
    ("temperature", float, "0 = greedy; higher = more random"),
    ("top_p", float, "nucleus sampling: keep the smallest set of tokens with this total probability"),
    ("top_k", int, "keep only the k most likely tokens (-1 = all)"),
    ("n", int, "samples per prompt"),
]
_SAMPLING_DEFAULTS = SamplingParams()

EXAMPLE_JSONL = ('{"prompt": "Hello"}  or  {"prompt_token_ids": [1, 2, 3]}  or  '
                 '{"messages": [{"role": "user", "content": "Hi"}]}, optionally with sampling keys such as '
                 '"max_tokens" or "temperature"')


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moebius", description="Moebius: MoE serving that switches live between "
                                     "tensor and expert parallelism.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="run prompts offline and write JSONL results",
                         description="Generate completions for prompts given as arguments or in a JSONL file. "
                         "With no --model, runs the small built-in model (random weights: its text is meaningless).",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    io = gen.add_argument_group("input and output")
    io.add_argument("prompts", nargs="*", help="prompts (text); default: one demo prompt when no --input is given")
    io.add_argument("--input", "-i", help=f"JSONL file of prompts, one object per line: {EXAMPLE_JSONL}")
    io.add_argument("--output", "-o", help="write JSONL results here (default: standard output)")
    io.add_argument("--chat", action="store_true", help="wrap text prompts in the tokenizer's chat template")
    io.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    samp = gen.add_argument_group("sampling (defaults for every prompt)")
    for name, kind, text in SAMPLING_FLAGS:
        samp.add_argument("--" + name.replace("_", "-"), dest=name, type=kind,
                          default=getattr(_SAMPLING_DEFAULTS, name), help=text)
    samp.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    samp.add_argument("--ignore-eos", action="store_true", help="keep generating after the end-of-sequence token")
    EngineConfig.add_cli_args(gen)
    cal = sub.add_parser("calibrate", help="time both layouts for auto mode's policy; keep and print the profile",
                         description="Time decode steps of both layouts over a few batch sizes and a switch each way, "
                         "keep the profile where auto mode looks for it (--calibration-dir) and print it. Auto mode "
                         "does this itself at start-up when no profile is kept for the model, ranks, GPU, dtype and "
                         "step settings.",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    cal.add_argument("--fresh", action="store_true", help="measure again even if a profile is kept")
    cal.add_argument("--batches", type=lambda v: tuple(int(x) for x in v.split(",")), default=None,
                     help="global decode batches to time, comma-separated (default: 1,4,16,64,128,256,512,1024,2048, "
                     "up to what the engine runs)")
    cal.add_argument("--context", type=int, default=256, help="cached tokens a request in the timed steps")
    EngineConfig.add_cli_args(cal)
    from moebius.entrypoints.openai import server  # (imports no web package until it serves)

    server.add_parser(sub)
    bench = sub.add_parser("bench", help="benchmarks (JSON results + PNG plots)")
    from moebius.bench import bursty, rollout, simulate, sweep, throughput
    from moebius.bench import serve_load as bench_serve

    kinds = bench.add_subparsers(dest="bench", required=True)
    for tool in (sweep, throughput, rollout, bursty, simulate, bench_serve):
        tool.add_parser(kinds)
    return parser


def _sampling(args: argparse.Namespace, overrides: dict[str, Any]) -> SamplingParams:
    base: dict[str, Any] = {name: getattr(args, name) for name, *_ in SAMPLING_FLAGS}
    base.update(stop=args.stop, ignore_eos=args.ignore_eos)
    fields = {f.name for f in dataclasses.fields(SamplingParams) if f.init}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(f"unknown sampling key(s) {unknown}")
    return SamplingParams(**{**base, **overrides})


def _read_prompts(args: argparse.Namespace) -> list[tuple[Any, dict[str, Any]]]:
    """(prompt or messages, sampling overrides) per request."""
    items: list[tuple[Any, dict[str, Any]]] = [(p, {}) for p in args.prompts]
    if args.input:
        with open(args.input, "rb") as f:
            lines = _lines(f.read(), args.input)
            for n, line in lines:
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{args.input}:{n}: not valid JSON ({e.msg})") from None
                if not isinstance(obj, dict):
                    raise ValueError(f"{args.input}:{n}: expected an object like {EXAMPLE_JSONL}")
                keys = [k for k in ("prompt", "prompt_token_ids", "messages") if k in obj]
                if len(keys) != 1:
                    raise ValueError(f"{args.input}:{n}: give exactly one of prompt, prompt_token_ids, messages")
                prompt = ("messages", obj.pop("messages")) if keys[0] == "messages" else obj.pop(keys[0])
                try:
                    _sampling(args, obj)  # checked here, where the line is known, and before the model loads
                except (ValueError, TypeError) as e:
                    raise ValueError(f"{args.input}:{n}: {e}") from None
                items.append((prompt, obj))
    if not items:
        items = [("The quick brown fox", {})]
    return items


def _lines(data: bytes, name: str) -> list[tuple[int, str]]:
    """(line number, line) of a file's bytes, or a ValueError naming the first line that is not UTF-8."""
    out = []
    for n, raw in enumerate(data.splitlines(), 1):
        try:
            out.append((n, raw.decode("utf-8")))
        except UnicodeDecodeError as e:
            raise ValueError(f"{name}:{n}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    return out


def generate(args: argparse.Namespace) -> int:
    from moebius.entrypoints.llm import LLM

    _sampling(args, {})  # the flags, before the model loads
    if args.output and not os.path.isdir(os.path.dirname(os.path.abspath(args.output))):
        raise ValueError(f"--output {args.output}: its folder does not exist")
    items = _read_prompts(args)
    llm = LLM(**dataclasses.asdict(EngineConfig.from_cli_args(args)))
    tok = llm.tokenizer
    prompts, params = [], []
    for prompt, overrides in items:
        if isinstance(prompt, tuple) or (args.chat and isinstance(prompt, str)):
            messages = prompt[1] if isinstance(prompt, tuple) else [{"role": "user", "content": prompt}]
            if tok is None:
                raise ValueError("chat prompts need a tokenizer with a chat template")
            prompt = tok.apply_chat_template(messages, add_generation_prompt=True)
        prompts.append(prompt)
        params.append(_sampling(args, overrides))
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=not args.no_progress)
    elapsed = time.perf_counter() - start
    llm.close()
    sink = open(args.output, "w") if args.output else sys.stdout  # noqa: SIM115
    try:
        for i, out in enumerate(outs):
            rec = {"index": i, "prompt": out.prompt, "num_prompt_tokens": out.num_prompt_tokens,
                   "ttft_s": out.ttft,
                   "outputs": [{"text": o.text, "token_ids": o.token_ids, "finish_reason": o.finish_reason}
                               for o in out.outputs]}
            sink.write(json.dumps(rec, ensure_ascii=False) + "\n")
    finally:
        if sink is not sys.stdout:
            sink.close()
    total = sum(o.num_output_tokens for o in outs)
    print(f"{len(outs)} requests, {total} output tokens in {elapsed:.2f}s ({total / elapsed:.1f} tok/s)",
          file=sys.stderr)
    if llm.config.model is None:
        from moebius.model.builtin import BUILTIN_NOTICE
        print(BUILTIN_NOTICE, file=sys.stderr)
    return 0


def calibrate(args: argparse.Namespace) -> int:
    from moebius.frontend.core import EngineCore

    ecfg = EngineConfig.from_cli_args(args)
    # a fixed start layout: auto mode would calibrate at start-up already
    with EngineCore(dataclasses.replace(ecfg, mode=ecfg.mode if ecfg.mode in ("tp", "ep") else "tp")) as engine:
        cal = engine.calibration(fresh=args.fresh, batches=args.batches, context=args.context)
    print(json.dumps(cal.to_json(), indent=1))
    print(cal.summary(), file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        if args.command == "generate":
            return generate(args)
        if args.command == "calibrate":
            return calibrate(args)
        if args.command == "serve":
            from moebius.entrypoints.openai.server import serve

            return serve(args)
        if args.command == "bench":
            return args.func(args)
    except (ValueError, ConfigError, FileNotFoundError, TypeError) as e:
        print(f"moebius: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # the engine's ranks are closed by its finalizer
        print("moebius: interrupted", file=sys.stderr)
        return 130
    return 1


if __name__ == "__main__":
    sys.exit(main())
