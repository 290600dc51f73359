"""Tool-call parsers (vLLM's `--tool-call-parser`): the function calls in a chat answer's text, as OpenAI's
`tool_calls`, whole or as the text streams in.

- `hermes` (Qwen3, Qwen2.5, Hermes): each call is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.
- `deepseek_v3` (DeepSeek-V3 / R1; `deepseek_v31` the same parser): calls between `<｜tool▁calls▁begin｜>` and
  `<｜tool▁calls▁end｜>`, each `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME` then its arguments in a ```json
  fence (V3), or `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGUMENTS` (V3.1), closed by `<｜tool▁call▁end｜>`.
- `kimi_k2` (Kimi K2): calls between `<|tool_calls_section_begin|>` and
  `<|tool_calls_section_end|>`, each `<|tool_call_begin|>functions.NAME:INDEX<|tool_call_argument_begin|>ARGUMENTS
  <|tool_call_end|>`; the call's id is `functions.NAME:INDEX`, as the model numbers them.
- `glm45` (GLM-4.5 / 4.6): `<tool_call>NAME` then each argument as `<arg_key>KEY</arg_key><arg_value>VALUE
  </arg_value>`, `</tool_call>`; a value stays text where the tool's schema says string, else is read as JSON where
  it is JSON (as vLLM's).
- `openai` (GPT-OSS): its calls are harmony messages to `functions.NAME`, which the openai_gptoss reasoning parser
  reads (reasoning.Harmony); the content has none left.

The DeepSeek, Kimi and GLM markers are special tokens: a request with tools is decoded with them
(`keeps_special_tokens`). Text outside the calls stays content (a section's markers dropped); a block that is not a
call (its arguments not a JSON object, no name) or is cut short stays content as it came, so nothing the model wrote
is lost. A parser holds back only what could still begin a marker, so a stream's pieces join to the whole
answer's."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any, ClassVar

from moebius.entrypoints.openai.parsing import ToolCall, held_from


class ToolCallParser:
    """Splits one answer's content as it arrives: `feed(text)` -> (content, calls) it can place now; `finish()` ->
    what it held back. Made for one answer to a request with `tools` (OpenAI's tool dicts)."""

    keeps_special_tokens: ClassVar[bool] = False  # its markers are special tokens: decode them into the text

    def __init__(self, tools: Sequence[dict[str, Any]] = ()) -> None:
        self.tools = tools

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        raise NotImplementedError

    def finish(self) -> tuple[str, list[ToolCall]]:
        raise NotImplementedError


class Delimited(ToolCallParser):
    """Calls each between START and END, its body read by `call_of` (None: not a call, kept as the text it was);
    SECTION markers, around a run of calls, dropped from the content."""

    START: ClassVar[str]
    END: ClassVar[str]
    SECTION: ClassVar[tuple[str, ...]] = ()

    def __init__(self, tools: Sequence[dict[str, Any]] = ()) -> None:
        super().__init__(tools)
        self.buf, self.inside = "", False

    def call_of(self, body: str) -> ToolCall | None:
        raise NotImplementedError

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self.buf += text
        content, calls = "", []
        while True:
            if not self.inside:
                found = [(at, m) for m in (self.START, *self.SECTION) if (at := self.buf.find(m)) >= 0]
                if not found:
                    keep = held_from(self.buf, (self.START, *self.SECTION))
                    content, self.buf = content + self.buf[:keep], self.buf[keep:]
                    return content, calls
                at, marker = min(found)
                content, self.buf = content + self.buf[:at], self.buf[at + len(marker):]
                self.inside = marker == self.START
                continue
            at = self.buf.find(self.END)
            if at < 0:
                return content, calls
            body, self.buf, self.inside = self.buf[:at], self.buf[at + len(self.END):], False
            call = self.call_of(body)
            if call is None:  # not a call: the text as it came
                content += self.START + body + self.END
            else:
                calls.append(call)

    def finish(self) -> tuple[str, list[ToolCall]]:
        rest = (self.START if self.inside else "") + self.buf
        self.buf, self.inside = "", False
        return rest, []


class Hermes(Delimited):
    START, END = "<tool_call>", "</tool_call>"

    def call_of(self, body: str) -> ToolCall | None:
        """A call's JSON ({"name": str, "arguments": object or JSON text}), or None where the body is not one."""
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


def _arguments(text: str) -> str | None:
    """Arguments written as JSON (in a ```json fence or not) as OpenAI's JSON text; None where not an object."""
    text = text.strip()
    if text.startswith("```"):
        first, _, rest = text.partition("\n")
        text = (rest if first.strip() in ("```", "```json") else text).removesuffix("```").strip()
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    return json.dumps(obj, ensure_ascii=False) if isinstance(obj, dict) else None


class DeepSeekV3(Delimited):
    START, END = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"
    SECTION = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")
    SEP = "<｜tool▁sep｜>"
    keeps_special_tokens = True

    def call_of(self, body: str) -> ToolCall | None:
        head, sep, rest = body.partition(self.SEP)
        if not sep:
            return None
        if head.strip() == "function":  # V3: the type, then the name on the separator's line, then the fence
            name, _, args = rest.partition("\n")
        else:  # V3.1: the name, then the arguments
            name, args = head, rest
        arguments = _arguments(args)
        return None if arguments is None or not name.strip() else ToolCall(name.strip(), arguments)


class KimiK2(Delimited):
    START, END = "<|tool_call_begin|>", "<|tool_call_end|>"
    SECTION = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>")
    ARGS = "<|tool_call_argument_begin|>"
    keeps_special_tokens = True

    def call_of(self, body: str) -> ToolCall | None:
        call_id, sep, args = body.partition(self.ARGS)
        call_id = call_id.strip()
        name = call_id.removeprefix("functions.").rpartition(":")[0] or call_id.removeprefix("functions.")
        arguments = _arguments(args)
        return None if not sep or arguments is None or not name else ToolCall(name, arguments, call_id)


class Glm45(Delimited):
    START, END = "<tool_call>", "</tool_call>"
    ARG = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)
    keeps_special_tokens = True

    def call_of(self, body: str) -> ToolCall | None:
        name, at, rest = body.partition("<arg_key>")
        name = name.strip()
        if not name or any(c in name for c in "{}<>\n"):
            return None
        args, pos, rest = {}, 0, at + rest
        while pos < len(rest.rstrip()) and (m := self.ARG.match(rest, pos)):
            args[m.group(1).strip()], pos = self._value(name, m.group(1).strip(), m.group(2)), m.end()
        if rest[pos:].strip():  # something that is not an argument: not a call
            return None
        return ToolCall(name, json.dumps(args, ensure_ascii=False))

    def _value(self, name: str, key: str, text: str) -> Any:
        """The argument's text as the tool's schema types it: a string stays text, anything else is read as JSON
        where it is JSON."""
        for tool in self.tools:
            fn = tool.get("function", {})
            if fn.get("name") == name:
                if fn.get("parameters", {}).get("properties", {}).get(key, {}).get("type") == "string":
                    return text
                break
        try:
            return json.loads(text)
        except ValueError:
            return text


class InMessages(ToolCallParser):
    """A format whose calls the reasoning parser takes out (harmony's): the content is left as it is."""

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        return text, []

    def finish(self) -> tuple[str, list[ToolCall]]:
        return "", []


PARSERS: dict[str, type[ToolCallParser]] = {"hermes": Hermes, "deepseek_v3": DeepSeekV3, "deepseek_v31": DeepSeekV3,
                                            "kimi_k2": KimiK2, "glm45": Glm45, "openai": InMessages}
# the reasoning parser a tool-call format needs (its calls are in the messages that parser reads)
NEEDS_REASONING = {"openai": "openai_gptoss"}
