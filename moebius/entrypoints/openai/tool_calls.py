"""Tool-call parsers (vLLM's `--tool-call-parser`): the function calls in a chat answer's text, as OpenAI's
`tool_calls`, whole or as the text streams in.

- `hermes` (Qwen3, Qwen2.5, Hermes): each call is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.
- `openai` (GPT-OSS): its calls are harmony messages to `functions.NAME`, which the openai_gptoss reasoning parser
  reads (reasoning.Harmony); the content has none left.

Text outside the calls stays content; a block that is not a call (not JSON naming a function) or is cut short stays
content as it came, so nothing the model wrote is lost. A parser holds back only what could still begin a call, so
a stream's pieces join to the whole answer's."""

from __future__ import annotations

import json
from collections.abc import Callable

from moebius.entrypoints.openai.parsing import ToolCall, held_from


class ToolCallParser:
    """Splits one answer's content as it arrives: `feed(text)` -> (content, calls) it can place now; `finish()` ->
    what it held back."""

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        raise NotImplementedError

    def finish(self) -> tuple[str, list[ToolCall]]:
        raise NotImplementedError


class Hermes(ToolCallParser):
    START, END = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        self.buf, self.inside = "", False

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self.buf += text
        content, calls = "", []
        while True:
            if not self.inside:
                at = self.buf.find(self.START)
                if at < 0:
                    keep = held_from(self.buf, (self.START,))
                    content, self.buf = content + self.buf[:keep], self.buf[keep:]
                    return content, calls
                content, self.buf, self.inside = content + self.buf[:at], self.buf[at + len(self.START):], True
            at = self.buf.find(self.END)
            if at < 0:
                return content, calls
            body, self.buf, self.inside = self.buf[:at], self.buf[at + len(self.END):], False
            call = _call_of(body)
            if call is None:  # not a call: the text as it came
                content += self.START + body + self.END
            else:
                calls.append(call)

    def finish(self) -> tuple[str, list[ToolCall]]:
        rest = (self.START if self.inside else "") + self.buf
        self.buf, self.inside = "", False
        return rest, []


def _call_of(body: str) -> ToolCall | None:
    """A call's JSON ({"name": str, "arguments": object or JSON text}), or None where the body is not one."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


class InMessages(ToolCallParser):
    """A format whose calls the reasoning parser takes out (harmony's): the content is left as it is."""

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        return text, []

    def finish(self) -> tuple[str, list[ToolCall]]:
        return "", []


PARSERS: dict[str, Callable[[], ToolCallParser]] = {"hermes": Hermes, "openai": InMessages}
# the reasoning parser a tool-call format needs (its calls are in the messages that parser reads)
NEEDS_REASONING = {"openai": "openai_gptoss"}
