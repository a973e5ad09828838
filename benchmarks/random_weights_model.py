"""Writes a model with random weights beside a copy of a model directory's config and
tokenizer files.

Speed does not depend on the weights' values, so a machine the real weights cannot reach
(the GPU check carries only small files) can still be measured on the default model's
exact shape: `python benchmarks/random_weights_model.py SHAPE_DIR OUT_DIR`.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

SHAPE_FILES = ("config.json", "generation_config.json", "tokenizer.json",
               "tokenizer_config.json", "chat_template.jinja")


def write_random_model(shape_dir: Path, out_dir: Path, seed: int = 0) -> Path:
    config = AutoConfig.from_pretrained(shape_dir)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
        config, dtype=torch.float32)
    model.save_pretrained(out_dir, safe_serialization=True)
    # The shape directory's own files win over the ones save_pretrained rewrote.
    for name in SHAPE_FILES:
        if (shape_dir / name).exists():
            shutil.copy(shape_dir / name, out_dir / name)
    return out_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shape_dir", type=Path, help="holds config.json and the tokenizer")
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(write_random_model(args.shape_dir, args.out_dir, args.seed))


if __name__ == "__main__":
    main()
