"""JSON as the server sends it: UTF-8 where it can be, escaped where it must be.

A JSON string may hold a lone surrogate (`"\\ud800"`), which UTF-8 cannot encode, and
some fields come back as the client wrote them (a Responses request's `user` or
`metadata`, an unknown model's name in an error). Written with `ensure_ascii=False`
such an answer would fail after the work is done (a 500, or a stream cut off);
escaping only those answers keeps every other one readable UTF-8.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi.responses import JSONResponse as _StarletteJSONResponse


def dumps_utf8(payload: Any) -> bytes:
    """`payload` as compact JSON in UTF-8, encoded once."""
    try:
        return json.dumps(payload, ensure_ascii=False, allow_nan=False,
                          separators=(",", ":")).encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(payload, allow_nan=False, separators=(",", ":")).encode("utf-8")


def dumps(payload: Any) -> str:
    """`payload` as compact JSON text that encodes to UTF-8 (for text streams)."""
    return dumps_utf8(payload).decode("utf-8")


class JSONResponse(_StarletteJSONResponse):
    def render(self, content: Any) -> bytes:
        return dumps_utf8(content)
