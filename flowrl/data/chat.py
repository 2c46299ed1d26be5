"""Chat-template rendering for multi-turn rollouts: tools in the prompt, observations as tokens.

Prompts with tools: :func:`apply_chat_template_with_tools` passes the tools' JSON schemas to
``tokenizer.apply_chat_template(..., tools=schemas)`` when the template reads ``tools`` (Qwen2.5,
Qwen3, Hermes, Llama 3.1, ...). A template that does not (SmolLM2's) would drop them silently, so
the same Hermes-style instructions those templates render (the schemas inside ``<tools></tools>``
and the ``<tool_call>{json}</tool_call>`` reply format, :data:`HERMES_TOOL_PROMPT`) are put into
the system message instead.

Observations: :class:`ObservationRenderer` turns an environment's messages into the token ids
that follow the policy's turn: the chat template renders a fixed conversation with and without
the new messages, and the text between the end of the last assistant turn (its EOS) and the next
generation prefix is tokenised *alone*. The trajectory so far is never re-rendered or
re-tokenised, so the ids the policy sampled stay the ids the trainer scores.
"""
from __future__ import annotations

import json
from typing import Any, Sequence

HERMES_TOOL_PROMPT = (
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    "{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>')

# a fixed exchange the observation delta is cut from (never shown to the policy)
_BASE = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]


def template_reads_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template uses a ``tools`` variable."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):  # named templates
        template = " ".join(template.values())
    return "tools" in template


def with_tool_system_prompt(messages: Sequence[dict], tools: Sequence[dict]) -> list[dict]:
    """``messages`` with :data:`HERMES_TOOL_PROMPT` (the schemas filled in) appended to the
    system message, or as a new first system message."""
    text = HERMES_TOOL_PROMPT.format(tools="\n".join(json.dumps(t) for t in tools))
    out = [dict(m) for m in messages]
    if out and out[0].get("role") == "system":
        out[0]["content"] = f"{out[0]['content']}\n\n{text}"
    else:
        out.insert(0, {"role": "system", "content": text})
    return out


def apply_chat_template_with_tools(tokenizer: Any, messages: Sequence[dict], tools: Sequence[dict],
                                   add_generation_prompt: bool = True) -> str:
    """The prompt text of ``messages`` offering ``tools`` (JSON schemas; empty = none)."""
    if not tools:
        return tokenizer.apply_chat_template(list(messages), tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    if template_reads_tools(tokenizer):
        return tokenizer.apply_chat_template(list(messages), tools=list(tools), tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    return tokenizer.apply_chat_template(with_tool_system_prompt(messages, tools), tokenize=False,
                                         add_generation_prompt=add_generation_prompt)


class ObservationRenderer:
    """Token ids of observation messages, to append after a policy turn that ended with EOS.

    Args:
        tokenizer: a tokenizer with a chat template and an ``eos_token``.

    Raises:
        ValueError: the template renders no EOS after an assistant message, or renders the base
            exchange differently once messages follow (the delta would not be a continuation).
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        eos = tokenizer.eos_token
        base = tokenizer.apply_chat_template(_BASE, tokenize=False)
        cut = base.rfind(eos) if eos else -1
        if cut < 0:
            raise ValueError(f"the chat template renders no EOS ({eos!r}) after an assistant "
                             "message; multi-turn observations cannot be appended")
        self._prefix = base[:cut + len(eos)]
        self._cache: dict[str, list[int]] = {}

    def text(self, messages: Sequence[dict]) -> str:
        """The observation text: from after the assistant turn's EOS up to the next generation
        prefix (SmolLM2: ``"\\n<|im_start|>tool\\n...<|im_end|>\\n<|im_start|>assistant\\n"``)."""
        full = self.tokenizer.apply_chat_template(_BASE + [dict(m) for m in messages],
                                                  tokenize=False, add_generation_prompt=True)
        if not full.startswith(self._prefix):
            raise ValueError("the chat template renders earlier turns differently once more "
                             "messages follow; observations cannot be appended token by token")
        return full[len(self._prefix):]

    def render(self, messages: Sequence[dict]) -> list[int]:
        """Token ids of :meth:`text`, tokenised alone (no special tokens added)."""
        text = self.text(messages)
        if text not in self._cache:
            if len(self._cache) > 4096:
                self._cache.clear()
            self._cache[text] = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        return list(self._cache[text])
