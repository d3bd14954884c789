"""A pruned draft vocabulary: the K tokens the drafter may propose, chosen by frequency in a
corpus at build time (build.py counts it) and stored beside the drafter's weights
(`draft_vocab.json`).

The drafter's LM head then reads K rows instead of the whole vocabulary's. Verification still
runs over the whole vocabulary, so output is unchanged; a token outside the K is simply never
drafted (the target supplies it as the bonus token when it comes).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from dflash_trt.errors import ConfigError

FILE = "draft_vocab.json"


def choose(counts: Counter, size: int, always: list[int], vocab_size: int) -> list[int]:
    """The `size` most frequent ids (ties by id), `always` included, sorted."""
    if size > vocab_size:
        raise ConfigError(f"draft_vocab_size = {size} is more than the target's vocabulary ({vocab_size})")
    chosen = set(always)
    for token, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        if len(chosen) >= size:
            break
        chosen.add(token)
    for token in range(vocab_size):  # a corpus with fewer distinct tokens: fill by id
        if len(chosen) >= size:
            break
        chosen.add(token)
    return sorted(chosen)


def write(directory: Path, ids: list[int]) -> None:
    (Path(directory) / FILE).write_text(json.dumps({"ids": ids}) + "\n")


def read(directory: Path, vocab_size: int) -> list[int] | None:
    path = Path(directory) / FILE
    if not path.is_file():
        return None
    try:
        ids = json.loads(path.read_text())["ids"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise ConfigError(f"{path}: not a draft vocabulary ({e})") from None
    if (not isinstance(ids, list) or not ids or not all(isinstance(i, int) and 0 <= i < vocab_size for i in ids)
            or len(set(ids)) != len(ids)):
        raise ConfigError(f"{path}: 'ids' must be distinct token ids in [0, {vocab_size})")
    return ids
