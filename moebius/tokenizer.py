"""Tokenization: a thin wrapper over the fast `tokenizers` library, chat templates, and streaming detokenization.

`Tokenizer.from_dir` loads a Hugging Face model directory (tokenizer.json + tokenizer_config.json, or a tiktoken
vocabulary as Moonlight and Kimi K2 ship it); `Tokenizer.builtin` builds the small byte-level BPE tokenizer of the
built-in model in code (no files, offline).
"""

from __future__ import annotations

import ast
import base64
import json
import os
from collections import Counter
from collections.abc import Sequence
from datetime import datetime
from functools import cache, cached_property
from typing import Any

import jinja2
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers

# The vocabulary file of a tiktoken tokenizer (Moonlight's and Kimi K2's TikTokenTokenizer), beside tokenizer.json's
# place in a model directory
TIKTOKEN_FILE = "tiktoken.model"

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
# Ids 0..255 are the byte tokens, then the specials, then the merges trained by _builtin_vocab().
BUILTIN_SPECIAL_IDS: dict[str, int] = {ENDOFTEXT: 256, IM_START: 257, IM_END: 258}
BUILTIN_VOCAB_SIZE = 384  # embedding rows of the built-in model (a multiple of 64); the vocab fills it up to this

BUILTIN_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Merges of the built-in tokenizer are trained on this text, so common English words get short encodings.
_TRAIN_TEXT = """\
The quick brown fox jumps over the lazy dog. Once upon a time, there was a little girl who lived in a village
near the forest. Whenever she went out, the little girl wore a red riding cloak, so everyone in the village called
her Little Red Riding Hood. You are a helpful assistant. The user asks a question and the assistant answers it
with care. What is the capital of France? The capital of France is Paris. How are you today? I am fine, thank you.
This is a test of the serving engine: it runs a mixture of experts model on one or more devices, and it can switch
between tensor parallelism and expert parallelism while requests are running. Tokens are generated one at a time,
and each token is the most likely next word or piece of a word given the text that came before it. Hello, world!
def main():
    print("hello world")
    return 0
for i in range(10):
    if i % 2 == 0:
        print(i)
"""


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (what the ByteLevel pre-tokenizer emits)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    for b in range(256):  # the rest (controls, space, ...) move past U+00FF, in byte order
        chars.setdefault(b, chr(256 + len(chars) - len(printable)))
    return chars


@cache
def _builtin_vocab() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Byte tokens (id = byte value) + specials + BPE merges trained greedily on _TRAIN_TEXT (deterministic)."""
    byte_chars = _bytes_to_unicode()
    vocab = {byte_chars[b]: b for b in range(256)} | BUILTIN_SPECIAL_IDS
    pieces = pre_tokenizers.ByteLevel(add_prefix_space=False).pre_tokenize_str(_TRAIN_TEXT)
    words = Counter(tuple(piece) for piece, _ in pieces)
    merges: list[tuple[str, str]] = []
    while len(vocab) < BUILTIN_VOCAB_SIZE:
        pairs: Counter[tuple[str, str]] = Counter()
        for word, n in words.items():
            for pair in zip(word, word[1:], strict=False):
                pairs[pair] += n
        # Most frequent pair; ties go to the lexicographically smallest, so the ids never change between runs.
        best = min(pairs, key=lambda p: (-pairs[p], p), default=None)
        if best is None or pairs[best] < 2:
            break
        merges.append(best)
        merged = best[0] + best[1]
        vocab.setdefault(merged, len(vocab))
        words = Counter({_merge(word, best, merged): n for word, n in words.items()})
    return vocab, merges


def _merge(word: tuple[str, ...], pair: tuple[str, str], merged: str) -> tuple[str, ...]:
    out, i = [], 0
    while i < len(word):
        if word[i:i + 2] == pair:
            out.append(merged)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return tuple(out)


def _read_json(path: str) -> dict[str, Any] | None:
    """A JSON file's dict, None when the file does not exist, ValueError naming the file when it is malformed."""
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"malformed JSON in {path}: {e}") from e


def _token_content(value: Any) -> str | None:
    """Special tokens are written as plain strings or as AddedToken dicts ({"content": ...})."""
    return value.get("content") if isinstance(value, dict) else value


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # Same signature as transformers' filter: templates format tool schemas with it.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@cache
def _jinja_env() -> ImmutableSandboxedEnvironment:
    """The environment transformers renders chat templates in (sandboxed; templates come with downloaded models)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def has_tokenizer(path: str) -> bool:
    """Whether a model directory holds a tokenizer `Tokenizer.from_dir` reads (tokenizer.json or a tiktoken file)."""
    return any(os.path.isfile(os.path.join(path, f)) for f in ("tokenizer.json", TIKTOKEN_FILE))


def _tiktoken_ranks(file: str) -> dict[bytes, int]:
    """A tiktoken vocabulary: a line a token, its bytes in base64 then its rank (its id, 0 .. n-1)."""
    ranks: dict[bytes, int] = {}
    with open(file, encoding="ascii") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                token, rank = line.split()
                ranks[base64.b64decode(token, validate=True)] = int(rank)
            except ValueError as e:  # (binascii.Error is one)
                raise ValueError(f"{file} line {n}: not a tiktoken entry (base64 token, space, rank): {e}") from e
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{file}: the ranks of its {len(ranks)} tokens are not the ids 0 .. {len(ranks) - 1}, each "
                         "once")
    return ranks


def _literal_str(node: ast.expr) -> str | None:
    """The string a source expression of literals spells (a constant, `+` of them, `sep.join([...])`), else None."""
    if isinstance(node, ast.Constant):
        return node.value if isinstance(node.value, str) else None
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _literal_str(node.left), _literal_str(node.right)
        return None if left is None or right is None else left + right
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "join"
            and len(node.args) == 1 and not node.keywords and isinstance(node.args[0], ast.List | ast.Tuple)):
        sep, parts = _literal_str(node.func.value), [_literal_str(e) for e in node.args[0].elts]
        return None if sep is None or None in parts else sep.join(parts)  # type: ignore[arg-type]
    return None


def _tiktoken_pattern(path: str, config: dict[str, Any]) -> str:
    """The pre-tokenizer regex of a tiktoken tokenizer: the `pat_str` its tokenizer class (tokenizer_config.json's
    auto_map, a tokenization_*.py beside the vocabulary) spells in literals. The source is parsed, never run."""
    ref = (config.get("auto_map") or {}).get("AutoTokenizer")
    ref = next((r for r in ref if r), None) if isinstance(ref, list) else ref
    if not isinstance(ref, str) or "." not in ref:
        raise ValueError(f"{path!r} holds a {TIKTOKEN_FILE} but its tokenizer_config.json names no tokenizer class "
                         "(auto_map.AutoTokenizer), whose pat_str is the pre-tokenizer the vocabulary needs; pass "
                         "--tokenizer DIR with a tokenizer.json")
    module, cls = ref.split("--")[-1].rsplit(".", 1)
    source = os.path.join(path, module.replace(".", os.sep) + ".py")
    if not os.path.isfile(source):
        raise FileNotFoundError(f"{path!r} holds a {TIKTOKEN_FILE} but not {os.path.basename(source)}, the file of "
                                f"its tokenizer class {ref} (auto_map), whose pat_str is the pre-tokenizer the "
                                "vocabulary needs")
    with open(source, encoding="utf-8") as f:
        tree = ast.parse(f.read(), source)
    scopes = [n.body for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls] + [tree.body]
    for body in scopes:  # the class's own pat_str first, then the module's
        for stmt in body:
            if isinstance(stmt, ast.Assign):
                targets, value = stmt.targets, stmt.value
            elif isinstance(stmt, ast.AnnAssign) and stmt.value is not None:
                targets, value = [stmt.target], stmt.value
            else:
                continue
            if any(isinstance(t, ast.Name) and t.id in ("pat_str", "PAT_STR") for t in targets):
                pattern = _literal_str(value)
                if pattern is not None:
                    return pattern
    raise ValueError(f"{source} spells no pat_str of string literals (in class {cls} or the module): the "
                     f"pre-tokenizer its {TIKTOKEN_FILE} needs; pass --tokenizer DIR with a tokenizer.json")


def _from_tiktoken(path: str, config: dict[str, Any]) -> tokenizers.Tokenizer:
    """A tiktoken tokenizer (Moonlight's and Kimi K2's TikTokenTokenizer) as the same byte-level BPE in `tokenizers`:
    each token's bytes, the merges a token's ranks imply (a split of it into two tokens, ranked by what they make),
    whole pieces taken first as tiktoken does (ignore_merges); the class's pat_str splits the text; the added
    tokens of tokenizer_config.json at their ids, the ids between them reserved (`<|reserved_token_{id}|>`, as
    TikTokenTokenizer names them)."""
    file = os.path.join(path, TIKTOKEN_FILE)
    ranks = _tiktoken_ranks(file)
    pattern = _tiktoken_pattern(path, config)
    chars = _bytes_to_unicode()
    text = {t: "".join(chars[b] for b in t) for t in ranks}
    merges = sorted((r, ranks[t[:k]], ranks[t[k:]]) for t, r in ranks.items() for k in range(1, len(t))
                    if t[:k] in ranks and t[k:] in ranks)
    by_rank = {r: t for t, r in ranks.items()}
    tok = tokenizers.Tokenizer(models.BPE({text[t]: r for t, r in ranks.items()},
                                          [(text[by_rank[a]], text[by_rank[b]]) for _, a, b in merges],
                                          ignore_merges=True))
    try:
        split = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
    except Exception as e:  # the Rust side raises a bare Exception
        raise ValueError(f"the pat_str of {path!r}'s tokenizer class is not a regex Oniguruma reads: {e}") from e
    tok.pre_tokenizer = pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                  use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    added = {int(i): t for i, t in (config.get("added_tokens_decoder") or {}).items()}
    if added and min(added) < len(ranks):
        raise ValueError(f"{path!r}: tokenizer_config.json adds token id {min(added)}, inside the {len(ranks)} "
                         f"tokens of its {TIKTOKEN_FILE}")
    for i in range(len(ranks), max(added, default=len(ranks) - 1) + 1):  # (each takes the next id)
        t = added.get(i) or {"content": f"<|reserved_token_{i}|>", "special": True}
        token = AddedToken(t["content"], special=t.get("special", True), normalized=False)
        if token.special:
            tok.add_special_tokens([token])
        else:
            tok.add_tokens([token])
        if tok.token_to_id(t["content"]) != i:
            raise ValueError(f"{path!r}: added token {t['content']!r} (id {i}) is already token "
                             f"{tok.token_to_id(t['content'])}")
    return tok


class Tokenizer:
    """Text <-> token ids, special tokens and the chat template of one model."""

    def __init__(self, tokenizer: tokenizers.Tokenizer, *, chat_template: str | None = None,
                 bos_token: str | None = None, eos_token: str | None = None, pad_token: str | None = None,
                 extra_eos_tokens: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.bos_token, self.eos_token, self.pad_token = bos_token, eos_token, pad_token
        eos_ids = (self.token_to_id(t) for t in (eos_token, *extra_eos_tokens) if t is not None)
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(i for i in eos_ids if i is not None))
        added = tokenizer.get_added_tokens_decoder()
        self.all_special_ids: tuple[int, ...] = tuple(sorted(i for i, t in added.items() if t.special))

    @classmethod
    def from_dir(cls, path: str) -> Tokenizer:
        """Load the tokenizer (tokenizer.json, else a tiktoken vocabulary), the chat template and the special tokens
        of a local Hugging Face model directory."""
        if not os.path.isdir(path):
            raise FileNotFoundError(f"tokenizer directory {path!r} does not exist")
        config = _read_json(os.path.join(path, "tokenizer_config.json")) or {}
        tok_file = os.path.join(path, "tokenizer.json")
        if os.path.isfile(tok_file):
            try:
                tok = tokenizers.Tokenizer.from_file(tok_file)
            except Exception as e:  # the Rust side raises a bare Exception
                raise ValueError(f"cannot load {tok_file}: {e}") from e
        elif os.path.isfile(os.path.join(path, TIKTOKEN_FILE)):
            tok = _from_tiktoken(path, config)
        else:
            raise FileNotFoundError(f"{path!r} has no tokenizer.json (Moebius needs the fast tokenizer file of a "
                                    f"Hugging Face model, or a {TIKTOKEN_FILE}; pass --tokenizer DIR to use another "
                                    "directory)")
        special_map = _read_json(os.path.join(path, "special_tokens_map.json")) or {}
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            template = {t.get("name"): t.get("template") for t in template}.get("default")
        jinja_file = os.path.join(path, "chat_template.jinja")  # newer transformers save the template here
        if os.path.isfile(jinja_file):
            with open(jinja_file, encoding="utf-8") as f:
                template = f.read()
        specials = {name: _token_content(config.get(name) or special_map.get(name))
                    for name in ("bos_token", "eos_token", "pad_token")}
        return cls(tok, chat_template=template, **specials)

    @classmethod
    def builtin(cls) -> Tokenizer:
        """The byte-level BPE tokenizer of the built-in model: any text round-trips, ids are the same every run."""
        vocab, merges = _builtin_vocab()
        tok = tokenizers.Tokenizer(models.BPE(vocab=dict(vocab), merges=list(merges)))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens(list(BUILTIN_SPECIAL_IDS))  # already in the vocab, so they keep ids 256..258
        return cls(tok, chat_template=BUILTIN_CHAT_TEMPLATE, bos_token=None, eos_token=IM_END,
                   pad_token=ENDOFTEXT, extra_eos_tokens=(ENDOFTEXT,))

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Special-token text such as "<|im_start|>" always maps to its id; add_special_tokens adds e.g. a BOS."""
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self.tokenizer.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self.tokenizer.token_to_id(token)

    @cached_property
    def _template(self) -> jinja2.Template:
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template (no chat_template in tokenizer_config.json nor a "
                             "chat_template.jinja file); send plain prompts (completions) instead of chat messages")
        try:
            return _jinja_env().from_string(self.chat_template)
        except jinja2.TemplateError as e:
            raise ValueError(f"invalid chat template: {e}") from e

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                            **template_kwargs: Any) -> str:
        """Render messages to prompt text; extra keyword arguments (e.g. enable_thinking) go to the template."""
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
                raise ValueError(f"message {i} must be a dict with 'role' and 'content', got {m!r}")
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token or "", eos_token=self.eos_token or "",
                                         **template_kwargs)
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template failed: {e}") from e


class IncrementalDetokenizer:
    """Turns generated ids into text as they arrive, never emitting half of a multi-byte character.

    The prefix_offset/read_offset technique with the window trimmed to start at prefix_offset: `_ids` holds the
    ids last emitted (left context, so e.g. SentencePiece keeps leading spaces) followed by those not yet emitted
    (from `_read_offset` on). Each step decodes only this short window and emits what it adds to the context's text,
    unless it ends in U+FFFD (an incomplete UTF-8 sequence), which is held back until completed or `finish()`.
    """

    CONTEXT_TOKENS = 5  # prompt tokens used as left context

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        context = list(prompt_ids[-self.CONTEXT_TOKENS:])
        if self._decode(context).endswith("\ufffd"):  # context ending mid-character would garble the output
            context = []
        self._ids, self._read_offset = context, len(context)
        self.text = ""
        # ids past the tokenizer's vocabulary (a model's padded embedding rows) decode to nothing wherever they are:
        # kept out of the window, which would otherwise grow with each (every token re-decoding all of them)
        self._vocab_size = tokenizer.vocab_size

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def append(self, token_id: int) -> str:
        """Add one generated id; return the text it completes ("" while a character is still incomplete)."""
        if token_id >= self._vocab_size:
            return ""
        self._ids.append(token_id)
        new_text = self._decode(self._ids)
        return "" if new_text.endswith("\ufffd") else self._emit(new_text)

    def finish(self) -> str:
        """Text still held back at the end of the output (an incomplete or invalid trailing byte sequence)."""
        return self._emit(self._decode(self._ids))

    def _emit(self, new_text: str) -> str:
        prefix_text = self._decode(self._ids[:self._read_offset])
        if len(new_text) <= len(prefix_text):  # e.g. a skipped special token: nothing new, keep the window
            return ""
        delta = new_text[len(prefix_text):]
        self._ids = self._ids[self._read_offset:]  # what was just emitted becomes the next context
        self._read_offset = len(self._ids)
        self.text += delta
        return delta


def load_generation_eos(model_dir: str) -> tuple[int, ...]:
    """eos_token_id (an int or a list) of generation_config.json, else of config.json; () when neither has one."""
    for name in ("generation_config.json", "config.json"):
        eos = (_read_json(os.path.join(model_dir, name)) or {}).get("eos_token_id")
        if eos is not None:
            return tuple(eos) if isinstance(eos, list) else (int(eos),)
    return ()
