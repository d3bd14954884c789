"""One request's state inside the engine, and the statistics it reports."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from dflash_trt.sampling import SamplingParams


@dataclass
class RequestStats:
    prompt_tokens: int
    output_tokens: int = 0
    verify_steps: int = 0
    verified_drafts: int = 0  # drafts the target verified: block - 1 per step, fewer at a narrower width
    # Per verify step: accepted drafts + 1 bonus (1..B), counted before any stop cut-off.
    acceptance_lengths: list[int] = field(default_factory=list)
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def mean_acceptance_length(self) -> float:
        """τ: tokens produced per verify step (0 when no verify step ran, e.g. in AR mode)."""
        return sum(self.acceptance_lengths) / len(self.acceptance_lengths) if self.acceptance_lengths else 0.0

    @property
    def mean_verify_width(self) -> float:
        """Tokens per verify (the bonus and the drafts verified; 0 without verify steps)."""
        return 1 + self.verified_drafts / self.verify_steps if self.verify_steps else 0.0

    def acceptance_histogram(self, block_size: int) -> list[int]:
        """counts[k - 1] = number of verify steps that produced k tokens, k = 1..block_size."""
        counts = [0] * block_size
        for length in self.acceptance_lengths:
            counts[length - 1] += 1
        return counts

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time



def acceptance_summary(stats: list[RequestStats], block_size: int) -> dict:
    """τ over every verify step of these requests, the step count and the histogram of tokens
    per step (1..block_size)."""
    lengths = [n for s in stats for n in s.acceptance_lengths]
    return {"tau": round(sum(lengths) / max(1, len(lengths)), 3), "verify_steps": len(lengths),
            "acceptance_histogram": [lengths.count(k) for k in range(1, block_size + 1)]}


@dataclass(eq=False)
class Sequence:
    request_id: int
    prompt_ids: list[int]
    params: SamplingParams
    stop_ids: frozenset[int]
    seed: int = 0  # a sampling request's: with `draws`, the key of its next random draw
    draws: int = 0  # (sampling.draw_keys)
    slot: int = -1
    output_ids: list[int] = field(default_factory=list)
    # Target K/V rows committed for this sequence; in DFlash mode the draft cache holds the
    # same number of context rows. The last output token is emitted but not yet cached.
    num_cached: int = 0
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stats: RequestStats = None

    def __post_init__(self):
        if self.stats is None:
            self.stats = RequestStats(prompt_tokens=len(self.prompt_ids))

    @property
    def last_token(self) -> int:
        return self.output_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    def emit(self, tokens: list[int]) -> list[int]:
        """Append generated tokens up to a stop token or max_tokens; returns those kept.

        A stop token is kept and wins over max_tokens when it is also the last one allowed.
        (Runs for every sequence every step: set operations instead of a per-token loop.)"""
        kept = tokens[: max(1, self.params.max_tokens - len(self.output_ids))]
        if not self.stop_ids.isdisjoint(kept):
            cut = next(i for i, token in enumerate(kept) if token in self.stop_ids)
            kept, self.finish_reason = kept[: cut + 1], "stop"
        elif kept and len(self.output_ids) + len(kept) >= self.params.max_tokens:
            self.finish_reason = "length"
        self.output_ids += kept
        self.stats.output_tokens = len(self.output_ids)
        now = time.perf_counter()
        if self.stats.first_token_time is None:
            self.stats.first_token_time = now
        if self.is_finished:
            self.stats.finish_time = now
        return kept
