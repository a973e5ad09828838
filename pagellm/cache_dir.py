"""Where PageLLM keeps what it makes once per machine: converted models and built kernels.

Standard library only: the engine's configuration reads it without loading torch.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)


def resolve_cache_dir(cache_dir: str | Path | None = None) -> Path:
    """The cache root: the given directory, else $PAGELLM_CACHE_DIR, else pagellm/ in the
    user's cache directory ($XDG_CACHE_HOME, else ~/.cache), where vLLM keeps its own: a
    container whose home cannot be written sets XDG_CACHE_HOME for every tool at once."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    if os.environ.get("PAGELLM_CACHE_DIR"):
        return Path(os.environ["PAGELLM_CACHE_DIR"]).expanduser()
    home_cache = Path.home() / ".cache" / "pagellm"
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(xdg):  # unset, or relative: not a base directory (the spec)
        return home_cache
    chosen = Path(xdg) / "pagellm"
    if chosen != home_cache and home_cache.is_dir() and not chosen.exists():
        # Versions before 2026-12 ignored XDG_CACHE_HOME: say why the model is converted
        # and the kernels built again.
        logger.warning("using the cache in $XDG_CACHE_HOME (%s); the one in %s is no "
                       "longer read (set PAGELLM_CACHE_DIR to keep it)", chosen, home_cache)
    return chosen
