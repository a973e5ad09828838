"""Errors the model layer raises when a model cannot be found, understood or loaded.

They subclass the built-in exception a caller would naturally catch (FileNotFoundError,
ValueError) so generic handlers keep working, and share `ModelLoadError` so the engine can
turn any of them into one clear start-up message.
"""

from __future__ import annotations


class ModelLoadError(Exception):
    """Base class: the model named by the user cannot be loaded."""


class ModelNotFoundError(ModelLoadError, FileNotFoundError):
    """The path does not exist or holds no model files."""


class UnsupportedArchitectureError(ModelLoadError, ValueError):
    """The checkpoint is for an architecture PageLLM does not implement."""


class CorruptModelError(ModelLoadError, ValueError):
    """A model file exists but cannot be parsed or does not match its config."""


class CacheWriteError(ModelLoadError, OSError):
    """The model's conversion cannot be written into the cache directory."""
