"""vLLM's `FlexibleArgumentParser` (`vllm.utils.argparse_utils`), which its example
scripts build their command lines with beside `EngineArgs.add_cli_args`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from pagellm.entrypoints.engine_args import dashed_flags, unrecognized


class FlexibleArgumentParser(argparse.ArgumentParser):
    """argparse's parser as vLLM's scripts expect it: flags may be written with
    underscores (`--max_model_len`), no flag is taken for a prefix of another (vLLM's
    `--tokenizer` is not `--tokenizer-mode`), and an unrecognized vLLM option says what
    to use instead, as the `pagellm` command's do."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                   namespace: argparse.Namespace | None = None) -> argparse.Namespace:
        parsed, unknown = self.parse_known_args(args, namespace)
        if unknown:
            self.error(unrecognized(unknown))
        return parsed

    def parse_known_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                         namespace: argparse.Namespace | None = None
                         ) -> tuple[argparse.Namespace, list[str]]:
        argv = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(dashed_flags(argv), namespace)
