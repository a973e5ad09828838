"""Fixtures for the benchmark tests: the default model's tokenizer and directory (the
workloads count tokens with the real tokenizer, so the tests must too)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def model_dir() -> Path:
    from pagellm.cache_dir import resolve_cache_dir
    from pagellm.model.errors import ModelNotFoundError
    from pagellm.model.resolve import resolve_model_path

    try:
        return resolve_model_path(None, resolve_cache_dir())
    except ModelNotFoundError as error:
        pytest.skip(f"default model not installed: {error}")


@pytest.fixture(scope="session")
def tokenizer(model_dir: Path) -> Any:
    from pagellm.model.loader import load_tokenizer

    return load_tokenizer(model_dir)
