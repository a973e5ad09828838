"""Reasoning read out of a chat answer: vLLM's `--reasoning-parser`.

DeepSeek R1 and its distills (Llama-architecture ones among them) think before they
answer, in a `<think> ... </think>` block. Without a parser that thinking is the
message's content; with one it is the message's `reasoning` (vLLM's field, and
`reasoning_content`, its older name that many clients read), and only what follows is
content, which a tool-call parser then reads.
"""

from __future__ import annotations

from typing import Any

from pagellm.engine.outputs import CompletionOutput
from pagellm.entrypoints.openai.tool_calls import partial_tag

_START = "<think>"
_END = "</think>"


class ThinkReasoningParser:
    """vLLM's `deepseek_r1` rules, nearly. R1's chat template opens the think block in
    the prompt, so the answer starts inside it: everything before `</think>` is
    reasoning, and an answer without it is all reasoning (still thinking when it was
    cut). A `<think>` the model writes itself is dropped only at the very start (vLLM
    drops text up to a `<think>` anywhere), so that a stream's parts only ever grow."""

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a finished answer."""
        body = text.removeprefix(_START)
        reasoning, end, content = body.partition(_END)
        if not end:
            return body, None
        return reasoning, content or None

    def streamed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) of a running answer that a stream may send: each only
        grows as the answer does, so a tail that may be the start of `</think>` (or an
        answer that may still become `<think>`) is held back."""
        if _START.startswith(text):
            return "", ""
        body = text.removeprefix(_START)
        reasoning, end, content = body.partition(_END)
        if end:
            return reasoning, content
        return body[:len(body) - partial_tag(body, _END)], ""


def answer_parts(thinking: ThinkReasoningParser | None, completion: CompletionOutput
                 ) -> tuple[str, str]:
    """(reasoning, the rest) of an answer as a stream may send it: while it runs, parts
    that only grow (`streamed`); once finished, the whole split, "" where a part is
    missing. Without a parser there is no reasoning."""
    if thinking is None:
        return "", completion.text
    if completion.finish_reason is None:
        return thinking.streamed(completion.text)
    reasoning, content = thinking.split(completion.text)
    return reasoning or "", content or ""


def count_reasoning_tokens(tokenizer: Any, reasoning: str) -> int:
    """Usage's `reasoning_tokens`: the reasoning re-encoded (a model's own tokens encode
    back to themselves nearly always; the tags are not counted, as vLLM counts up to the
    end tag)."""
    return len(tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0


# The parsers of models' reasoning syntax, by their vLLM names.
REASONING_PARSERS: dict[str, type[ThinkReasoningParser]] = {"deepseek_r1": ThinkReasoningParser}
