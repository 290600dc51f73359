"""Reasoning parsers (vLLM's `--reasoning-parser`): a chat answer's text split into the model's reasoning
(`reasoning_content`) and its answer (`content`), whole or as the text streams in.

- `deepseek_r1`: the reasoning runs up to `</think>`, a `<think>` first or not (DeepSeek-R1's templates open it in the
  prompt); an answer cut short before `</think>` is all reasoning.
- `qwen3`: only text opened by `<think>` (here or at the prompt's end) is reasoning; without it, all is content.
- A prompt that ends in `</think>` (a template with thinking turned off) makes the whole answer content, for both.
- `openai_gptoss`: GPT-OSS's harmony format, its special tokens kept in the text (`keeps_special_tokens`): each
  message `<|channel|>NAME<|message|>TEXT<|end|>` (the last ends in `<|return|>` or `<|call|>`); the analysis
  channel is reasoning, the others (final, commentary preambles) content, the headers neither; a message to a
  function (`to=functions.NAME` in its header) is a tool call, its text the arguments (`take_calls`).

A parser holds back only what could still be the start of a marker, so a stream's pieces join to the whole answer's
split."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import ClassVar

from moebius.entrypoints.openai.parsing import ToolCall, held_from


class ReasoningParser:
    """Splits one answer's text as it arrives: `feed(delta)` -> (reasoning, content) it can place now; `finish()`
    -> what it held back."""

    keeps_special_tokens: ClassVar[bool] = False  # the markers are special tokens: decode them into the text

    def feed(self, text: str) -> tuple[str, str]:
        raise NotImplementedError

    def finish(self) -> tuple[str, str]:
        raise NotImplementedError

    def take_calls(self) -> list[ToolCall]:
        """The tool calls its format carries outside the content (harmony's), complete since the last take."""
        return []


class ThinkTags(ReasoningParser):
    """`<think>` reasoning `</think>` answer. implicit: text before `</think>` is reasoning though no `<think>` opened
    it (DeepSeek-R1); else only an opened one is (Qwen3)."""

    START, END = "<think>", "</think>"

    def __init__(self, prompt: str, implicit: bool) -> None:
        self.implicit = implicit
        tail = prompt.rstrip()  # a template may open the reasoning, or close it (thinking turned off)
        self.state = "reasoning" if tail.endswith(self.START) else "content" if tail.endswith(self.END) else "before"
        self.buf = ""

    def feed(self, text: str) -> tuple[str, str]:
        self.buf += text
        reasoning = content = ""
        if self.state == "before":  # a <think> may open the answer (after white space)
            head = self.buf.lstrip()
            if head.startswith(self.START):
                self.buf, self.state = head[len(self.START):], "reasoning"
            elif self.START.startswith(head):
                return "", ""  # (all white space, or a <think> begun)
            else:
                self.state = "reasoning" if self.implicit else "content"
        if self.state == "reasoning":
            end = self.buf.find(self.END)
            if end < 0:
                keep = held_from(self.buf, (self.END,))
                reasoning, self.buf = self.buf[:keep], self.buf[keep:]
                return reasoning, ""
            reasoning, self.buf, self.state = self.buf[:end], self.buf[end + len(self.END):], "content"
        content, self.buf = self.buf, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        rest, self.buf = self.buf, ""
        return (rest, "") if self.state == "reasoning" or (self.state == "before" and self.implicit) else ("", rest)


class Harmony(ReasoningParser):
    """GPT-OSS's harmony messages, from the text after the prompt's `<|start|>assistant`."""

    keeps_special_tokens = True
    MESSAGE = "<|message|>"
    ENDS = ("<|end|>", "<|return|>", "<|call|>")
    CHANNEL = "<|channel|>"

    RECIPIENT = re.compile(r"to=functions\.([^\s<]+)")

    def __init__(self, prompt: str) -> None:
        self.buf, self.channel = "", None  # channel: None while in a header
        self.seen = False  # a message began
        self.function: str | None = None  # the message is a call to this function
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> tuple[str, str]:
        self.buf += text
        out = {"reasoning": "", "content": ""}
        while True:
            if self.channel is None:
                at = self.buf.find(self.MESSAGE)
                if at < 0:
                    return out["reasoning"], out["content"]
                header, self.buf = self.buf[:at], self.buf[at + len(self.MESSAGE):]
                words = header.split(self.CHANNEL, 1)[1].split("<|", 1)[0].split() if self.CHANNEL in header else []
                self.channel, self.seen = words[0] if words else "", True
                self.function = m.group(1) if (m := self.RECIPIENT.search(header)) else None
            ends = [(i, m) for m in self.ENDS if (i := self.buf.find(m)) >= 0]
            if self.function is not None:  # a call's arguments go out whole, once it ends
                if not ends:
                    return out["reasoning"], out["content"]
                at, marker = min(ends)
                self.calls.append(ToolCall(self.function, self.buf[:at].strip()))
            else:
                side = "reasoning" if self.channel == "analysis" else "content"
                if not ends:
                    keep = held_from(self.buf, self.ENDS)
                    out[side] += self.buf[:keep]
                    self.buf = self.buf[keep:]
                    return out["reasoning"], out["content"]
                at, marker = min(ends)
                out[side] += self.buf[:at]
            self.buf, self.channel = self.buf[at + len(marker):], None

    def finish(self) -> tuple[str, str]:
        """A message cut short keeps its side (a call cut short: content, as it came) and a header cut short is
        dropped; text with no message at all (not harmony) is content as it came."""
        rest, self.buf = self.buf, ""
        if self.channel is None:
            return "", "" if self.seen else rest
        return (rest, "") if self.channel == "analysis" and self.function is None else ("", rest)

    def take_calls(self) -> list[ToolCall]:
        calls, self.calls = self.calls, []
        return calls


PARSERS: dict[str, Callable[[str], ReasoningParser]] = {
    "deepseek_r1": lambda prompt: ThinkTags(prompt, implicit=True),
    "qwen3": lambda prompt: ThinkTags(prompt, implicit=False),
    "openai_gptoss": Harmony,
}


def make_parser(name: str, prompt: str) -> ReasoningParser:
    """The parser `name` for an answer to `prompt` (the rendered chat)."""
    if name not in PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(PARSERS)}")
    return PARSERS[name](prompt)
