"""Chat messages, checked once for every entry point that takes them (`LLM.chat`, `moebius generate`'s JSONL
"messages"): a role and a text content each, the content made one string for the chat template."""

from __future__ import annotations

from typing import Any


def chat_conversations(messages: object) -> list[list[dict[str, Any]]]:
    """chat()'s conversations (from one conversation or a list of them), each message checked (a role, a text
    content: a string or text parts), its content as one string; TypeError / ValueError naming the conversation,
    the message and what is wrong."""
    if not isinstance(messages, list | tuple):
        raise TypeError(f"messages must be a list of message dicts (one conversation) or a list of such lists, got "
                        f"{type(messages).__name__}")
    if not messages:
        raise ValueError("messages is empty: a conversation needs at least one message")
    one = isinstance(messages[0], dict)
    convs = [messages] if one else messages
    out = []
    for c, conv in enumerate(convs):
        where = "" if one else f"conversation {c}: "
        out.append(conversation(conv, where))
    return out


def conversation(conv: object, where: str = "") -> list[dict[str, Any]]:
    """One conversation's messages, checked (`where` starts each error: which conversation or line)."""
    if not isinstance(conv, list | tuple):
        raise TypeError(f"{where}a conversation must be a list of message dicts, got {type(conv).__name__}")
    if not conv:
        raise ValueError(f"{where}a conversation needs at least one message")
    return [_message(m, f"{where}message {i}") for i, m in enumerate(conv)]


def _message(m: object, where: str) -> dict[str, Any]:
    if not isinstance(m, dict):
        raise TypeError(f"{where} must be a dict with 'role' and 'content', got {type(m).__name__}")
    role, content = m.get("role"), m.get("content")
    if role is None:
        raise ValueError(f"{where} has no 'role'")
    if not isinstance(role, str) or not role:
        raise ValueError(f"{where}: role must be a non-empty string, got {role!r}")
    if content is None:
        raise ValueError(f"{where} ({role}): content is {'missing' if 'content' not in m else 'null'}; give a string")
    if isinstance(content, list):  # text parts, as the server takes them
        bad = [p for p in content if not (isinstance(p, dict) and p.get("type") == "text"
                                          and isinstance(p.get("text"), str))]
        if bad:
            raise ValueError(f"{where} ({role}): only text parts ({{'type': 'text', 'text': ...}}) are supported, "
                             f"got {bad[0]!r}")
        content = "\n".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise TypeError(f"{where} ({role}): content must be a string (or a list of text parts), got "
                        f"{type(content).__name__} {content!r}")
    return {**m, "content": content}
