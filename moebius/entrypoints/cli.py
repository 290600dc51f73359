"""The `moebius` command line: `moebius generate` runs prompts offline and writes JSONL results as they finish;
`moebius serve` serves an OpenAI-compatible HTTP API (moebius/entrypoints/openai/).

What a user passes is checked before the model loads wherever it can be: flags, the input file line by line, the
output path. A bad value ends the command with exit code 2 and one line `moebius: error: ...` naming it."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO, Any, NoReturn

from moebius import __version__
from moebius.config import ConfigError, EngineConfig, HelpFormatter, flag_names
from moebius.frontend.chat import conversation
from moebius.sampling_params import RequestOutputKind, SamplingParams
from moebius.switch.calibration import DEFAULT_BATCHES

log = logging.getLogger("moebius")

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
_SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams) if f.init)
# SamplingParams fields a JSONL line may not set, and why (the command decides them, or JSONL cannot carry them)
_REFUSED_KEYS = {
    "output_kind": "moebius generate writes each request's final output",
    "prompt_logits": "prompt logits ([prompt tokens, vocabulary] floats) are not written to JSONL; use the Python "
                     "API (LLM.generate with SamplingParams(prompt_logits=True))",
}

EXAMPLE_JSONL = ('{"prompt": "Hello"}  or  {"prompt_token_ids": [1, 2, 3]}  or  '
                 '{"messages": [{"role": "user", "content": "Hi"}]}, optionally with sampling keys such as '
                 '"max_tokens", "temperature", "seed" or "logprobs"')
DEMO_PROMPT = "The quick brown fox"
BOM = b"\xef\xbb\xbf"

# engine flags `moebius calibrate` has no use for: it starts no admin endpoints, runs no switch policy, and times both
# layouts (a static layout holds one); its --mode is its own (tp or ep: auto would calibrate at start-up already)
CALIBRATE_EXCLUDES = ("admin_port", "admin_host", "api_key", "switch_policy", "switch_profile", "switch_high",
                      "switch_low", "switch_window", "switch_cooldown", "static_layout", "mode")


class Parser(argparse.ArgumentParser):
    """argparse's usage errors as one line, `moebius: error: ...`, with argparse's exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"moebius: error: {message} (see `{self.prog} --help`)\n")


class RunError(Exception):
    """A run that could not go on (results could not be written: a full disk, a closed pipe; the engine failed): exit
    code 1, what was written is kept."""


@dataclass
class Item:
    """One request of `moebius generate`: its prompt (text or token ids) or chat messages, and its sampling keys."""

    index: int  # its position among the prompts (arguments first, then the input's lines): the output's "index"
    where: str  # where it came from, for errors: "prompt argument 1", "in.jsonl:3"
    prompt: str | list[int] | None
    messages: list[dict[str, str]] | None
    overrides: dict[str, Any]


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="moebius", description="Moebius: MoE serving that switches live between tensor and expert "
                    "parallelism.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="run prompts offline and write JSONL results",
                         description="Generate completions for prompts given as arguments or in a JSONL file and "
                         "write one JSON line per request as it finishes. With no --model, runs the small built-in "
                         "model (random weights: its text is meaningless).", formatter_class=HelpFormatter)
    io = gen.add_argument_group("input and output")
    io.add_argument("prompts", nargs="*", help="prompts (text), before those of --input; default: one demo prompt "
                    "when no --input is given")
    io.add_argument("--input", "-i", help=f"JSONL file of prompts ('-': standard input; UTF-8, a byte-order mark is "
                    f"skipped), one object per line: {EXAMPLE_JSONL}; default: none")
    io.add_argument("--output", "-o", help="JSONL file for the results, opened before the model loads: one line per "
                    "request, written and flushed as it finishes (so in finishing order, those that finish together "
                    "in input order; each line's \"index\" is its prompt's position, arguments first, then the "
                    "input's lines); Ctrl-C keeps the lines written; default (or '-'): standard output")
    io.add_argument("--chat", action="store_true", help="wrap text prompts (arguments and \"prompt\" lines) in the "
                    "tokenizer's chat template; token ids are sent as given")
    io.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    samp = gen.add_argument_group("sampling (defaults for every prompt)")
    for name, kind, text in SAMPLING_FLAGS:
        samp.add_argument("--" + name.replace("_", "-"), dest=name, type=kind,
                          default=getattr(_SAMPLING_DEFAULTS, name), help=text)
    samp.add_argument("--stop", action="append", default=None, help="stop string (repeatable); default: none")
    samp.add_argument("--ignore-eos", action="store_true", help="keep generating after the end-of-sequence token")
    EngineConfig.add_cli_args(gen)
    cal = sub.add_parser("calibrate", help="time both layouts for auto mode's policy; keep and print the profile",
                         description="Time decode steps of both layouts over a few batch sizes and a switch each way, "
                         "keep the profile where auto mode looks for it (--calibration-dir) and print it. Auto mode "
                         "does this itself at start-up when no profile is kept for the model, ranks, GPU, dtype and "
                         "step settings.", formatter_class=HelpFormatter)
    cal.add_argument("--fresh", action="store_true", help="measure again even if a profile is kept")
    cal.add_argument("--batches", type=_batches, default=None,
                     help="global decode batches to time, comma-separated positive integers; those past what the "
                     "engine runs (--max-running-requests, the KV cache) are left out (default: "
                     f"{','.join(map(str, DEFAULT_BATCHES))})")
    cal.add_argument("--context", type=int, default=256,
                     help="cached tokens a request in the timed steps (at most half the context length)")
    cal.add_argument("--mode", choices=("tp", "ep"), default="tp", help="the layout the engine starts and ends in "
                     "(both are timed)")
    EngineConfig.add_cli_args(cal, exclude=CALIBRATE_EXCLUDES)
    from moebius.entrypoints.openai import server  # (imports no web package until it serves)

    server.add_parser(sub)
    bench = sub.add_parser("bench", help="benchmarks (JSON results + PNG plots)")
    from moebius.bench import bursty, rollout, simulate, sweep, throughput
    from moebius.bench import serve_load as bench_serve

    kinds = bench.add_subparsers(dest="bench", required=True)
    for tool in (sweep, throughput, rollout, bursty, simulate, bench_serve):
        tool.add_parser(kinds)
    return parser


def _batches(value: str) -> tuple[int, ...]:
    """--batches: comma-separated positive integers."""
    out = []
    for part in value.split(","):
        try:
            b = int(part)
        except ValueError:
            b = 0
        if b < 1:
            raise argparse.ArgumentTypeError(f"{part.strip()!r} in {value!r} is not a positive integer")
        out.append(b)
    return tuple(out)


def _sampling(args: argparse.Namespace, overrides: dict[str, Any],
              output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE) -> SamplingParams:
    """The SamplingParams of one request: the flags, then its JSONL keys (ValueError naming a wrong one)."""
    base: dict[str, Any] = {name: getattr(args, name) for name, *_ in SAMPLING_FLAGS}
    base.update(stop=args.stop, ignore_eos=args.ignore_eos)
    unknown = sorted(set(overrides) - _SAMPLING_FIELDS)
    if unknown:
        raise ValueError(f"unknown key(s) {unknown}; a line holds one of prompt, prompt_token_ids, messages and "
                         f"sampling keys ({', '.join(sorted(_SAMPLING_FIELDS - set(_REFUSED_KEYS)))})")
    refused = sorted(set(overrides) & set(_REFUSED_KEYS))
    if refused:
        raise ValueError(f"key {refused[0]!r} is not taken here: {_REFUSED_KEYS[refused[0]]}")
    return SamplingParams(**{**base, **overrides, "output_kind": output_kind})


def _check_flags(args: argparse.Namespace) -> None:
    """The sampling flags, before the model loads; errors name the flags."""
    try:
        _sampling(args, {})
    except (ValueError, TypeError) as e:
        raise ValueError(flag_names(str(e), [*(name for name, *_ in SAMPLING_FLAGS), "stop"])) from None


def _read_input(name: str) -> bytes:
    """The bytes of --input (a path, or '-' for standard input), or a ValueError saying why not."""
    if name == "-":
        return sys.stdin.buffer.read()
    try:
        with open(name, "rb") as f:
            return f.read()
    except IsADirectoryError:
        raise ValueError(f"--input {name}: is a folder, not a JSONL file") from None
    except FileNotFoundError:
        raise ValueError(f"--input {name}: no such file") from None
    except OSError as e:
        raise ValueError(f"--input {name}: cannot be read ({e.strerror or e})") from None


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object's keys, each once (json would keep the last of two silently)."""
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"key {k!r} appears twice")
        out[k] = v
    return out


def _token_ids(v: Any, vocab: int | None) -> list[int]:
    """A prompt's token ids: a non-empty flat list of integers in the vocabulary."""
    if not isinstance(v, list) or not v:
        raise ValueError(f"\"prompt_token_ids\" must be a non-empty list of token ids, got {_show(v)}")
    for i, t in enumerate(v):
        if isinstance(t, bool) or not isinstance(t, int):
            raise ValueError(f"\"prompt_token_ids\"[{i}] must be an integer token id, got {_show(t)}")
        if t < 0 or (vocab is not None and t >= vocab):
            raise ValueError(f"\"prompt_token_ids\"[{i}] = {t} is outside the vocabulary "
                             f"[0, {vocab if vocab is not None else 'vocab size'})")
    return v


def _messages(v: Any) -> list[dict[str, Any]]:
    """Chat messages: one conversation, checked as LLM.chat checks it (a role and a text content each)."""
    if not isinstance(v, list) or not v:
        raise ValueError(f"\"messages\" must be a non-empty list of {{\"role\": ..., \"content\": ...}} objects, got "
                         f"{_show(v)}")
    try:
        return conversation(v, '"messages": ')
    except TypeError as e:
        raise ValueError(str(e)) from None


def _show(v: Any) -> str:
    """A JSON value as the user wrote it, cut short."""
    text = json.dumps(v, ensure_ascii=False)
    return text if len(text) <= 60 else text[:57] + "..."


def _parse_line(obj: Any, args: argparse.Namespace, vocab: int | None) -> tuple[Any, Any, dict[str, Any]]:
    """(prompt, messages, sampling keys) of one JSONL object, or a ValueError naming the key that is wrong."""
    if not isinstance(obj, dict):
        raise ValueError(f"expected an object like {EXAMPLE_JSONL}; got {_show(obj)}")
    keys = [k for k in ("prompt", "prompt_token_ids", "messages") if k in obj]
    if len(keys) != 1:
        raise ValueError(f"give exactly one of \"prompt\", \"prompt_token_ids\", \"messages\" (got "
                         f"{', '.join(keys) or 'none'})")
    rest = {k: v for k, v in obj.items() if k != keys[0]}
    value = obj[keys[0]]
    prompt: Any = None
    messages: Any = None
    if keys[0] == "prompt":
        if not isinstance(value, str):
            raise ValueError(f"\"prompt\" must be a string (token ids go in \"prompt_token_ids\"), got {_show(value)}")
        if not value:
            raise ValueError("\"prompt\" is empty")
        prompt = value
    elif keys[0] == "prompt_token_ids":
        prompt = _token_ids(value, vocab)
    else:
        messages = _messages(value)
    _sampling(args, rest)  # checked here, where the line is known, and before the model loads
    return prompt, messages, rest


def _lines(data: bytes, name: str) -> list[tuple[int, str]]:
    """(line number, line) of a file's bytes, or a ValueError naming the first line that is not UTF-8."""
    out = []
    for n, raw in enumerate(data.removeprefix(BOM).splitlines(), 1):
        try:
            out.append((n, raw.decode("utf-8")))
        except UnicodeDecodeError as e:
            raise ValueError(f"{name}:{n}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    return out


def _vocab_size(ecfg: EngineConfig) -> int:
    """The model's vocabulary from its config.json (read, not loaded: --model and --num-layers are checked here), to
    check token ids before the model loads."""
    from moebius.models.registry import model_config
    from moebius.models.source import hf_config_of

    return model_config(hf_config_of(ecfg.model), ecfg.num_layers).vocab_size


def _read_prompts(args: argparse.Namespace, vocab: int | None = None) -> list[Item]:
    """Every request, from the arguments then --input, each checked (ValueError naming the line and the key)."""
    items: list[Item] = []
    for i, p in enumerate(args.prompts):
        if not p:
            raise ValueError(f"prompt argument {i + 1} is empty")
        items.append(Item(len(items), f"prompt argument {i + 1}", p, None, {}))
    if args.input is not None:
        name = "<stdin>" if args.input == "-" else args.input
        lines = [(n, line) for n, line in _lines(_read_input(args.input), name) if line.strip()]
        if not lines:
            raise ValueError(f"--input {name}: no prompts (the file is empty or has only blank lines)")
        for n, line in lines:
            where = f"{name}:{n}"
            try:
                obj = json.loads(line, object_pairs_hook=_no_duplicates)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
            except ValueError as e:
                raise ValueError(f"{where}: {e}") from None
            try:
                prompt, messages, overrides = _parse_line(obj, args, vocab)
            except (ValueError, TypeError) as e:
                raise ValueError(f"{where}: {e}") from None
            items.append(Item(len(items), where, prompt, messages, overrides))
    if not items:
        items = [Item(0, "the demo prompt", DEMO_PROMPT, None, {})]
    return items


def _open_output(name: str | None) -> IO[str]:
    """--output opened for writing (standard output for none or '-'), or a ValueError saying why it cannot be."""
    if name is None or name == "-":
        return sys.stdout
    if os.path.isdir(name):
        raise ValueError(f"--output {name}: is a folder; give a file path")
    folder = os.path.dirname(os.path.abspath(name))
    if not os.path.isdir(folder):
        raise ValueError(f"--output {name}: its folder {folder} does not exist")
    try:
        return open(name, "w", encoding="utf-8")  # noqa: SIM115 - closed by generate
    except OSError as e:
        raise ValueError(f"--output {name}: cannot be written ({e.strerror or e})") from None


def _record(index: int, out: Any) -> str:
    """One result line: the request's input index, its prompt and each sample (with log-probabilities if asked)."""
    samples = []
    for o in out.outputs:
        s: dict[str, Any] = {"text": o.text, "token_ids": o.token_ids, "finish_reason": o.finish_reason}
        if o.error is not None:  # finish_reason "error": why this request failed (the others ran on)
            s["error"] = o.error
        if o.logprobs is not None:  # per output token {token id: log-probability}, its own token first (vLLM's)
            s["logprobs"] = [{str(t): lp for t, lp in step.items()} for step in o.logprobs]
        samples.append(s)
    rec = {"index": index, "prompt": out.prompt, "num_prompt_tokens": out.num_prompt_tokens, "ttft_s": out.ttft,
           "outputs": samples}
    return json.dumps(rec, ensure_ascii=False) + "\n"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def generate(args: argparse.Namespace) -> int:
    _check_flags(args)
    ecfg = EngineConfig.from_cli_args(args)
    items = _read_prompts(args, _vocab_size(ecfg))
    sink = _open_output(args.output)
    if sink is sys.stdout:
        return _generate(args, ecfg, items, sink)
    try:
        code = _generate(args, ecfg, items, sink)
    except BaseException:
        try:
            sink.close()
        except OSError:  # what the buffer still held failed to write: the error on its way out says so
            pass
        raise
    try:
        sink.close()
    except OSError as e:
        raise RunError(f"--output {args.output}: cannot write ({e.strerror or e})") from None
    return code


def _generate(args: argparse.Namespace, ecfg: EngineConfig, items: Sequence[Item], sink: IO[str]) -> int:
    from tqdm import tqdm

    from moebius.entrypoints.llm import LLM

    where = "standard output" if sink is sys.stdout else args.output
    llm = LLM(**dataclasses.asdict(ecfg))
    try:
        requests = _prepare(llm, args, items)  # every request checked before the first is admitted
        start = time.perf_counter()
        index = {llm.add_request(prompt, sp): item.index for item, prompt, sp in requests}
        written = tokens = 0
        bar = tqdm(total=len(index), desc="generate", unit="req", disable=args.no_progress, file=sys.stderr)
        try:
            while llm.has_unfinished():
                try:
                    outs = llm.step()
                except Exception as e:  # a rank died, a stuck step: say so and keep what was written
                    log.debug("the engine failed", exc_info=True)
                    raise RunError(f"the engine failed ({type(e).__name__}: {e}); results written to {where} "
                                   f"before: {written} of {len(index)}") from None
                done = [o for o in outs if o.finished and o.request_id in index]
                for out in sorted(done, key=lambda o: index[o.request_id]):  # those of one step in input order
                    try:
                        sink.write(_record(index[out.request_id], out))
                        sink.flush()
                    except OSError as e:
                        raise RunError(f"--output {where}: cannot write ({e.strerror or e}); results written "
                                         f"before: {written} of {len(index)}") from None
                    written += 1
                    tokens += out.num_output_tokens
                    bar.update(1)
        except KeyboardInterrupt:
            bar.close()
            print(f"moebius: interrupted: {written} of {_plural(len(index), 'request')} finished and were written to "
                  f"{where}; {len(index) - written} did not", file=sys.stderr)
            return 130
        bar.close()
        elapsed = time.perf_counter() - start
    finally:
        llm.close()
    print(f"{_plural(written, 'request')}, {_plural(tokens, 'output token')} in {elapsed:.2f}s "
          f"({tokens / max(elapsed, 1e-9):.1f} tok/s)", file=sys.stderr)
    return 0


def _prepare(llm: Any, args: argparse.Namespace, items: Sequence[Item]
             ) -> list[tuple[Item, str | list[int], SamplingParams]]:
    """(item, prompt, params) of every request, each checked by the engine; a ValueError names the first bad one."""
    tok = llm.tokenizer
    out = []
    for item in items:
        prompt = item.prompt
        try:
            if item.messages is not None or (args.chat and isinstance(prompt, str)):
                messages = item.messages if item.messages is not None else [{"role": "user", "content": prompt}]
                if tok is None:
                    raise ValueError("chat messages need a tokenizer with a chat template (the model directory has "
                                     "no tokenizer.json nor tiktoken.model; pass --tokenizer)")
                prompt = tok.apply_chat_template(messages, add_generation_prompt=True)
            assert prompt is not None
            sp = _sampling(args, item.overrides, RequestOutputKind.FINAL_ONLY)
            llm.engine.validate(prompt, sp)
        except (ValueError, TypeError) as e:
            raise ValueError(f"{item.where}: {e}") from None
        out.append((item, prompt, sp))
    return out


def calibrate(args: argparse.Namespace) -> int:
    from moebius.frontend.core import EngineCore

    if args.context < 1:
        raise ValueError(f"--context must be at least 1 cached token, got {args.context}")
    ecfg = EngineConfig.from_cli_args(args)  # (its --mode is tp or ep)
    with EngineCore(ecfg) as engine:
        cal = engine.calibration(fresh=args.fresh, batches=args.batches, context=args.context)
    print(json.dumps(cal.to_json(), indent=1))
    print(cal.summary(), file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help, --version, or a usage error (its line is printed)
        return e.code if isinstance(e.code, int) else 0
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
    except RunError as e:
        print(f"moebius: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # the engine's ranks are closed by its finalizer
        print("moebius: interrupted", file=sys.stderr)
        return 130
    return 1


if __name__ == "__main__":
    sys.exit(main())
