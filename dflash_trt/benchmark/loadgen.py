"""A closed-loop load generator for a running Triton server: `dflash-trt bench --url`.

At concurrency c, c worker threads each hold one gRPC stream to the `ensemble` model (or,
for an http:// URL, one connection to the OpenAI-compatible API that `serve` starts) and
send their next prompt as soon as the previous one has finished, so exactly c requests are
in flight until the prompts run out. Requests are greedy (with `sampling`'s temperature, top-k
and top-p, prompt i samples with seed `seed` + i, as the in-process rows do), streamed (the
first response that carries text gives the TTFT) and ask for the perf outputs, so the final
response reports `num_output_tokens` and `mean_acceptance_length`.

What the numbers mean:
- the client sends text; tokenization and the chat template happen on the server;
- token counts come from the server's `num_output_tokens`, which (as in TensorRT-LLM) leaves
  out the end token: the in-process rows count it, at most one token per request more;
- generation stops where the server's own stop tokens say (the tokenizer's eos ids; no
  `end_id` or `stop_words` are sent): Triton has no ignore_eos, and the in-process bench
  stops at the same tokens, so both produce the same greedy outputs;
- the server runs one mode (its engine decides AR or DFlash); a row says "DFlash" when the
  server reported draft tokens, "AR" otherwise, and always "through Triton";
- a server built with max_batch_size below c queues the excess requests in its engine, while
  the in-process rows give each of the c requests a slot: compare at c <= max_batch_size.

This module imports neither torch nor the engine: it needs only tritonclient.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from dflash_trt.serving import protocol as p
from dflash_trt.serving.client import ClientError, Completion, GrpcStream, OpenAIStream

if TYPE_CHECKING:  # only its fields are read here; the client side needs no torch
    from dflash_trt.sampling import SamplingParams

RESPONSE_TIMEOUT_S = 600.0  # longest wait for one response before the run is given up

# progress(requests_finished, message), as in bench.py
Progress = Callable[[int, "str | None"], None]


@dataclass(frozen=True)
class RequestResult:
    index: int  # of the prompt
    text: str
    ttft_s: float  # send -> first response carrying text
    latency_s: float  # send -> final response
    metrics: dict  # the final response's perf outputs (protocol.PERF_OUTPUTS names)

    @property
    def num_output_tokens(self) -> int:
        return int(self.metrics[p.NUM_OUTPUT_TOKENS])

    @property
    def speculative(self) -> bool:
        return self.metrics.get(p.TOTAL_DRAFT_TOKENS, 0) > 0

    @property
    def itl_s(self) -> float | None:
        """Inter-token latency as AIPerf defines it: the time after the first response over the
        tokens after the first (DFlash sends several tokens per response)."""
        n = self.num_output_tokens
        return (self.latency_s - self.ttft_s) / (n - 1) if n > 1 else None


@dataclass(frozen=True)
class LoadRun:
    url: str
    concurrency: int
    results: list[RequestResult]  # in prompt order
    wall_s: float
    sampling: SamplingParams | None = None  # the settings every request sampled with; None: greedy

    @property
    def output_tokens(self) -> int:
        return sum(r.num_output_tokens for r in self.results)


@dataclass(frozen=True)
class TritonRow:
    url: str  # the server's gRPC host:port, or the OpenAI API's http:// address
    dataset: str
    concurrency: int
    mode_label: str  # "DFlash through Triton (real acceptance)" or "AR through Triton"
    tok_s: float  # all num_output_tokens / wall time of the run
    requests_s: float
    tau: float  # mean over requests of the server's mean_acceptance_length (0 for AR)
    ttft_p50_s: float
    ttft_p99_s: float
    itl_p50_s: float
    latency_p50_s: float
    output_tokens: int  # as counted by the server
    num_prompts: int


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return 0.0
    return float(np.percentile(np.asarray(values, dtype=float), q))


def is_openai(url: str) -> bool:
    """An http(s):// URL is the OpenAI API; anything else a gRPC host:port."""
    return url.startswith(("http://", "https://"))


def path_name(url: str) -> str:
    return "the OpenAI API" if is_openai(url) else "Triton"


def triton_mode_label(speculative: bool, url: str, sampling: SamplingParams | None = None) -> str:
    # The server cannot run oracle acceptance: its drafts are always the drafter's own.
    path, sampled = path_name(url), sampling_label(sampling)
    return f"DFlash through {path} (real acceptance{sampled})" if speculative else f"AR through {path}{sampled}"


def sampling_label(sampling: SamplingParams | None) -> str:
    """What a row's requests sampled with, as its mode label says it ('' for greedy)."""
    if sampling is None or sampling.greedy:
        return ""
    return (f", T={sampling.temperature:g}" + (f", top-k {sampling.top_k}" if sampling.top_k else "")
            + (f", top-p {sampling.top_p:g}" if sampling.top_p < 1 else ""))


def _connect(url: str):
    return OpenAIStream(url) if is_openai(url) else GrpcStream(url)


def check_server(url: str, timeout_s: float = 10.0) -> None:
    """Raise ClientError naming `url` unless a Triton server there has the ensemble ready (or,
    for an http:// URL, the OpenAI API answers)."""
    if is_openai(url):
        with OpenAIStream(url) as api:
            api.models(timeout_s)
        return
    import tritonclient.grpc as grpcclient  # optional (the serve extra): only --url runs need it
    from tritonclient.utils import InferenceServerException

    try:
        with grpcclient.InferenceServerClient(url) as client:
            if not client.is_server_live(client_timeout=timeout_s):
                raise ClientError(f"{url}: the Triton server is not live")
            if not client.is_model_ready(p.ENSEMBLE, client_timeout=timeout_s):
                raise ClientError(f"{url}: the server has no ready '{p.ENSEMBLE}' model; is it a dflash-trt server?")
    except InferenceServerException as e:
        raise ClientError(f"{url}: cannot reach a Triton server over gRPC ({e})") from None


def _request(connection: GrpcStream | OpenAIStream, index: int, prompt: str, options: dict) -> RequestResult:
    completion = Completion()
    start = time.perf_counter()
    first = None
    for _ in connection.generate(prompt, stream=True, completion=completion, timeout_s=RESPONSE_TIMEOUT_S,
                                 **options):
        first = first if first is not None else time.perf_counter()
    end = time.perf_counter()
    if p.NUM_OUTPUT_TOKENS not in completion.metrics:
        raise ClientError(f"{connection.url}: the final response has no '{p.NUM_OUTPUT_TOKENS}' output "
                          f"(the server ignored {p.RETURN_PERF_METRICS}=true)")
    return RequestResult(index, completion.text, (first if first is not None else end) - start, end - start,
                         dict(completion.metrics))


def closed_loop(url: str, prompts: Sequence[str], concurrency: int, *, max_tokens: int, chat: bool = True,
                thinking: bool = False, progress: Progress | None = None, sampling: SamplingParams | None = None,
                seed: int = 0) -> LoadRun:
    """Send every prompt once with `concurrency` closed-loop workers; results in prompt order."""
    from tritonclient.utils import InferenceServerException  # optional (the serve extra)

    if concurrency < 1:
        raise ClientError(f"concurrency must be >= 1, got {concurrency}")
    sampled = sampling is not None and not sampling.greedy
    options = dict(max_tokens=max_tokens, temperature=sampling.temperature if sampled else 0.0,
                   top_k=sampling.top_k if sampled else 0, top_p=sampling.top_p if sampled else 1.0, chat=chat,
                   thinking=thinking, stats=True)
    todo: queue.SimpleQueue[int] = queue.SimpleQueue()
    for i in range(len(prompts)):
        todo.put(i)
    results: dict[int, RequestResult] = {}
    errors: list[BaseException] = []
    failed = threading.Event()
    progress_lock = threading.Lock()  # progress (a click progress bar) is not thread-safe

    def worker(connection: GrpcStream | OpenAIStream) -> None:
        try:
            while not failed.is_set():
                try:
                    index = todo.get_nowait()
                except queue.Empty:
                    return
                results[index] = _request(connection, index, prompts[index],
                                          {**options, "seed": seed + index if sampled else None})
                if progress:
                    with progress_lock:
                        progress(1, None)
        except InferenceServerException as e:
            errors.append(ClientError(f"{url}: {e}"))
            failed.set()
        except BaseException as e:  # reported by the caller's thread
            errors.append(e)
            failed.set()

    connections: list[GrpcStream | OpenAIStream] = []
    try:
        try:  # streams open before the clock starts
            for _ in range(min(concurrency, len(prompts))):
                connections.append(_connect(url))
        except InferenceServerException as e:
            raise ClientError(f"{url}: {e}") from None
        threads = [threading.Thread(target=worker, args=(c,), name=f"loadgen-{i}", daemon=True)
                   for i, c in enumerate(connections)]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - start
    finally:
        for connection in connections:
            connection.close()
    if errors:
        raise errors[0]
    return LoadRun(url, concurrency, [results[i] for i in range(len(prompts))], wall, sampling if sampled else None)


def row(run: LoadRun, dataset: str) -> TritonRow:
    ttft = [r.ttft_s for r in run.results]
    taus = [r.metrics.get(p.MEAN_ACCEPTANCE_LENGTH, 0.0) for r in run.results if r.speculative]
    n = len(run.results)
    return TritonRow(
        url=run.url, dataset=dataset, concurrency=run.concurrency,
        mode_label=triton_mode_label(any(r.speculative for r in run.results), run.url, run.sampling),
        tok_s=run.output_tokens / run.wall_s if run.wall_s > 0 else 0.0,
        requests_s=n / run.wall_s if run.wall_s > 0 else 0.0,
        tau=sum(taus) / len(taus) if taus else 0.0,
        ttft_p50_s=percentile(ttft, 50), ttft_p99_s=percentile(ttft, 99),
        itl_p50_s=percentile([r.itl_s for r in run.results if r.itl_s is not None], 50),
        latency_p50_s=percentile([r.latency_s for r in run.results], 50),
        output_tokens=run.output_tokens, num_prompts=n,
    )


def run_triton_bench(url: str, prompts: Sequence[str], *, dataset: str = "custom",
                     concurrencies: Sequence[int] = (1, 8, 16, 32), max_tokens: int = 256, chat: bool = True,
                     thinking: bool = False, progress: Progress | None = None,
                     sampling: SamplingParams | None = None) -> list[TritonRow]:
    """One TritonRow per concurrency, measured through the server at `url` (see the module doc)."""
    if not prompts:
        raise ClientError("no prompts to benchmark")
    check_server(url)
    # One short request first: the server's first-call costs stay out of the timings.
    closed_loop(url, prompts[:1], 1, max_tokens=min(8, max_tokens), chat=chat, thinking=thinking)
    rows = []
    for c in concurrencies:
        run = closed_loop(url, prompts, int(c), max_tokens=max_tokens, chat=chat, thinking=thinking,
                          progress=progress, sampling=sampling)
        rows.append(row(run, dataset))
        if progress:
            progress(0, f"{dataset} c={c}: {rows[-1].tok_s:.1f} tok/s, {rows[-1].mode_label}")
    return rows


def format_triton_table(rows: Sequence[TritonRow]) -> str:
    """A markdown table of rows measured through Triton (client side, end to end)."""
    header = ["Dataset", "Concurrency", "Output tok/s", "Requests/s", "τ", "TTFT p50 / p99 (ms)", "ITL p50 (ms)",
              "Latency p50 (ms)", "Output tokens", "Prompts", "Mode"]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for r in rows:
        cells = [r.dataset, str(r.concurrency), f"{r.tok_s:.1f}", f"{r.requests_s:.2f}", f"{r.tau:.2f}",
                 f"{r.ttft_p50_s * 1e3:.1f} / {r.ttft_p99_s * 1e3:.1f}", f"{r.itl_p50_s * 1e3:.2f}",
                 f"{r.latency_p50_s * 1e3:.1f}",
                 str(r.output_tokens), str(r.num_prompts), r.mode_label]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
