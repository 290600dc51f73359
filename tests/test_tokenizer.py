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
