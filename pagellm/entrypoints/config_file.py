"""vLLM's `--config FILE.yaml`: a command's options kept in a YAML file, so a deployment
written for `vllm serve --config` runs here too.

Each key is an option's name (`max-model-len` or `max_model_len`); a value becomes the
option's argument, a nested mapping its JSON text, and a boolean the flag (true) or its
`--no-` form where the command has one (false, else nothing). A list becomes the values
of an option that takes several (`api-key: [k1, k2]`), the option once per item where it
is given once per value (`stop: [a, b]`), its JSON text for an option that takes a
JSON list (`allowed-origins`), and its items joined by commas for one that takes them so
(`disable-access-log-for-endpoints`): each as the command line would write it.
The file's options go right after the command (and after `serve`'s model, if given
first), so options on the command line win over the file's, as in vLLM.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from typing import Any

import yaml


def with_config_file(argv: list[str], flags: Mapping[str, argparse.Action]) -> list[str]:
    """`argv` with its `--config FILE` (or `--config=FILE`) replaced by the file's
    options; `flags` maps the commands' option strings to their actions (for booleans'
    `--no-` forms and how a list is given).
    Raises ValueError for a second --config, a missing path or a file that is not a
    YAML mapping."""
    positions = [i for i, arg in enumerate(argv)
                 if arg == "--config" or arg.startswith("--config=")]
    if not positions:
        return argv
    if len(positions) > 1:
        raise ValueError("--config is given more than once")
    index = positions[0]
    if argv[index] == "--config":
        if index + 1 == len(argv):
            raise ValueError("--config needs a YAML file")
        path, rest = argv[index + 1], argv[:index] + argv[index + 2:]
    else:
        path, rest = argv[index].split("=", 1)[1], argv[:index] + argv[index + 1:]
    options = _options(path, flags)
    # After the command, and after the model `serve` is given right after it (as vLLM
    # places them): a list-valued option of the file must not take the model as one of
    # its values, and that model wins over the file's.
    model_given = rest[:1] == ["serve"] and len(rest) > 1 and not rest[1].startswith("-")
    if model_given and "--model" in options:
        at = options.index("--model")
        options = options[:at] + options[at + 2:]
    at = 2 if model_given else min(1, len(rest))
    return rest[:at] + options + rest[at:]


def _options(path: str, flags: Mapping[str, argparse.Action]) -> list[str]:
    if not path.endswith((".yaml", ".yml")):
        raise ValueError(f"--config must be a .yaml or .yml file, got {path!r}")
    try:
        with open(path, encoding="utf-8") as handle:
            config = yaml.safe_load(handle)
    except OSError as error:
        raise ValueError(f"--config: cannot read {path}: {error.strerror}") from error
    except (yaml.YAMLError, RecursionError) as error:
        raise ValueError(f"--config: {path} is not YAML that can be read: {error}") from error
    if config is None:
        return []
    if not isinstance(config, dict):
        raise ValueError(f"--config: {path} must hold a mapping of options, got "
                         f"{type(config).__name__}")
    options: list[str] = []
    for key, value in config.items():
        flag = "--" + str(key).replace("_", "-")
        if flag == "--config":
            raise ValueError(f"--config: {path} names another config file")
        if value is None:
            raise ValueError(f"--config: {path}: {key} has no value")
        try:
            options += _arguments(flag, value, flags)
        except (TypeError, ValueError) as error:  # a value JSON cannot hold (a date)
            raise ValueError(f"--config: {path}: {key}: {error}") from error
    return options


def _arguments(flag: str, value: Any, flags: Mapping[str, argparse.Action]) -> list[str]:
    if isinstance(value, bool):
        negative = "--no-" + flag[2:]
        return [flag] if value else [negative] if negative in flags else []
    if isinstance(value, list):
        action = flags.get(flag)
        if not value:
            return []
        if isinstance(action, argparse._AppendAction):
            return [part for item in value for part in (flag, str(item))]
        if action is not None and action.nargs is None:  # one argument holds the list
            joined = json.dumps(value) if action.metavar == "JSON" else ",".join(map(str, value))
            return [flag, joined]
        return [flag, *map(str, value)]
    if isinstance(value, dict):
        return [flag, json.dumps(value)]
    return [flag, str(value)]
