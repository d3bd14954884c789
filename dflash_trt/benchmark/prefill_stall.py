"""`dflash-trt bench --stall-prompt N`: what one long prompt does to requests already decoding.

`concurrency` requests decode (greedy, no stop token, so none ends early) until each has
received tokens several times; then one request with an N-token prompt arrives and the
engine steps until that prompt has its first token, and one step more. For each setting
of the prefill chunk (0: the prompt in one pass, then the given chunk size) a row reports:
- the long prompt's TTFT (its prefill, however split);
- the gaps between consecutive token deliveries of the decoding requests that overlap its
  prefill: p50, p99 and the largest. A delivery is one engine step's tokens for a request
  (a DFlash step delivers several at once), so a gap is what a streaming client waits;
- the same gaps' p50 before the long prompt arrived (the steady state).
Timestamps are taken after each step with the device synchronised.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import torch

from dflash_trt.benchmark.loadgen import percentile
from dflash_trt.errors import ConfigError
from dflash_trt.sampling import SamplingParams

STEADY_DELIVERIES = 8  # per decoding request before the long prompt arrives


@dataclass(frozen=True)
class StallRow:
    mode: str  # "dflash" or "ar"
    prefill_chunk: int  # 0: the long prompt in one pass
    concurrency: int  # requests decoding when it arrives
    long_prompt_tokens: int
    long_ttft_s: float
    gap_p50_s: float  # deliveries to the decoding requests during the long prefill
    gap_p99_s: float
    gap_max_s: float
    steady_gap_p50_s: float  # before it arrived
    deliveries: int  # gaps counted during the prefill


def long_prompt(prompt_ids: Sequence[list[int]], num_tokens: int) -> list[int]:
    """The dataset's prompts end to end, repeated, cut to num_tokens (text the target knows)."""
    pool = [t for ids in prompt_ids for t in ids]
    if not pool:
        raise ConfigError("no prompt tokens to build the long prompt from")
    return (pool * (num_tokens // len(pool) + 1))[:num_tokens]


def _gaps(times: list[float], start: float, end: float) -> list[float]:
    """Gaps between consecutive deliveries that overlap [start, end]."""
    return [b - a for a, b in zip(times, times[1:]) if b > start and a < end]


def run_stall(base, prompt_ids: Sequence[list[int]], *, long_tokens: int, concurrency: int,
              chunks: Sequence[int], max_tokens: int, mode: str = "dflash") -> list[StallRow]:
    """One StallRow per prefill chunk setting (see the module doc); `base` an Engine."""
    if len(prompt_ids) < concurrency:
        raise ConfigError(f"the stall test needs {concurrency} prompts for its decoding requests, got "
                          f"{len(prompt_ids)}")
    long_ids = long_prompt(prompt_ids, long_tokens)
    decoding = [list(p) for p in prompt_ids[:concurrency]]
    need = max(long_tokens + 2, max(map(len, decoding)) + max_tokens)
    rows = []
    for chunk in chunks:
        engine = base.sibling(max_batch_size=concurrency + 1, max_seq_len=need, prefill_chunk=chunk)
        engine.warm_up()
        engine.set_mode(mode)
        for warm in (decoding[0], long_ids):  # first-call costs (allocator, kernels) stay out of the timings
            engine.generate([warm], SamplingParams(max_tokens=2, ignore_eos=True))
        ttft, during, steady = _measure(engine, decoding, long_ids, max_tokens)
        del engine  # its caches go before the next one's are made
        rows.append(StallRow(mode=mode, prefill_chunk=chunk, concurrency=concurrency, long_prompt_tokens=long_tokens,
                             long_ttft_s=ttft, gap_p50_s=percentile(during, 50), gap_p99_s=percentile(during, 99),
                             gap_max_s=max(during, default=0.0), steady_gap_p50_s=percentile(steady, 50),
                             deliveries=len(during)))
    return rows


def _measure(engine, decoding: list[list[int]], long_ids: list[int], max_tokens: int):
    """(the long prompt's TTFT, the decoding requests' gaps during its prefill, and before it)."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    seqs = [engine.add_request(p, params) for p in decoding]
    times: dict[int, list[float]] = {s.request_id: [] for s in seqs}

    def step() -> float:
        events = engine.step()
        if engine.device.type == "cuda":
            torch.cuda.synchronize(engine.device)
        now = time.perf_counter()
        for e in events:
            if e.seq.request_id in times and e.new_tokens:
                times[e.seq.request_id].append(now)
        return now

    while min(map(len, times.values())) < STEADY_DELIVERIES:
        step()
    arrival = time.perf_counter()
    long_seq = engine.add_request(long_ids, SamplingParams(max_tokens=1, ignore_eos=True))
    while long_seq.stats.first_token_time is None:
        first = step()
    step()  # the decoding requests' first delivery after the prefill closes its gap
    if any(s.is_finished for s in seqs):
        raise ConfigError(f"a decoding request reached its {max_tokens} tokens before the long prompt's "
                          "prefill ended; raise --max-tokens")
    for s in seqs:
        engine.abort(s)
    during = [g for t in times.values() for g in _gaps(t, arrival, first)]
    steady = [g for t in times.values() for g in _gaps([x for x in t if x < arrival], 0.0, arrival)]
    return long_seq.stats.ttft_s, during, steady


def format_stall_table(rows: Sequence[StallRow]) -> str:
    header = ["Mode", "Prefill chunk", "Decoding requests", "Long prompt", "Long prompt TTFT (ms)",
              "Gap p50 / p99 / max during it (ms)", "Gap p50 before (ms)", "Gaps"]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for r in rows:
        cells = [r.mode, str(r.prefill_chunk or "none"), str(r.concurrency), str(r.long_prompt_tokens),
                 f"{r.long_ttft_s * 1e3:.1f}",
                 f"{r.gap_p50_s * 1e3:.1f} / {r.gap_p99_s * 1e3:.1f} / {r.gap_max_s * 1e3:.1f}",
                 f"{r.steady_gap_p50_s * 1e3:.1f}", str(r.deliveries)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
