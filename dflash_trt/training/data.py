"""Training data: prompts -> responses the target writes itself (through our engine) -> a token
dataset on disk that training reads lazily.

A token dataset is a directory: `tokens.bin` (all sequences' int32 ids back to back) and
`index.json` (each sequence's length and prompt length: the loss covers only the response).
It is written beside its final place and renamed whole.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dflash_trt.benchmark.datasets import dataset_path, json_lines
from dflash_trt.engine import Engine
from dflash_trt.errors import ConfigError
from dflash_trt.sampling import SamplingParams
from dflash_trt.tokenizer import Tokenizer

INDEX_FILE, TOKENS_FILE = "index.json", "tokens.bin"


# ShareGPT's speaker names (`from`) -> chat roles
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


def read_conversations(name_or_path: str | Path) -> list[list[dict]]:
    """Each line of a shipped set or a JSONL file as chat messages: `{"prompt": text}` is one
    user turn; `{"messages": [...]}` (OpenAI's form) and `{"conversations": [{"from", "value"}]}`
    (ShareGPT's, as SpecForge reads it) are taken as given, the last assistant turn dropped (the
    target writes the response)."""
    path = dataset_path(name_or_path)
    conversations = []
    for number, record in json_lines(path):
        record = record if isinstance(record, dict) else {}
        messages, prompt = record.get("messages"), record.get("prompt")
        if "conversations" in record:
            messages = _sharegpt_messages(record["conversations"], f"{path}:{number}")
        if isinstance(prompt, str) and prompt:
            conversations.append([{"role": "user", "content": prompt}])
        elif isinstance(messages, list) and messages and all(isinstance(m, dict) and "role" in m for m in messages):
            conversations.append(messages[:-1] if messages[-1]["role"] == "assistant" else messages)
        else:
            raise ConfigError(f"{path}:{number}: each line needs a non-empty string 'prompt', a list 'messages' of "
                              "{role, content} objects or a list 'conversations' of {from, value} objects")
    if not conversations:
        raise ConfigError(f"{path}: no prompts")
    return conversations


def _sharegpt_messages(turns, where: str) -> list[dict] | None:
    if not isinstance(turns, list) or not all(isinstance(t, dict) and isinstance(t.get("value"), str) for t in turns):
        return None  # the caller names what a line needs
    for turn in turns:
        if turn.get("from") not in SHAREGPT_ROLES:
            raise ConfigError(f"{where}: a conversation turn from {turn.get('from')!r}; known speakers: "
                              f"{', '.join(SHAREGPT_ROLES)}")
    return [{"role": SHAREGPT_ROLES[t["from"]], "content": t["value"]} for t in turns]


def encode_conversation(tokenizer: Tokenizer, messages: list[dict], chat: bool, thinking: bool) -> list[int]:
    """Token ids of the prompt: through the chat template, or (chat off) the user text as is."""
    if chat:
        return tokenizer.encode(tokenizer.apply_chat_template(messages, enable_thinking=thinking))
    return tokenizer.encode("".join(m.get("content") or "" for m in messages))


def respond(engine: Engine, prompts: list[list[int]], params: SamplingParams, numbers,
            progress=None, chunk: int = 256) -> list[tuple[list[int], int]]:
    """(prompt + response ids, prompt length) for each prompt, answered by the engine (AR).
    `numbers`: each prompt's place in the whole dataset; sampled, prompt number n draws with
    seed params.seed + n, so the dataset depends neither on the batching nor on how the
    prompts were split over processes."""
    numbers = list(numbers)
    sequences: list[tuple[list[int], int]] = []
    for start in range(0, len(prompts), chunk):
        part = prompts[start:start + chunk]
        seeded = params if params.greedy else [dataclasses.replace(params, seed=(params.seed or 0) + n)
                                               for n in numbers[start:start + chunk]]
        for prompt, result in zip(part, engine.generate(part, seeded, mode="ar")):
            sequences.append((prompt + result.token_ids, len(prompt)))
        if progress:
            progress(len(sequences), len(prompts))
    return sequences


def interleave(parts: list["TokenDataset"]) -> list[tuple[np.ndarray, int]]:
    """Sequence n of the whole dataset from the parts that took every len(parts)-th prompt
    (part r: prompts r, r + N, ...): part n % N's sequence n // N."""
    total = sum(map(len, parts))
    return [(np.asarray(ids), prompt_len) for ids, prompt_len in
            (parts[n % len(parts)][n // len(parts)] for n in range(total))]


def write_token_dataset(directory: Path, sequences: list[tuple[list[int], int]]) -> None:
    """`sequences`: (ids, prompt length) each. `directory` must not exist yet."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    staged = Path(tempfile.mkdtemp(dir=directory.parent, prefix=f".{directory.name}-"))
    lengths = [len(ids) for ids, _ in sequences]
    np.concatenate([np.asarray(ids, dtype=np.int32) for ids, _ in sequences]).tofile(staged / TOKENS_FILE)
    index = {"lengths": lengths, "prompt_lengths": [p for _, p in sequences]}
    (staged / INDEX_FILE).write_text(json.dumps(index))
    os.replace(staged, directory)


class TokenDataset:
    """A token dataset, memory-mapped: sequence i -> (ids, prompt length)."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        try:
            index = json.loads((self.directory / INDEX_FILE).read_text())
            self.lengths, self.prompt_lengths = index["lengths"], index["prompt_lengths"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise ConfigError(f"{self.directory / INDEX_FILE}: not a token dataset index ({e})") from None
        self.offsets = np.concatenate([[0], np.cumsum(self.lengths)[:-1]]).astype(np.int64).tolist()
        self.tokens = np.memmap(self.directory / TOKENS_FILE, dtype=np.int32, mode="r")
        if self.tokens.shape[0] != sum(self.lengths):
            raise ConfigError(f"{self.directory / TOKENS_FILE}: holds {self.tokens.shape[0]} tokens, its index "
                              f"{sum(self.lengths)}")

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        return self.tokens[self.offsets[i]:self.offsets[i] + self.lengths[i]], self.prompt_lengths[i]

    def num_response_tokens(self) -> int:
        return sum(n - p for n, p in zip(self.lengths, self.prompt_lengths))


@dataclass(frozen=True)
class Cursor:
    """Where training is in the data: the epoch (it seeds that epoch's order) and how many
    batches of it were taken. A checkpoint stores it; resuming continues from it exactly."""

    epoch: int = 0
    batch: int = 0


def epoch_order(num_sequences: int, epoch: int, seed: int) -> list[int]:
    order = list(range(num_sequences))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return order


def collate(dataset: TokenDataset, indices: list[int], max_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> ids [bs, S] (0-padded) and the loss mask [bs, S] (response tokens), S the longest
    sequence of the batch cut to max_length."""
    items = [dataset[i] for i in indices]
    S = min(max_length, max(len(ids) for ids, _ in items))
    ids = torch.zeros(len(items), S, dtype=torch.long)
    mask = torch.zeros(len(items), S, dtype=torch.bool)
    for row, (seq, prompt_len) in enumerate(items):
        n = min(len(seq), S)
        ids[row, :n] = torch.from_numpy(np.asarray(seq[:n], dtype=np.int64))
        mask[row, prompt_len:n] = True
    return ids, mask


def batches(dataset: TokenDataset, num_sequences: int, batch_size: int, max_length: int, seed: int, cursor: Cursor,
            rank: int = 0, world: int = 1):
    """Endless (cursor, ids, mask) over the first `num_sequences` from `cursor` on, the cursor
    being where the *next* batch starts; rank r of `world` takes every world-th batch of the
    same order."""
    per_epoch = num_sequences // (batch_size * world)
    if per_epoch == 0:
        raise ConfigError(f"{dataset.directory}: {num_sequences} sequences are fewer than one step's "
                          f"{batch_size} x {world} ranks")
    epoch, b = cursor.epoch, cursor.batch
    while True:
        order = epoch_order(num_sequences, epoch, seed)
        while b < per_epoch:
            first = (b * world + rank) * batch_size
            ids, mask = collate(dataset, order[first:first + batch_size], max_length)
            b += 1
            yield Cursor(epoch, b), ids, mask
        epoch, b = epoch + 1, 0
