"""PageLLM's default log handler (pagellm/logger.py), in a fresh interpreter each: the
logging configuration is process-wide."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import logging
from pagellm.logger import ensure_visible_logging
ensure_visible_logging()
log = logging.getLogger("pagellm.engine.llm")
log.info("before the user configures logging")
logging.basicConfig(level=logging.INFO, format="USER %(name)s: %(message)s")
log.warning("after")
"""


def test_lines_show_once_before_and_after_the_user_configures_logging() -> None:
    """A notebook's `logging.basicConfig` in a later cell printed every line twice."""
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          timeout=60, check=True)
    lines = done.stderr.splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith("INFO ") and lines[0].endswith(
        "pagellm.engine.llm: before the user configures logging")
    assert lines[1] == "USER pagellm.engine.llm: after"
