"""Incremental detokenization and stop strings, one sample at a time.

Decoding the whole output again at every token costs O(n^2) over a long answer; instead
each step decodes only a short window. A token can end in the middle of a UTF-8 character
(the text then ends with U+FFFD), so text is released only once the window decodes cleanly,
or when the sample finishes: then the whole characters still pending are written out, and
the bytes of a character the sample left unfinished are not, as vLLM leaves them out (a
reply cut by max_tokens inside an emoji would otherwise end in a visible U+FFFD). (The
engine also leaves out the text of a stopping token, and a stop string cuts the text;
otherwise the text is the decoded tokens.) The window starts a few tokens back in the
prompt, so tokenizers that drop a leading space when decoding from a word boundary still
produce the right first word. A prompt given as token ids can end in the middle of a
character: the character its output's first tokens complete is the output's first
character (vLLM's too, though it puts a copy of the prompt's text before it), not a
U+FFFD left in the prompt's text.

Stop strings follow vLLM: none is looked for until more than `min_tokens` tokens exist,
and each stop string is looked for only where it would end in the new text, so a match
inside the first `min_tokens` tokens never ends the sample later. Where several match,
the one that begins first cuts the text (vLLM takes the first listed that matches, which
can leave part of another stop string in the text); a tie goes to the first listed.
"""

from __future__ import annotations

from typing import Any

_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        stop: list[str],
        include_stop_str_in_output: bool,
        skip_special_tokens: bool,
        min_tokens: int = 0,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._stop = stop
        self._include_stop = include_stop_str_in_output
        self._skip_special = skip_special_tokens
        self._spaces_between_special = spaces_between_special_tokens
        self._min_tokens = min_tokens
        self._num_tokens = 0
        self._hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.stopped_by: str | None = None

    def _decode(self, ids: list[int]) -> str:
        if self._tokenizer is None:
            return ""
        return str(self._tokenizer.decode(
            ids, skip_special_tokens=self._skip_special,
            spaces_between_special_tokens=self._spaces_between_special))

    def add_token(self, token_id: int) -> str | None:
        """Appends a token's text; returns the stop string if the text now contains one
        (the text is then cut at it)."""
        self._ids.append(token_id)
        self._num_tokens += 1
        return self._release(finished=False)

    def finish(self) -> str | None:
        """Writes out the whole characters held back behind an incomplete one (the sample
        ended mid-character); returns a stop string found in them, as `add_token` does."""
        if self.stopped_by is not None:
            return None
        return self._release(finished=True)

    def _release(self, finished: bool) -> str | None:
        if self._read_offset == len(self._ids):
            return None
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        window = self._decode(self._ids[self._prefix_offset :])
        start = _new_text_start(prefix, window)
        if len(window) <= start or (window.endswith(_REPLACEMENT) and not finished):
            return None
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        released = window[start:]
        old_length = len(self.text)
        self.text += released.rstrip(_REPLACEMENT) if finished else released
        if self._num_tokens <= self._min_tokens:
            return None
        hits = [(self.text.find(stop, max(0, old_length - len(stop) + 1)), order, stop)
                for order, stop in enumerate(self._stop)]
        found = min(((at, order, stop) for at, order, stop in hits if at >= 0), default=None)
        if found is None:
            return None
        at, _, stop = found
        self.text = self.text[: at + len(stop) if self._include_stop else at]
        self.stopped_by = stop
        return stop

    def visible_text(self, finished: bool) -> str:
        """The text safe to show now: without the tail that might still become a stop."""
        if finished or not self._stop or self._hold == 0:
            return self.text
        return self.text[: max(0, len(self.text) - self._hold)]


def _new_text_start(prefix: str, window: str) -> int:
    """Where the window's new text begins: after the prefix's text, less the U+FFFD at its
    end that the window's tokens turn into a character (only a prompt's tail can end
    mid-character; later prefixes end where released text ended, on whole characters)."""
    start = len(prefix)
    while start and prefix[start - 1] == _REPLACEMENT and window[start - 1 : start] != _REPLACEMENT:
        start -= 1
    return start
