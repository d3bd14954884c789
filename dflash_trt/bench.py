"""`dflash-trt bench`: AR vs DFlash throughput per dataset and concurrency, in-process.

For each concurrency c a fresh Engine shares the loaded target and drafter, with c cache
slots, and the prompts are fed like a closed-loop client at concurrency c: a new request is
added only when one finishes, so at most c run at once and a request's TTFT counts from
its own submission (not from the start of the run). AR runs first; DFlash then runs the
same prompts on the same engine. Decoding is greedy, so DFlash must reproduce AR token
for token (`identical_share`; 1.0 on fp32, bf16 batch-shape effects may lower it).

Numbers per (dataset, concurrency):
- end-to-end tok/s: all output tokens / wall time of the whole run (prefill included);
- decode-only tok/s: tokens emitted by decode steps / wall time of those steps (the
  engine steps that prefill newly admitted requests are left out);
- τ two ways: the mean of per-request mean acceptance lengths, and all tokens from verify
  steps / all verify steps (both count a step's tokens before any stop cut-off);
- TTFT p50/p99 of the DFlash run.

Oracle acceptance (`oracle_tau`): the drafter still runs at full cost, but the first k of
its proposals are replaced by the AR output (the target's own greedy continuation), with
k drawn from a seeded two-point distribution over floor(τ-1) and floor(τ-1)+1 whose mean is
τ-1, so the expected acceptance length is about τ (more where the drafter guesses further
by itself, less where the output's end caps k). Every row says which mode produced it.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass
from typing import Callable, Sequence

import torch

from dflash_trt.errors import ConfigError
from dflash_trt.sampling import SamplingParams
from dflash_trt.speculate import OracleDrafts

DEFAULT_CONCURRENCIES = (1, 8, 16, 32)

# progress(requests_finished, message): (1, None) per finished request, (0, text) per phase
Progress = Callable[[int, "str | None"], None]


@dataclass(frozen=True)
class BenchRow:
    dataset: str
    concurrency: int
    mode_label: str  # "real acceptance" or "oracle τ=X"
    ar_tok_s: float  # end-to-end, prefill included
    dflash_tok_s: float
    speedup: float  # dflash_tok_s / ar_tok_s
    tau_per_request: float  # mean over requests of each request's mean acceptance length
    tau_steps: float  # all verify-step tokens / all verify steps
    ar_decode_tok_s: float  # decode steps only
    dflash_decode_tok_s: float
    ttft_p50_s: float  # DFlash run
    ttft_p99_s: float
    identical_share: float  # requests whose DFlash output equals the AR output
    num_prompts: int

    @property
    def decode_speedup(self) -> float:
        return self.dflash_decode_tok_s / self.ar_decode_tok_s if self.ar_decode_tok_s else 0.0


@dataclass(frozen=True)
class _Run:
    outputs: list[list[int]]
    stats: list  # RequestStats per prompt, in prompt order
    wall_s: float
    decode_tokens: int
    decode_s: float

    @property
    def tok_s(self) -> float:
        return sum(len(o) for o in self.outputs) / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def decode_tok_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0


def mode_label(oracle_tau: float | None) -> str:
    return "real acceptance" if oracle_tau is None else f"oracle τ={oracle_tau:g}"


def oracle_num_correct(oracle_tau: float, block_size: int, seed: int = 0) -> Callable[[object], int]:
    """Draw k (correct drafts per verify step) with mean oracle_tau - 1, k in 0..block_size-1."""
    if not 1 <= oracle_tau <= block_size:
        raise ConfigError(f"oracle τ must be between 1 and the block size {block_size}, got {oracle_tau:g}")
    mean = oracle_tau - 1
    low = min(math.floor(mean), block_size - 1)
    p_high = mean - low  # P(k = low + 1)
    rng = random.Random(seed)
    return lambda seq: low + 1 if rng.random() < p_high else low


def encode_prompts(tokenizer, prompts: Sequence[str], *, chat: bool = True, thinking: bool = False) -> list[list[int]]:
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], enable_thinking=thinking) if chat else p
             for p in prompts]
    return [tokenizer.encode(t) for t in texts]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _drive(engine, prompt_ids: list[list[int]], params: SamplingParams, concurrency: int,
           progress: Progress | None) -> _Run:
    """Closed loop: keep at most `concurrency` requests in the engine until all are done."""
    pending = list(enumerate(prompt_ids))[::-1]
    seqs: dict[int, object] = {}
    in_flight = decode_tokens = 0
    decode_s = 0.0
    _sync(engine.device)
    start = time.perf_counter()
    while pending or engine.has_work():
        while pending and in_flight < concurrency:
            index, ids = pending.pop()
            seqs[index] = engine.add_request(ids, params)
            in_flight += 1
        prefill = bool(engine.waiting and engine.free_slots)
        step_start = time.perf_counter()
        events = engine.step()
        _sync(engine.device)
        if not prefill:
            decode_s += time.perf_counter() - step_start
            decode_tokens += sum(len(e.new_tokens) for e in events)
        for event in events:
            if event.finished:
                in_flight -= 1
                if progress:
                    progress(1, None)
    wall = time.perf_counter() - start
    ordered = [seqs[i] for i in range(len(prompt_ids))]
    return _Run([s.output_ids for s in ordered], [s.stats for s in ordered], wall, decode_tokens, decode_s)


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    import numpy as np

    return float(np.percentile(np.asarray(values, dtype=float), q))


def run_bench(loaded_engine, prompts: Sequence[str], *, dataset: str = "custom",
              concurrencies: Sequence[int] = DEFAULT_CONCURRENCIES, max_tokens: int = 256, chat: bool = True,
              thinking: bool = False, oracle_tau: float | None = None, seed: int = 0,
              progress: Progress | None = None) -> list[BenchRow]:
    """One BenchRow per concurrency: AR then DFlash over `prompts` (greedy, see the module doc)."""
    from dflash_trt.engine import Engine

    base, tok = loaded_engine.engine, loaded_engine.tokenizer
    if base.drafter is None:
        raise ConfigError("the benchmark needs an engine with a drafter")
    if not prompts:
        raise ConfigError("no prompts to benchmark")
    if not concurrencies or any(int(c) < 1 for c in concurrencies):
        raise ConfigError(f"concurrencies must be ints >= 1, got {list(concurrencies)}")
    num_correct = oracle_num_correct(oracle_tau, base.block_size, seed) if oracle_tau is not None else None
    prompt_ids = encode_prompts(tok, prompts, chat=chat, thinking=thinking)
    params = SamplingParams(max_tokens=max_tokens, stop_token_ids=tuple(tok.stop_token_ids))
    need = max(len(p) for p in prompt_ids) + max_tokens
    if need > base.max_seq_len:
        raise ConfigError(f"the longest prompt ({need - max_tokens} tokens) + max_tokens ({max_tokens}) exceeds the "
                          f"engine's max_seq_len = {base.max_seq_len}")

    def new_engine(c: int) -> Engine:
        return Engine(base.target, base.drafter, max_batch_size=c, max_seq_len=need)

    warm = new_engine(1)  # first-call costs (allocator, kernels) stay out of the timings
    for mode in ("ar", "dflash"):
        warm.generate(prompt_ids[:1], SamplingParams(max_tokens=min(8, max_tokens), ignore_eos=True), mode=mode)
    del warm

    label, rows = mode_label(oracle_tau), []
    for c in concurrencies:
        c = int(c)
        engine = new_engine(c)
        engine.set_mode("ar")
        ar = _drive(engine, prompt_ids, params, c, progress)
        if progress:
            progress(0, f"{dataset} c={c} AR: {ar.tok_s:.1f} tok/s")
        if num_correct is not None:
            engine.oracle = OracleDrafts({tuple(p): o for p, o in zip(prompt_ids, ar.outputs)}, num_correct)
        engine.set_mode("dflash")
        df = _drive(engine, prompt_ids, params, c, progress)
        del engine
        per_request = [s.mean_acceptance_length for s in df.stats if s.verify_steps]
        steps = sum(s.verify_steps for s in df.stats)
        tau_steps = sum(sum(s.acceptance_lengths) for s in df.stats) / steps if steps else 0.0
        ttft = [s.ttft_s for s in df.stats if s.ttft_s is not None]
        rows.append(BenchRow(
            dataset=dataset, concurrency=c, mode_label=label, ar_tok_s=ar.tok_s, dflash_tok_s=df.tok_s,
            speedup=df.tok_s / ar.tok_s if ar.tok_s else 0.0,
            tau_per_request=sum(per_request) / len(per_request) if per_request else 0.0, tau_steps=tau_steps,
            ar_decode_tok_s=ar.decode_tok_s, dflash_decode_tok_s=df.decode_tok_s,
            ttft_p50_s=_percentile(ttft, 50), ttft_p99_s=_percentile(ttft, 99),
            identical_share=sum(a == d for a, d in zip(ar.outputs, df.outputs)) / len(prompt_ids),
            num_prompts=len(prompt_ids),
        ))
        if progress:
            progress(0, f"{dataset} c={c} DFlash: {df.tok_s:.1f} tok/s, τ {tau_steps:.2f} ({label})")
    return rows


def format_table(rows: Sequence[BenchRow]) -> str:
    """A markdown table shaped like the DFlash model cards' (end-to-end first, then decode-only)."""
    header = ["Dataset", "Concurrency", "AR tok/s", "DFlash tok/s", "Speedup", "τ",
              "AR decode tok/s", "DFlash decode tok/s", "Decode speedup", "TTFT p50 / p99 (ms)",
              "Identical", "Prompts", "Mode"]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for r in rows:
        cells = [r.dataset, str(r.concurrency), f"{r.ar_tok_s:.1f}", f"{r.dflash_tok_s:.1f}", f"{r.speedup:.2f}x",
                 f"{r.tau_steps:.2f}", f"{r.ar_decode_tok_s:.1f}", f"{r.dflash_decode_tok_s:.1f}",
                 f"{r.decode_speedup:.2f}x", f"{r.ttft_p50_s * 1e3:.1f} / {r.ttft_p99_s * 1e3:.1f}",
                 f"{r.identical_share:.0%}", str(r.num_prompts), r.mode_label]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def rows_to_json(rows: Sequence[BenchRow], **meta) -> str:
    """JSON text: {"meta": {...}, "rows": [each BenchRow's fields + decode_speedup]}."""
    return json.dumps({"meta": meta, "rows": [{**asdict(r), "decode_speedup": r.decode_speedup} for r in rows]},
                      indent=2, ensure_ascii=False)
