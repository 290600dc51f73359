"""What the chat answer parsers share: holding back a marker's beginning, and a tool call."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field


def held_from(text: str, markers: tuple[str, ...]) -> int:
    """Where the longest end of `text` that begins one of `markers` (and is not all of it) starts; len(text): none."""
    for start in range(max(0, len(text) - max(map(len, markers)) + 1), len(text)):
        if any(m.startswith(text[start:]) for m in markers):
            return start
    return len(text)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def json(self, index: int | None = None) -> dict[str, object]:
        """OpenAI's form (a stream's delta carries its `index` among the answer's calls)."""
        out: dict[str, object] = {"id": self.id, "type": "function",
                                  "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}
