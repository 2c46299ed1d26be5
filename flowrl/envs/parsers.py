"""Tool-call formats: how a model writes a tool call in its turn, parsed from the decoded text.

``TOOL_CALL_FORMATS`` maps a format name (``params.tool_call_format``) to a parser
``fn(text) -> list[ParsedCall]``. Built in:

- ``hermes``: ``<tool_call>{"name": "...", "arguments": {...}}</tool_call>``, one block per call
  (any number per turn); the format of Hermes-2/3, Qwen2.5/Qwen3 and the chat templates that
  follow them (their ``tools=`` system prompt asks for it, and ``flowrl/data/chat.py`` writes the
  same instructions for templates without tool support). ``arguments`` may also be a JSON string
  holding the object (some models write it so).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Optional


@dataclass
class ParsedCall:
    """One tool call found in a turn. ``error`` is set (and name/arguments may be empty) when the
    block was there but could not be read; the policy is then told why."""

    name: str = ""
    arguments: dict[str, Any] = field(default_factory=dict)
    error: Optional[str] = None


_HERMES = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)


def parse_hermes(text: str) -> list[ParsedCall]:
    """Every ``<tool_call>...</tool_call>`` block of ``text``, in order (an unclosed last block
    is read to the end of the text). A block whose content is not a JSON object with a string
    ``name`` and an object ``arguments`` gives a ParsedCall with ``error`` set."""
    calls = []
    for m in _HERMES.finditer(text):
        body = m.group(1).strip()
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            calls.append(ParsedCall(error=f"the tool call is not valid JSON ({e.msg} at char "
                                          f"{e.pos}): {body[:200]!r}"))
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            calls.append(ParsedCall(error='a tool call must be a JSON object {"name": ..., '
                                          f'"arguments": {{...}}}}, got {body[:200]!r}'))
            continue
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):  # arguments written as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass
        if not isinstance(args, dict):
            calls.append(ParsedCall(name=obj["name"], error=f"tool call '{obj['name']}': "
                                    f"arguments must be a JSON object, got {args!r}"[:300]))
            continue
        calls.append(ParsedCall(name=obj["name"], arguments=args))
    return calls


TOOL_CALL_FORMATS: dict[str, Callable[[str], list[ParsedCall]]] = {"hermes": parse_hermes}
