"""Tokenizer, chat templates, streaming detokenization and the built-in model config."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from moebius.models.builtin import BUILTIN_NOTICE, builtin_hf_config
from moebius.models.registry import model_config
from moebius.tokenizer import (
    BUILTIN_SPECIAL_IDS,
    BUILTIN_VOCAB_SIZE,
    ENDOFTEXT,
    IM_END,
    IM_START,
    IncrementalDetokenizer,
    Tokenizer,
    load_generation_eos,
)

TEXTS = ["", "hello", "héllo wörld 你好 🙂", "  leading\tand\ntrailing  ", "Ünïcödé\u200b\x00\x7f end 🙂🙂",
         "The quick brown fox jumps over the lazy dog."]
CONVERSATION = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"}]
CHATML = "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.builtin()


@pytest.mark.parametrize("text", TEXTS)
def test_builtin_round_trip(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_builtin_random_unicode_round_trip(tok: Tokenizer) -> None:
    rng = random.Random(0)
    for _ in range(50):
        text = "".join(chr(rng.choice([rng.randrange(32, 127), rng.randrange(0xA0, 0xD7FF),
                                       rng.randrange(0x10000, 0x10FFFF)])) for _ in range(rng.randrange(1, 40)))
        assert tok.decode(tok.encode(text)) == text


def test_builtin_vocab_is_deterministic(tok: Tokenizer) -> None:
    again = Tokenizer.builtin()
    assert tok.vocab_size == again.vocab_size <= BUILTIN_VOCAB_SIZE <= 512 and BUILTIN_VOCAB_SIZE % 64 == 0
    assert tok.tokenizer.get_vocab() == again.tokenizer.get_vocab()
    assert all(tok.encode(bytes([b]).decode("latin-1"))[-1] < 256 for b in range(256))
    assert tok.id_to_token(ord("A")) == "A" and tok.id_to_token(ord(" ")) == "Ġ"  # id = byte value
    text = "the quick brown fox"
    assert tok.encode(text) == again.encode(text)
    assert len(tok.encode(text)) < len(text.encode())  # merges were learned


def test_special_tokens(tok: Tokenizer) -> None:
    assert {t: tok.token_to_id(t) for t in (ENDOFTEXT, IM_START, IM_END)} == BUILTIN_SPECIAL_IDS
    assert tok.eos_token_ids == (258, 256)
    assert tok.all_special_ids == (256, 257, 258)
    ids = tok.encode("<|im_start|>user\nhi<|im_end|><|endoftext|>")
    assert ids[0] == 257 and ids[-2:] == [258, 256]
    assert tok.decode(ids) == "user\nhi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|><|endoftext|>"
    assert tok.encode("x", add_special_tokens=True) == tok.encode("x")  # no BOS in the built-in tokenizer


@pytest.mark.parametrize("skip", [True, False])
def test_incremental_detokenizer_random_ids(tok: Tokenizer, skip: bool) -> None:
    rng = random.Random(1)
    for _ in range(300):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 30))]
        prompt = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(0, 8))]
        detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
        pieces = [detok.append(i) for i in ids]
        assert not any(p.endswith("\ufffd") for p in pieces)  # possibly incomplete characters are held back
        pieces.append(detok.finish())
        assert "".join(pieces) == detok.text == tok.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("text", TEXTS[1:])
def test_incremental_detokenizer_multibyte(tok: Tokenizer, text: str) -> None:
    prompt = tok.apply_chat_template([{"role": "user", "content": "say it"}])
    for ids in (tok.encode(text), list(text.encode())):  # merged tokens, and one token per byte
        detok = IncrementalDetokenizer(tok, tok.encode(prompt))
        pieces = [detok.append(i) for i in ids]
        assert "".join(pieces) == text and detok.finish() == ""
        assert not any("\ufffd" in p for p in pieces)  # a split character is only emitted once complete


def test_ids_past_the_vocabulary_stay_out_of_the_window(tok: Tokenizer) -> None:
    """A model's padded embedding rows give ids the tokenizer does not know: they decode to nothing, so they are
    not kept in the window either (it would grow with each, and every token would re-decode all of them)."""
    rng = random.Random(2)
    ids = [rng.randrange(tok.vocab_size, 4 * tok.vocab_size) if rng.random() < 0.9 else rng.randrange(tok.vocab_size)
           for _ in range(400)]
    detok = IncrementalDetokenizer(tok, [1, 2, 3])
    widest = 0
    pieces = []
    for i in ids:
        pieces.append(detok.append(i))
        widest = max(widest, len(detok._ids))
    pieces.append(detok.finish())
    assert "".join(pieces) == detok.text == tok.decode(ids)
    assert widest <= IncrementalDetokenizer.CONTEXT_TOKENS + 8  # the known ids' window only, not the unknown run


def test_incremental_detokenizer_holds_split_character(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok)
    assert [detok.append(b) for b in "a🙂".encode()] == ["a", "", "", "", "🙂"]
    assert [detok.append(i) for i in (BUILTIN_SPECIAL_IDS[IM_END], ord("!"))] == ["", "!"]  # special skipped
    assert detok.text == "a🙂!"
    detok = IncrementalDetokenizer(tok)
    assert detok.append(0xE4) == "" and detok.finish() == "\ufffd"  # output ended mid-character


def test_chat_template(tok: Tokenizer) -> None:
    assert tok.apply_chat_template(CONVERSATION, add_generation_prompt=False) == CHATML
    assert tok.apply_chat_template(CONVERSATION) == CHATML + "<|im_start|>assistant\n"
    ids = tok.encode(tok.apply_chat_template(CONVERSATION))
    assert ids.count(257) == 3 and ids.count(258) == 2


@pytest.mark.parametrize("bad", [[{"role": "user"}], [{"content": "hi"}], ["hi"]])
def test_chat_template_bad_messages(tok: Tokenizer, bad: list) -> None:
    with pytest.raises(ValueError, match="role"):
        tok.apply_chat_template(bad)


def _write_model_dir(path: Path, tokenizer_config: dict, **files: dict) -> Path:
    Tokenizer.builtin().tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    for name, content in files.items():
        (path / f"{name}.json").write_text(json.dumps(content))
    return path


def test_from_dir(tmp_path: Path) -> None:
    template = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}\n{% endfor %}"
                "{% if add_generation_prompt %}[assistant] {% endif %}")
    _write_model_dir(tmp_path, {"chat_template": template, "eos_token": {"content": IM_END, "special": True},
                                "bos_token": None},
                     generation_config={"eos_token_id": [258, 256]}, config={"eos_token_id": 1})
    tok = Tokenizer.from_dir(str(tmp_path))
    assert tok.eos_token == IM_END and tok.eos_token_ids == (258,) and tok.bos_token is None
    assert tok.encode("héllo 🙂") == Tokenizer.builtin().encode("héllo 🙂")
    assert tok.apply_chat_template(CONVERSATION) == "[user] Hi there<|im_end|>\n[assistant] Hello!<|im_end|>\n" \
                                                    "[assistant] "
    assert load_generation_eos(str(tmp_path)) == (258, 256)
    (tmp_path / "generation_config.json").unlink()
    assert load_generation_eos(str(tmp_path)) == (1,)
    (tmp_path / "config.json").unlink()
    assert load_generation_eos(str(tmp_path)) == ()


def test_from_dir_template_sources(tmp_path: Path) -> None:
    named = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "{{ bos_token }}default"}]
    _write_model_dir(tmp_path, {"chat_template": named, "bos_token": ENDOFTEXT},
                     special_tokens_map={"eos_token": {"content": ENDOFTEXT}})
    tok = Tokenizer.from_dir(str(tmp_path))
    assert tok.apply_chat_template(CONVERSATION) == "<|endoftext|>default" and tok.eos_token_ids == (256,)
    (tmp_path / "chat_template.jinja").write_text("{{ messages | length }}{{ messages[0] | tojson }}")
    assert Tokenizer.from_dir(str(tmp_path)).apply_chat_template(CONVERSATION[:1]) == \
        '1{"role": "user", "content": "Hi there"}'


def test_from_dir_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Tokenizer.from_dir(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match=r"has no tokenizer\.json"):
        Tokenizer.from_dir(str(tmp_path))
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"tokenizer\.json"):
        Tokenizer.from_dir(str(tmp_path))
    _write_model_dir(tmp_path, {})
    tok = Tokenizer.from_dir(str(tmp_path))
    assert tok.eos_token_ids == () and tok.decode(tok.encode("ok")) == "ok"
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template(CONVERSATION)
    (tmp_path / "tokenizer_config.json").write_text('{"chat_template": "{{ raise_exception(\'nope\') }}"}')
    with pytest.raises(ValueError, match="nope"):
        Tokenizer.from_dir(str(tmp_path)).apply_chat_template(CONVERSATION)
    (tmp_path / "tokenizer_config.json").write_text("{bad")
    with pytest.raises(ValueError, match=r"tokenizer_config\.json"):
        Tokenizer.from_dir(str(tmp_path))


def test_builtin_model_config() -> None:
    hf = builtin_hf_config()
    cfg = model_config(hf)
    assert cfg.vocab_size == BUILTIN_VOCAB_SIZE >= Tokenizer.builtin().vocab_size
    assert hf["eos_token_id"] == Tokenizer.builtin().token_to_id(IM_END)
    for p in (1, 2, 4):
        assert cfg.num_kv_heads % p == 0 and cfg.num_heads % p == 0 and cfg.num_experts % p == 0
    assert "random weights" in BUILTIN_NOTICE and "--model" in BUILTIN_NOTICE


# ---------------------------------------------------------------------------------------------------------------
# A tiktoken vocabulary (Moonlight's and Kimi K2's TikTokenTokenizer): tiktoken itself is the oracle
# ---------------------------------------------------------------------------------------------------------------

# the pre-tokenizer of Moonshot's tokenization_kimi.py / tokenization_moonshot.py (class intersections, Han runs)
KIMI_PATTERN_PARTS = [
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""", r""" ?[^\s\p{L}\p{N}]+[\r\n]*""", r"""\s*[\r\n]+""", r"""\s+(?!\S)""", r"""\s+""",
]
TIKTOKEN_TEXT = ("The quick brown fox jumps over the lazy dog; THEY'RE here and it's 12345 o'clock.\n\n"
                 "混合专家模型在多个GPU上运行。你好，世界！ Größe naïve café ÄÖÜ Ελληνικά русский 😀🎉\t  x  \r\n"
                 "def main():\n    return {\"a\": [1, 2, 3]}  # comment\n")
TIKTOKEN_SAMPLES = [*TEXTS, TIKTOKEN_TEXT, "你好世界ABCdef", "HELLO's World'S", "e\u0301te\u0301 ١٢٣ ٤٥",
                    "x [BOS]y<|im_end|>\n<|reserved_token_300|>z", "  \n\n  y\t\t", "1234567890"]
# source lines of a tokenizer class as Moonshot's files spell it (the loader parses the file, never runs it)
KIMI_SOURCE = ("import tiktoken\n\n\nclass TikTokenTokenizer:\n    num_reserved_special_tokens = 256\n"
               "    pat_str = \"|\".join(\n        [\n" + "".join(f"            r\"\"\"{p}\"\"\",\n"
                                                          for p in KIMI_PATTERN_PARTS) + "        ]\n    )\n")


def _tiktoken_ranks(vocab_size: int) -> dict[bytes, int]:
    """A byte-level BPE trained on TIKTOKEN_TEXT, its tokens' bytes ranked by id (as a tiktoken file is)."""
    from tokenizers import models, pre_tokenizers, trainers

    from moebius.tokenizer import _bytes_to_unicode

    bpe = __import__("tokenizers").Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.train_from_iterator([TIKTOKEN_TEXT] * 4, trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    byte_of = {c: b for b, c in _bytes_to_unicode().items()}
    by_id = sorted(bpe.get_vocab().items(), key=lambda kv: kv[1])
    return {bytes(byte_of[c] for c in piece): rank for rank, (piece, _) in enumerate(by_id)}


def _write_tiktoken_dir(path: Path, ranks: dict[bytes, int], added: dict[int, str]) -> Path:
    import base64

    (path / "tiktoken.model").write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    (path / "tokenization_kimi.py").write_text(KIMI_SOURCE)
    (path / "tokenizer_config.json").write_text(json.dumps({
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "added_tokens_decoder": {str(i): {"content": c, "special": True} for i, c in added.items()},
        "bos_token": "[BOS]", "eos_token": "[EOS]",
        "chat_template": "{% for m in messages %}<|im_{{ m['role'] }}|>{{ m['content'] }}<|im_end|>{% endfor %}"}))
    return path


def test_a_tiktoken_vocabulary_tokenizes_as_tiktoken(tmp_path: Path) -> None:
    """A model directory with Moonshot's tiktoken.model and tokenizer class (no tokenizer.json) loads: every text,
    Han runs, cased words with contractions, digits in threes, emoji and special-token text included, gives the ids
    tiktoken gives with the class's pat_str, and decodes back; the added tokens keep their ids, the ids between
    them reserved, and [EOS] ends generation."""
    import tiktoken

    ranks = _tiktoken_ranks(1000)
    n = len(ranks)
    added = {n: "[BOS]", n + 1: "[EOS]", n + 2: "<|im_end|>", n + 3: "<|im_user|>", n + 4: "<|im_assistant|>",
             n + 301: "[EOT]"}
    tok = Tokenizer.from_dir(str(_write_tiktoken_dir(tmp_path, ranks, added)))
    specials = {c: i for i, c in added.items()} | {f"<|reserved_token_{i}|>": i for i in range(n, n + 301)
                                                   if i not in added}
    oracle = tiktoken.Encoding("kimi", pat_str="|".join(KIMI_PATTERN_PARTS), mergeable_ranks=ranks,
                               special_tokens=specials)
    rng = random.Random(0)
    pieces = [TIKTOKEN_TEXT[i:i + rng.randint(1, 120)] for i in rng.sample(range(len(TIKTOKEN_TEXT)), 60)]
    for text in [*TIKTOKEN_SAMPLES, *pieces, f"reserved <|reserved_token_{n + 300}|>!"]:
        ids = tok.encode(text)
        assert ids == oracle.encode(text, allowed_special="all"), text
        assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.token_to_id(f"<|reserved_token_{n + 300}|>") == n + 300 and tok.vocab_size == n + 302
    assert tok.eos_token_ids == (n + 1,) and tok.bos_token == "[BOS]"
    assert set(tok.all_special_ids) == set(range(n, n + 302))
    assert tok.decode(tok.encode("a [EOS] b")) == "a  b"  # (specials skipped)
    assert tok.apply_chat_template(CONVERSATION[:1]) == "<|im_user|>Hi there<|im_end|>"


def test_a_model_directory_with_a_tiktoken_vocabulary_serves_text(tmp_path: Path) -> None:
    """The engine takes a checkpoint directory's tiktoken tokenizer as it takes a tokenizer.json: text prompts
    encode to tiktoken's ids and generations decode."""
    from conftest import make_llm

    ranks = _tiktoken_ranks(300)
    n = len(ranks)
    _write_tiktoken_dir(tmp_path, ranks, {n: "[BOS]", n + 1: "[EOS]"})
    (tmp_path / "config.json").write_text(json.dumps(builtin_hf_config()))
    from moebius.sampling_params import SamplingParams

    out = make_llm(str(tmp_path), load_format="dummy").generate("你好, world's end",
                                                                 SamplingParams(max_tokens=4, temperature=0.0))[0]
    assert out.prompt_token_ids == Tokenizer.from_dir(str(tmp_path)).encode("你好, world's end")
    assert len(out.token_ids) == 4 and isinstance(out.outputs[0].text, str)


def test_a_tiktoken_directory_s_errors_name_the_file(tmp_path: Path) -> None:
    ranks = _tiktoken_ranks(300)
    n = len(ranks)
    _write_tiktoken_dir(tmp_path, ranks, {n: "[BOS]", n + 1: "[EOS]"})
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "auto_map": {}}))
    with pytest.raises(ValueError, match=r"names no tokenizer class \(auto_map\.AutoTokenizer\)"):
        Tokenizer.from_dir(str(tmp_path))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "tokenization_kimi.py").unlink()
    with pytest.raises(FileNotFoundError, match=r"not tokenization_kimi\.py"):
        Tokenizer.from_dir(str(tmp_path))
    (tmp_path / "tokenization_kimi.py").write_text("class TikTokenTokenizer:\n    pat_str = make_pattern()\n")
    with pytest.raises(ValueError, match=r"tokenization_kimi\.py spells no pat_str of string literals"):
        Tokenizer.from_dir(str(tmp_path))
    (tmp_path / "tokenization_kimi.py").write_text("class TikTokenTokenizer:\n    pat_str = '[a-'\n")
    with pytest.raises(ValueError, match="not a regex"):
        Tokenizer.from_dir(str(tmp_path))
    (tmp_path / "tokenization_kimi.py").write_text(KIMI_SOURCE)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {**config, "added_tokens_decoder": {"5": {"content": "[BOS]", "special": True}}}))
    with pytest.raises(ValueError, match=f"adds token id 5, inside the {n} tokens"):
        Tokenizer.from_dir(str(tmp_path))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with open(tmp_path / "tiktoken.model", "a") as f:
        f.write("not-base64! 7\n")
    with pytest.raises(ValueError, match=rf"tiktoken\.model line {n + 1}: not a tiktoken entry"):
        Tokenizer.from_dir(str(tmp_path))
    _write_tiktoken_dir(tmp_path, {**ranks, b"\xff\xfe": n + 3}, {})
    with pytest.raises(ValueError, match="are not the ids 0"):
        Tokenizer.from_dir(str(tmp_path))
