"""Write a random-weights pair (dflash_trt.benchmark.random_weights preset) as checkpoint directories.

    python bench/write_random_pair.py qwen3-1.7b /tmp/r17 && \
        dflash-trt build --target /tmp/r17/target --drafter /tmp/r17/drafter --device cuda -o out/r17

For serving real shapes without a download (the Triton-vs-in-process comparison in
BENCHMARKS.md). The weights are made on the GPU (or CPU) and saved with the runtime's
packed tensor names, which the checkpoint loader reads like the Hugging Face ones.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from dflash_trt.benchmark.random_weights import random_pair, write_configs
from dflash_trt.build import _save_model


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("preset")
    ap.add_argument("output", type=Path)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    configs = write_configs(args.output / "configs", args.preset)
    target, drafter = random_pair(configs, args.device, torch.bfloat16)
    _save_model(target, args.output / "target", configs.target)
    _save_model(drafter, args.output / "drafter", configs.drafter)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (configs.target / name).exists():
            (args.output / "target" / name).write_bytes((configs.target / name).read_bytes())
    print(args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
