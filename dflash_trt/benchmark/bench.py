"""`dflash-trt bench`: AR vs DFlash throughput per dataset and concurrency, in-process.

For each concurrency c a fresh Engine shares the loaded target and drafter, with c cache
slots, and the prompts are fed like a closed-loop client at concurrency c: a new request is
added only when one finishes, so at most c run at once and a request's TTFT counts from
its own submission (not from the start of the run). AR runs first; DFlash then runs the
same prompts on the same engine. Decoding is greedy, so DFlash must reproduce AR token
for token (`identical_share`; 1.0 on fp32, bf16 batch-shape effects may lower it); with a
`sampling` (a SamplingParams' temperature, top-k and top-p) every request samples (prompt i
with seed `seed` + i), DFlash with the lossless rule, so its outputs are the target's
distribution rather than AR's tokens and `identical_share` is n/a.

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
τ-1, and the row accepts exactly those k and the reference's next token (a *forced* oracle,
speculate.OracleDrafts: bf16 near-ties would otherwise steer a random-weight model off its
reference). So the acceptance length is about τ (less where the output's end caps k), the
passes cost what real ones do, and "identical" is n/a. Every row says which mode produced it.

`run_report` adds, per dataset, the same prompts measured through a running Triton server
(loadgen.py: a client-side closed loop at the same concurrencies, so serving overhead shows
next to the in-process numbers) and a `transformers` generate baseline at concurrency 1
(transformers_baseline.py). The engine may be a built OUTPUT_DIR or real-shape random weights.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Callable, Sequence

import torch

from dflash_trt.benchmark import loadgen
from dflash_trt.benchmark.datasets import dataset_label, load_prompts
from dflash_trt.benchmark.loadgen import TritonRow, format_triton_table, percentile
from dflash_trt.benchmark.prefill_stall import StallRow, format_stall_table, run_stall
from dflash_trt.benchmark.transformers_baseline import generate_tok_s, to_transformers
from dflash_trt.engine import Engine
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
    identical_share: float | None  # requests whose DFlash output equals AR's (None: forced oracle)
    num_prompts: int
    verify_width: float = 0.0  # tokens per verify, the mean over steps (the block unless adaptive)
    ar_overlap: bool = True  # steps overlapped the host's reading (Engine.overlap: AR and DFlash)
    runs: int = 1  # AR + DFlash pairs run (--repeat): this row is the one of median speedup
    speedup_range: tuple[float, float] | None = None  # the lowest and highest speedup of the runs

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


def mode_label(oracle_tau: float | None, oracle_dist: str = "two-point", sampling: SamplingParams | None = None) -> str:
    if oracle_tau is None:
        return "real acceptance" + loadgen.sampling_label(sampling)
    return f"oracle τ={oracle_tau:g}" + ("" if oracle_dist == "two-point" else f" ({oracle_dist})")


ORACLE_DISTS = ("two-point", "geometric")


class OracleNumCorrect:
    """Draw k (correct drafts per verify step) with mean oracle_tau - 1, k in 0..block_size-1:
    "two-point", the integers around the mean; "geometric", each draft correct with one rate
    r (independently, until the first wrong one), r solved so that 1 + E[k] = τ: the long
    tail of real acceptance, which a narrower verify gives up. A class, not a closure: a
    tensor-parallel leader sends it to the other ranks (pickled)."""

    def __init__(self, oracle_tau: float, block_size: int, seed: int = 0, dist: str = "two-point"):
        if not 1 <= oracle_tau <= block_size:
            raise ConfigError(f"oracle τ must be between 1 and the block size {block_size}, got {oracle_tau:g}")
        if dist not in ORACLE_DISTS:
            raise ConfigError(f"oracle distribution must be one of {', '.join(ORACLE_DISTS)}, got {dist!r}")
        mean, self.dist, self.block_size = oracle_tau - 1, dist, block_size
        self.low = min(math.floor(mean), block_size - 1)
        self.p_high = mean - self.low  # P(k = low + 1)
        self.rate, lo, hi = 0.0, 0.0, 1.0
        for _ in range(60 if dist == "geometric" else 0):  # E[k] = sum of r^j, j < B, rises with r: bisect
            self.rate = (lo + hi) / 2
            lo, hi = (self.rate, hi) if sum(self.rate**j for j in range(1, block_size)) < mean else (lo, self.rate)
        self.rng = random.Random(seed)

    def __call__(self, seq) -> int:
        if self.dist == "geometric":
            k = 0
            while k < self.block_size - 1 and self.rng.random() < self.rate:
                k += 1
            return k
        return self.low + 1 if self.rng.random() < self.p_high else self.low


def encode_prompts(tokenizer, prompts: Sequence[str], *, chat: bool = True, thinking: bool = False) -> list[list[int]]:
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], enable_thinking=thinking) if chat else p
             for p in prompts]
    return [tokenizer.encode(t) for t in texts]


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _drive(engine, prompt_ids: list[list[int]], params: list[SamplingParams], concurrency: int,
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
            seqs[index] = engine.add_request(ids, params[index])
            in_flight += 1
        prefill = engine.will_prefill()
        step_start = time.perf_counter()
        # no sync after the step: every step waits for the tokens it reads, and a sync would
        # also wait for the AR step queued behind them (Engine.overlap), hiding nothing
        events = engine.step()
        if not prefill:
            decode_s += time.perf_counter() - step_start
            decode_tokens += sum(len(e.new_tokens) for e in events)
        for event in events:
            if event.finished:
                in_flight -= 1
                if progress:
                    progress(1, None)
    _sync(engine.device)
    wall = time.perf_counter() - start
    ordered = [seqs[i] for i in range(len(prompt_ids))]
    return _Run([s.output_ids for s in ordered], [s.stats for s in ordered], wall, decode_tokens, decode_s)


def run_bench(loaded_engine, prompts: Sequence[str], *, dataset: str = "custom",
              concurrencies: Sequence[int] = DEFAULT_CONCURRENCIES, max_tokens: int = 256, chat: bool = True,
              thinking: bool = False, oracle_tau: float | None = None, seed: int = 0,
              progress: Progress | None = None, ar_outputs: dict | None = None,
              prefill_chunk: int | None = None, verify_width: str | None = None,
              oracle_dist: str = "two-point", overlap: bool | None = None, repeat: int = 1,
              max_seq_len: int | None = None, sampling: SamplingParams | None = None) -> list[BenchRow]:
    """One BenchRow per concurrency: AR then DFlash over `prompts` (greedy, or sampled with
    `sampling`'s settings: see the module doc).

    `ar_outputs`, when given, is filled with {concurrency: AR output ids per prompt};
    `prefill_chunk`, `verify_width` and `overlap`, when given, override the engine's. `repeat`:
    that many AR + DFlash pairs on one engine, alternating (runs after the first start from the
    acceptance statistics the earlier ones left, as a warm server does); the row is the pair of
    median speedup, with the range of all, so a change of a few percent can be told from noise.
    The engines hold `max_seq_len` tokens a request (as a server built for that serves), by
    default what the longest prompt and max_tokens need."""
    base, tok = loaded_engine.engine, loaded_engine.tokenizer
    if base.drafter is None:
        raise ConfigError("the benchmark needs an engine with a drafter")
    if not prompts:
        raise ConfigError("no prompts to benchmark")
    if not concurrencies or any(int(c) < 1 for c in concurrencies):
        raise ConfigError(f"concurrencies must be ints >= 1, got {list(concurrencies)}")
    if repeat < 1:
        raise ConfigError(f"repeat must be >= 1, got {repeat}")
    sampled = sampling is not None and not sampling.greedy
    if sampled and oracle_tau is not None:
        raise ConfigError(f"oracle acceptance forces greedy outcomes: temperature = {sampling.temperature:g} needs "
                          "real acceptance (no oracle τ)")
    num_correct = OracleNumCorrect(oracle_tau, base.block_size, seed, oracle_dist) if oracle_tau is not None else None
    prompt_ids = encode_prompts(tok, prompts, chat=chat, thinking=thinking)
    settings = sampling if sampled else SamplingParams()
    params = [replace(settings, max_tokens=max_tokens, seed=seed + i if sampled else None,
                      stop_token_ids=tuple(tok.stop_token_ids)) for i in range(len(prompt_ids))]
    need = max(len(p) for p in prompt_ids) + max_tokens
    if need > base.max_seq_len:
        raise ConfigError(f"the longest prompt ({need - max_tokens} tokens) + max_tokens ({max_tokens}) exceeds the "
                          f"engine's max_seq_len = {base.max_seq_len}")
    if max_seq_len is not None and not need <= max_seq_len <= base.max_seq_len:
        raise ConfigError(f"max_seq_len = {max_seq_len} must hold the longest prompt ({need - max_tokens} tokens) + "
                          f"max_tokens ({max_tokens}) and fit the engine's max_seq_len = {base.max_seq_len}")

    overrides = {k: v for k, v in (("prefill_chunk", prefill_chunk), ("verify_width", verify_width),
                                   ("overlap", overlap)) if v is not None}

    def new_engine(c: int) -> Engine:
        engine = base.sibling(max_batch_size=c, max_seq_len=max_seq_len or need, **overrides)
        engine.warm_up()  # CUDA graph captures stay out of the timings
        return engine

    warm = new_engine(1)  # first-call costs (allocator, kernels) stay out of the timings
    for mode in ("ar", "dflash"):
        warm.generate(prompt_ids[:1], SamplingParams(max_tokens=min(8, max_tokens), ignore_eos=True), mode=mode)
    del warm

    label, rows = mode_label(oracle_tau, oracle_dist, sampling), []
    for c in concurrencies:
        c = int(c)
        engine = new_engine(c)
        pairs = []
        for _ in range(repeat):
            engine.set_mode("ar")
            ar = _drive(engine, prompt_ids, params, c, progress)
            if ar_outputs is not None:
                ar_outputs[c] = ar.outputs
            if progress:
                progress(0, f"{dataset} c={c} AR: {ar.tok_s:.1f} tok/s")
            if num_correct is not None:
                # forced: bf16 near-ties would otherwise steer a random-weight run off its reference
                engine.set_oracle(OracleDrafts({tuple(p): o for p, o in zip(prompt_ids, ar.outputs)}, num_correct,
                                               forced=True))
            engine.set_mode("dflash")
            df = _drive(engine, prompt_ids, params, c, progress)
            pairs.append(_row(dataset, c, label, ar, df, num_correct is None and not sampled, engine.overlap))
            if progress:
                progress(0, f"{dataset} c={c} DFlash: {df.tok_s:.1f} tok/s, τ {pairs[-1].tau_steps:.2f}, verify "
                            f"width {pairs[-1].verify_width:.2f} ({label})")
        del engine
        rows.append(median_run(pairs))
    return rows


def median_run(pairs: list[BenchRow]) -> BenchRow:
    """Of the rows of repeated runs, the one of median speedup (the lower middle one of an even
    count), with how many ran and, for several, their lowest and highest speedup."""
    ranked = sorted(pairs, key=lambda r: r.speedup)
    spread = (ranked[0].speedup, ranked[-1].speedup) if len(ranked) > 1 else None
    return replace(ranked[(len(ranked) - 1) // 2], runs=len(ranked), speedup_range=spread)


def _row(dataset: str, c: int, label: str, ar: _Run, df: _Run, comparable: bool, overlap: bool) -> BenchRow:
    """The row of one AR run and one DFlash run over the same prompts; `comparable`: whether
    DFlash should have written AR's tokens (real acceptance, greedy)."""
    per_request = [s.mean_acceptance_length for s in df.stats if s.verify_steps]
    steps = sum(s.verify_steps for s in df.stats)
    ttft = [s.ttft_s for s in df.stats if s.ttft_s is not None]
    return BenchRow(
        dataset=dataset, concurrency=c, mode_label=label, ar_tok_s=ar.tok_s, dflash_tok_s=df.tok_s,
        speedup=df.tok_s / ar.tok_s if ar.tok_s else 0.0,
        tau_per_request=sum(per_request) / len(per_request) if per_request else 0.0,
        tau_steps=sum(sum(s.acceptance_lengths) for s in df.stats) / steps if steps else 0.0,
        ar_decode_tok_s=ar.decode_tok_s, dflash_decode_tok_s=df.decode_tok_s,
        ttft_p50_s=percentile(ttft, 50), ttft_p99_s=percentile(ttft, 99),
        # forced oracle outputs equal AR by construction (not a measurement); sampled ones need not
        identical_share=sum(a == d for a, d in zip(ar.outputs, df.outputs)) / len(ar.outputs) if comparable else None,
        num_prompts=len(ar.outputs),
        verify_width=(sum(s.verified_drafts + s.verify_steps for s in df.stats) / steps if steps else 0.0),
        ar_overlap=overlap,
    )


def format_table(rows: Sequence[BenchRow]) -> str:
    """A markdown table shaped like the DFlash model cards' (end-to-end first, then decode-only)."""
    header = ["Dataset", "Concurrency", "AR tok/s", "DFlash tok/s", "Speedup", "τ",
              "AR decode tok/s", "DFlash decode tok/s", "Decode speedup", "TTFT p50 / p99 (ms)",
              "Identical", "Prompts", "Verify width", "Mode"]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for r in rows:
        speedup = f"{r.speedup:.2f}x" + (f" ({r.speedup_range[0]:.2f}-{r.speedup_range[1]:.2f}x, {r.runs} runs)"
                                         if r.speedup_range else "")
        cells = [r.dataset, str(r.concurrency), f"{r.ar_tok_s:.1f}", f"{r.dflash_tok_s:.1f}", speedup,
                 f"{r.tau_steps:.2f}", f"{r.ar_decode_tok_s:.1f}", f"{r.dflash_decode_tok_s:.1f}",
                 f"{r.decode_speedup:.2f}x", f"{r.ttft_p50_s * 1e3:.1f} / {r.ttft_p99_s * 1e3:.1f}",
                 "n/a" if r.identical_share is None else f"{r.identical_share:.0%}", str(r.num_prompts),
                 f"{r.verify_width:.2f}", r.mode_label]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def rows_to_json(rows: Sequence[BenchRow], **meta) -> str:
    """JSON text: {"meta": {...}, "rows": [each BenchRow's fields + decode_speedup]}."""
    return json.dumps({"meta": meta, "rows": [{**asdict(r), "decode_speedup": r.decode_speedup} for r in rows]},
                      indent=2, ensure_ascii=False)


# -- transformers baseline, Triton rows, the whole report ---------------------------------------


@dataclass(frozen=True)
class TransformersRow:
    dataset: str
    concurrency: int  # always 1: transformers generates one prompt at a time
    mode_label: str  # of the in-process DFlash numbers it is compared with
    transformers_tok_s: float  # generate, static cache, greedy, prefill included
    ar_tok_s: float | None  # in-process at concurrency 1; None when 1 was not benchmarked
    dflash_tok_s: float | None
    identical_share: float | None  # prompts whose transformers output equals our AR output
    num_prompts: int

    @property
    def ar_speedup(self) -> float | None:
        return self.ar_tok_s / self.transformers_tok_s if self.ar_tok_s and self.transformers_tok_s else None

    @property
    def dflash_speedup(self) -> float | None:
        return self.dflash_tok_s / self.transformers_tok_s if self.dflash_tok_s and self.transformers_tok_s else None


def run_transformers(loaded_engine, hf_model, prompts: Sequence[str], *, dataset: str = "custom",
                     max_tokens: int = 256, chat: bool = True, thinking: bool = False,
                     in_process: BenchRow | None = None, ar_outputs: list[list[int]] | None = None,
                     progress: Progress | None = None) -> TransformersRow:
    """transformers generate over `prompts` (same stop tokens and max_tokens as run_bench),
    compared with the in-process row and AR outputs at concurrency 1 when given."""
    tok = loaded_engine.tokenizer
    prompt_ids = encode_prompts(tok, prompts, chat=chat, thinking=thinking)
    kw = dict(eos_token_ids=tuple(tok.stop_token_ids), max_cache_len=max(map(len, prompt_ids)) + max_tokens)
    generate_tok_s(hf_model, prompt_ids[:1], min(8, max_tokens), **kw)  # warm-up (and compile, on CUDA)
    outputs, tok_s = generate_tok_s(hf_model, prompt_ids, max_tokens, **kw)
    if progress:
        progress(len(prompt_ids), f"{dataset} c=1 transformers: {tok_s:.1f} tok/s")
    return TransformersRow(
        dataset=dataset, concurrency=1, mode_label=in_process.mode_label if in_process else "",
        transformers_tok_s=tok_s, ar_tok_s=in_process.ar_tok_s if in_process else None,
        dflash_tok_s=in_process.dflash_tok_s if in_process else None,
        identical_share=(sum(a == h for a, h in zip(ar_outputs, outputs)) / len(outputs)
                         if ar_outputs is not None else None),
        num_prompts=len(prompt_ids),
    )


def format_transformers_table(rows: Sequence[TransformersRow]) -> str:
    """A markdown table: transformers generate vs our AR and DFlash at concurrency 1."""
    header = ["Dataset", "Concurrency", "transformers tok/s", "AR tok/s", "DFlash tok/s", "AR / transformers",
              "DFlash / transformers", "Identical to AR", "Prompts", "Mode"]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    na = "n/a"
    for r in rows:
        mode = "transformers generate (static cache, greedy)" + (f"; DFlash {r.mode_label}" if r.mode_label else "")
        cells = [r.dataset, str(r.concurrency), f"{r.transformers_tok_s:.1f}",
                 f"{r.ar_tok_s:.1f}" if r.ar_tok_s is not None else na,
                 f"{r.dflash_tok_s:.1f}" if r.dflash_tok_s is not None else na,
                 f"{r.ar_speedup:.2f}x" if r.ar_speedup is not None else na,
                 f"{r.dflash_speedup:.2f}x" if r.dflash_speedup is not None else na,
                 f"{r.identical_share:.0%}" if r.identical_share is not None else na, str(r.num_prompts), mode]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


@dataclass
class Report:
    rows: list[BenchRow] = field(default_factory=list)  # in-process
    transformers_rows: list[TransformersRow] = field(default_factory=list)
    triton_rows: list[TritonRow] = field(default_factory=list)
    stall_rows: list[StallRow] = field(default_factory=list)


def run_report(loaded_engine, datasets: Sequence[str], *, urls: Sequence[str] = (),
               concurrencies: Sequence[int] = DEFAULT_CONCURRENCIES, num_prompts: int = 32, max_tokens: int = 256,
               chat: bool = True, thinking: bool = False, oracle_tau: float | None = None,
               compare_transformers: bool = False, progress: Progress | None = None,
               prefill_chunk: int | None = None, stall_prompt: int = 0, verify_width: str | None = None,
               oracle_dist: str = "two-point", overlap: bool | None = None, repeat: int = 1,
               max_seq_len: int | None = None, sampling: SamplingParams | None = None) -> Report:
    """Per dataset: in-process rows (with an engine), the transformers row (if asked), and rows
    through each server URL (Triton's gRPC host:port, or the OpenAI API's http:// address), all
    over the same prompts. `stall_prompt` N > 0 runs prefill_stall.py's test instead (a prompt of
    N tokens arriving while `concurrency` requests decode, in AR and DFlash mode, in one pass and
    in chunks of `prefill_chunk`). `sampling` (temperature > 0) samples the in-process rows and
    the servers' alike; the transformers baseline and the stall test are greedy, so they refuse it."""
    if sampling is not None and not sampling.greedy and (stall_prompt or compare_transformers):
        raise ConfigError(f"temperature = {sampling.temperature:g} is for the throughput rows (in-process and "
                          "through servers): not with a stall prompt or the transformers baseline")
    if stall_prompt:
        return _stall_report(loaded_engine, datasets, concurrencies, num_prompts, max_tokens, chat, thinking,
                             prefill_chunk, stall_prompt, progress)
    if loaded_engine is None and (not urls or compare_transformers or oracle_tau is not None):
        raise ConfigError("an in-process engine is needed for in-process rows, oracle τ and the transformers "
                          "baseline; only --url rows can run without one")
    for url in urls:
        loadgen.check_server(url)  # fail before the in-process runs, not after them
    hf_model = None
    if compare_transformers:
        hf_model = to_transformers(loaded_engine.engine.target)
    report = Report()
    for name in datasets:
        prompts, label = load_prompts(name, num_prompts), dataset_label(name)
        rows, ar_outputs = [], {}
        if loaded_engine is not None:
            rows = run_bench(loaded_engine, prompts, dataset=label, concurrencies=concurrencies,
                             max_tokens=max_tokens, chat=chat, thinking=thinking, oracle_tau=oracle_tau,
                             progress=progress, ar_outputs=ar_outputs, prefill_chunk=prefill_chunk,
                             verify_width=verify_width, oracle_dist=oracle_dist, overlap=overlap,
                             repeat=repeat, max_seq_len=max_seq_len, sampling=sampling)
            report.rows += rows
        if hf_model is not None:
            at_1 = next((r for r in rows if r.concurrency == 1), None)
            report.transformers_rows.append(run_transformers(
                loaded_engine, hf_model, prompts, dataset=label, max_tokens=max_tokens, chat=chat,
                thinking=thinking, in_process=at_1, ar_outputs=ar_outputs.get(1), progress=progress))
        for url in urls:
            report.triton_rows += loadgen.run_triton_bench(url, prompts, dataset=label, concurrencies=concurrencies,
                                                           max_tokens=max_tokens, chat=chat, thinking=thinking,
                                                           progress=progress, sampling=sampling)
    return report


def _stall_report(loaded_engine, datasets, concurrencies, num_prompts, max_tokens, chat, thinking, prefill_chunk,
                  stall_prompt, progress) -> Report:
    if loaded_engine is None:
        raise ConfigError("the stall test runs in-process: give OUTPUT_DIR or --random-weights")
    if not prefill_chunk:
        raise ConfigError("the stall test compares one-pass prefill with chunks: give the chunk size "
                          "(--prefill-chunk-size N)")
    report = Report()
    for name in datasets:
        prompt_ids = encode_prompts(loaded_engine.tokenizer, load_prompts(name, num_prompts), chat=chat,
                                    thinking=thinking)
        for c in concurrencies:
            for mode in ("ar", "dflash"):
                rows = run_stall(loaded_engine.engine, prompt_ids, long_tokens=stall_prompt, concurrency=int(c),
                                 chunks=(0, prefill_chunk), max_tokens=max_tokens, mode=mode)
                report.stall_rows += rows
                if progress:
                    for r in rows:
                        progress(0, f"stall {mode} c={c} chunk={r.prefill_chunk}: gap p99 {r.gap_p99_s * 1e3:.1f} ms")
    return report


def serving_overhead(report: Report) -> list[dict]:
    """Per Triton row with an in-process row of the same dataset and concurrency: Triton tok/s
    over in-process tok/s of the mode the server ran (DFlash, or AR for an AR server)."""
    local = {(r.dataset, r.concurrency): r for r in report.rows}
    out = []
    for t in report.triton_rows:
        r = local.get((t.dataset, t.concurrency))
        if r is None:
            continue
        dflash = t.mode_label.startswith("DFlash")
        tok_s = r.dflash_tok_s if dflash else r.ar_tok_s
        out.append({"dataset": t.dataset, "concurrency": t.concurrency, "path": loadgen.path_name(t.url),
                    "triton_tok_s": t.tok_s,
                    "triton_mode": t.mode_label, "in_process_tok_s": tok_s,
                    "in_process_mode": f"DFlash in-process ({r.mode_label})" if dflash else "AR in-process",
                    "ratio": t.tok_s / tok_s if tok_s else 0.0,
                    "triton_tau": t.tau, "in_process_tau": r.tau_per_request if dflash else 0.0,
                    "like_for_like": not dflash or r.mode_label.startswith(mode_label(None))})
    return out


def format_overhead(entries: Sequence[dict]) -> str:
    lines = []
    for e in entries:
        line = (f"serving overhead {e['dataset']} c={e['concurrency']}: {e['triton_tok_s']:.1f} tok/s "
                f"{e['triton_mode']} / {e['in_process_tok_s']:.1f} tok/s {e['in_process_mode']} = {e['ratio']:.2f}x")
        if e["in_process_tau"]:
            line += f"; τ per request {e['triton_tau']:.2f} through {e['path']} vs {e['in_process_tau']:.2f} in-process"
        if not e["like_for_like"]:
            line += " (in-process τ is an oracle's: not a like-for-like ratio)"
        lines.append(line)
    return "\n".join(lines)


def format_report(report: Report) -> str:
    """The in-process table, the transformers table, the Triton table and the overhead lines
    (each only when there is something to show), separated by blank lines."""
    parts = [format_table(report.rows) if report.rows else "",
             format_transformers_table(report.transformers_rows) if report.transformers_rows else "",
             format_triton_table(report.triton_rows) if report.triton_rows else "",
             format_stall_table(report.stall_rows) if report.stall_rows else "",
             format_overhead(serving_overhead(report))]
    return "\n\n".join(part for part in parts if part)


def device_name(loaded) -> str | None:
    """The GPU an in-process engine ran on, for the JSON record (None on the CPU or with --url only)."""
    device = loaded.engine.device if loaded is not None else None
    return torch.cuda.get_device_name(device) if device is not None and device.type == "cuda" else None


def report_to_json(report: Report, **meta) -> str:
    """rows_to_json's shape plus transformers_rows, triton_rows and serving_overhead."""
    data = json.loads(rows_to_json(report.rows, **meta))
    data["transformers_rows"] = [{**asdict(r), "ar_speedup": r.ar_speedup, "dflash_speedup": r.dflash_speedup}
                                 for r in report.transformers_rows]
    data["triton_rows"] = [asdict(r) for r in report.triton_rows]
    data["serving_overhead"] = serving_overhead(report)
    data["stall_rows"] = [asdict(r) for r in report.stall_rows]
    return json.dumps(data, indent=2, ensure_ascii=False)
