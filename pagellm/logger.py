"""Makes PageLLM's own log lines (start-up time, KV pool size) visible by default.

A user who configured logging keeps their configuration; otherwise the `pagellm` logger
gets one stderr handler, at INFO as vLLM does for its own logger, or at the level the
user set on it (`logging.getLogger("pagellm").setLevel(logging.DEBUG)` is enough to see
its debug lines). That handler steps aside once the user configures logging later (a
notebook's `logging.basicConfig` in a later cell): the lines then reach the user's
handlers alone, instead of twice in two formats.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, TextIO

LOG_FORMAT = "%(levelname)s %(asctime)s %(name)s: %(message)s"


if TYPE_CHECKING:
    _StreamHandler = logging.StreamHandler[TextIO]
else:  # logging's classes take [] at run time only from Python 3.11
    _StreamHandler = logging.StreamHandler


class _UntilConfigured(_StreamHandler):
    """Writes a record only while the root logger has no handler of its own."""

    def emit(self, record: logging.LogRecord) -> None:
        if not logging.getLogger().handlers:
            super().emit(record)


def ensure_visible_logging() -> None:
    package_logger = logging.getLogger("pagellm")
    if package_logger.handlers or logging.getLogger().handlers:
        return
    handler = _UntilConfigured()
    handler.setFormatter(logging.Formatter(LOG_FORMAT, datefmt="%H:%M:%S"))
    package_logger.addHandler(handler)
    if package_logger.level == logging.NOTSET:
        package_logger.setLevel(logging.INFO)
