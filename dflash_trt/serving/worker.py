"""The engine worker behind the `dflash` Triton model, free of Triton so it is unit-tested
without it.

`EngineWorker` is one thread owning the Engine. Requests join between steps (continuous
batching); every step's new tokens go to a second thread that turns them into text and
sends them through the request's `Sink`, so the engine never waits for a response to
leave; cancelled requests are aborted; a failing step fails its requests, not the thread.

Detokenization happens here, in the dflash model's sender thread, not in postprocessing:
a correct incremental detokenizer needs per-request state across a stream's responses (where
the last chunk ended), and ensemble postprocessing executions are independent (any instance,
any batch, no request identity). Decoding the few new tokens of a step costs microseconds,
and the stop-word and end-token bookkeeping that decides the text lives here anyway.
Postprocessing therefore only maps the text and the perf metrics onto the ensemble outputs.

Output semantics follow the Triton TensorRT-LLM backend:
- the end token (eos, or the request's `end_id`) is not part of the output; a stop word is;
- `exclude_input_in_output=false` (the default) prefixes the non-streamed text with the prompt
  (the prompt and output ids are decoded together); streaming never repeats the prompt;
- `pad_id` is accepted and ignored: every response carries one unpadded string;
- stop words match token sequences (as tokenized alone by preprocessing), like TensorRT-LLM's;
- `bad_words` is refused (the engine has no logit masking yet), as are requests of batch > 1.

Cancellation: a request whose client cancels is aborted between steps. Triton 2.51 does not
pass the cancellation of an *ensemble* request on to its running dflash request, so only
direct dflash calls are aborted early; an abandoned ensemble stream generates to its end.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol

import numpy as np

from dflash_trt.errors import RequestError
from dflash_trt.loading import load_engine
from dflash_trt.sampling import SamplingParams
from dflash_trt.serving import protocol as p
from dflash_trt.serving.text import IncrementalDetokenizer

SHUTTING_DOWN = "the server is shutting down"  # what a request refused or cut by a shutdown gets


def stop_cut(output: list[int], new: list[int], stop_words: tuple[tuple[int, ...], ...]) -> int | None:
    """How many of `new` to keep so that output + kept ends with the first completed stop word;
    None if no stop word completes inside `new`."""
    if not stop_words:
        return None
    context = output[max(0, len(output) - (max(map(len, stop_words)) - 1)):]  # where a word may begin
    seq = context + list(new)
    for i in range(len(new)):
        end = len(context) + i + 1
        if any(end >= len(w) and tuple(seq[end - len(w): end]) == w for w in stop_words):
            return i + 1
    return None


def perf_metrics(stats, block_size: int, num_output_tokens: int) -> dict[str, float | int]:
    """Speculation statistics of one request, under the ensemble's output names.

    A verify step checks block_size - 1 drafts (fewer at an adaptive width: verified_drafts);
    acceptance_lengths holds accepted + 1."""
    accepted = sum(length - 1 for length in stats.acceptance_lengths)
    drafted = stats.verified_drafts
    return {
        p.ACCEPTANCE_RATE: accepted / drafted if drafted else 0.0,
        p.TOTAL_ACCEPTED_DRAFT_TOKENS: accepted,
        p.TOTAL_DRAFT_TOKENS: drafted,
        p.NUM_INPUT_TOKENS: stats.prompt_tokens,
        p.NUM_OUTPUT_TOKENS: num_output_tokens,
        p.MEAN_ACCEPTANCE_LENGTH: stats.mean_acceptance_length,
    }


# -- responses --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Chunk:
    """One response of the dflash model; `final` marks the last one of its request."""

    text: str
    final: bool
    metrics: dict | None = None

    def to_arrays(self) -> dict[str, np.ndarray]:
        arrays = {p.OUTPUT_TEXT: np.array([[self.text.encode("utf-8")]], dtype=np.object_)}
        dtypes = {s.name: p.NUMPY_DTYPES[s.dtype] for s in p.PERF_OUTPUTS}
        for name, value in (self.metrics or {}).items():
            arrays[p.PERF_INTERNAL[name]] = np.array([[value]], dtype=dtypes[name])
        return arrays


class Sink(Protocol):
    """Where one request's responses go (the Triton response sender, in the dflash model)."""

    def send(self, chunk: Chunk) -> None: ...

    def fail(self, message: str, client_error: bool = False) -> None: ...  # an error response; ends the request

    def cancel(self) -> None: ...  # acknowledge a cancellation: end the request

    def is_cancelled(self) -> bool: ...


# -- the engine thread ------------------------------------------------------------------------


@dataclass(eq=False)
class _Job:
    request: p.Request
    sink: Sink
    params: object  # SamplingParams
    detok: IncrementalDetokenizer  # used by the sender thread only
    seq: object = None  # the engine's Sequence once admitted
    output_ids: list[int] = field(default_factory=list)  # what the client gets: end token dropped, stop-cut
    # Set by the engine thread once the job leaves it (finished, failed, aborted): the sender
    # stops polling it for cancellation.
    done: bool = False
    # Set by the sender thread: its client is gone (later responses are dropped) or cancelled
    # (no more polling); either way the engine thread aborts it.
    send_failed: bool = False
    cancel_seen: bool = False


_WATCH = object()  # an outbox action: poll this request for cancellation from now on


def _log(message: str) -> None:
    print(f"[dflash-trt] {message}", file=sys.stderr, flush=True)


class EngineWorker:
    """Owns an Engine, the one thread that steps it and the one thread that sends responses;
    `submit` may be called from any thread.

    Every sink call goes through the sender's FIFO, so a request's responses keep their order
    and its final response is its last. Sending is a round trip to the Triton process (and
    the text is decoded there too); on the engine thread it would idle the GPU every step.
    So is asking whether a client cancelled: the sender polls that too, and tells the engine
    thread which requests to abort. Both calls release the GIL while they wait on Triton
    (python_backend r24.10: ResponseSender::Send, PbCancel::IsCancelled), so the engine thread
    keeps stepping meanwhile.
    """

    def __init__(self, engine, tokenizer, limits: p.Limits, *, idle_wait_s: float = 0.05,
                 cancel_check_s: float = 0.02, metrics=None):
        self.engine, self.tokenizer, self.limits = engine, tokenizer, limits
        # serving.metrics.TritonMetrics or None; its calls are round trips to the Triton process,
        # so they go through the sender thread like responses do
        self.metrics = metrics
        self._engine_state = None  # the last (running, waiting, slots used) the gauges were given
        self._idle_wait_s = idle_wait_s
        # is_cancelled() is a round trip to the Triton process per request: poll, don't spin.
        self._cancel_check_s = cancel_check_s
        self._inbox: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._outbox: queue.SimpleQueue[tuple[_Job, object] | None] = queue.SimpleQueue()
        self._dropped: queue.SimpleQueue[_Job] = queue.SimpleQueue()  # sender -> engine thread: abort these
        self._jobs: dict[object, _Job] = {}  # Sequence -> job, admitted requests only
        self._stopping = threading.Event()
        self._closed = False  # set once the inbox is drained for good; guarded by _lock
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="dflash-engine", daemon=True)
        self._sender = threading.Thread(target=self._send_loop, name="dflash-sender", daemon=True)
        self._sender.start()
        self._thread.start()

    @classmethod
    def load(cls, engine_dir: Path, device: str | None = None, metrics=None, draft_window: int | None = None,
             tensor_parallel: int | None = None) -> "EngineWorker":
        """`metrics`: a callable block_size -> metrics object (see serving.metrics), or None;
        `draft_window`, `tensor_parallel`: override the build's (load_engine)."""
        loaded = load_engine(engine_dir, device, draft_window, tensor_parallel)
        loaded.engine.warm_up()  # CUDA graphs captured before the first request, not during it
        limits = p.Limits(max_input_len=loaded.config.max_input_len, max_output_len=loaded.config.max_output_len)
        return cls(loaded.engine, loaded.tokenizer, limits, metrics=metrics and metrics(loaded.engine.block_size))

    def submit(self, request: p.Request, sink: Sink) -> None:
        """Validate (raising RequestValidationError here, in the caller's thread) and enqueue."""
        request.validate(self.limits, self.engine.target.config.vocab_size)
        job = _Job(request, sink, self._sampling_params(request), IncrementalDetokenizer(self.tokenizer.decode))
        with self._lock:
            if self._closed or self._stopping.is_set():
                raise p.RequestValidationError(SHUTTING_DOWN)
            self._inbox.put(job)

    def _sampling_params(self, request: p.Request):
        if request.end_id is None:
            stop, ignore_eos = tuple(self.tokenizer.stop_token_ids), False
        else:  # end_id replaces the eos, as in TensorRT-LLM
            stop, ignore_eos = (request.end_id,), True
        try:
            return SamplingParams(max_tokens=request.max_tokens, temperature=request.temperature,
                                  top_k=request.top_k, top_p=request.top_p, seed=request.seed,
                                  stop_token_ids=stop, ignore_eos=ignore_eos)
        except RequestError as e:
            raise p.RequestValidationError(str(e)) from None

    def stop(self, timeout: float | None = 30.0) -> None:
        """Stop the thread; requests still in flight get an error response."""
        self._stopping.set()
        self._inbox.put(None)  # wake an idle thread
        self._thread.join(timeout)
        self._sender.join(timeout)  # the engine thread's shutdown ends the sender's queue

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self._sender.is_alive()

    @property
    def num_active(self) -> int:
        return len(self._jobs)

    # -- loop -------------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                self._admit(wait=not self._jobs)
                self._drop_cancelled()
                if self._jobs:
                    self._step()
                self._report_engine_state()
            except Exception:  # a bug in this loop must not silently end serving
                _log(f"engine loop error:\n{traceback.format_exc()}")
                self._fail_jobs(list(self._jobs.values()), "internal error in the engine loop")
        self._shutdown()

    def _admit(self, wait: bool) -> None:
        try:
            job = self._inbox.get(timeout=self._idle_wait_s) if wait else self._inbox.get_nowait()
            while True:
                if job is not None:
                    self._add(job)
                job = self._inbox.get_nowait()
        except queue.Empty:
            pass

    def _add(self, job: _Job) -> None:
        try:
            job.seq = self.engine.add_request(list(job.request.prompt_ids), job.params)
        except RequestError as e:
            message = str(e)
            self._post(job, lambda: job.sink.fail(message, client_error=True))
            return
        self._jobs[job.seq] = job
        self._outbox.put((job, _WATCH))

    def _remove(self, job: _Job) -> None:
        if self._jobs.pop(job.seq, None) is not None and self.metrics is not None:
            stats, num_output = job.seq.stats, len(job.output_ids)
            self._outbox.put((None, lambda: self.metrics.request_ended(stats, num_output)))
        job.done = True

    def _report_engine_state(self) -> None:
        if self.metrics is None:
            return
        engine = self.engine
        # a request whose prompt is still being prefilled in chunks is running: it holds a slot
        state = (len(engine.running) + len(engine.prefilling), len(engine.waiting),
                 engine.max_batch_size - len(engine.free_slots))
        if state != self._engine_state:  # the gauges change at admissions and ends, not every step
            self._engine_state = state
            self._outbox.put((None, lambda: self.metrics.engine_state(*state)))

    def _drop_cancelled(self) -> None:
        """Abort the requests the sender found cancelled by their client, or unreachable."""
        while True:
            try:
                job = self._dropped.get_nowait()
            except queue.Empty:
                return
            if job.seq not in self._jobs:
                continue  # it ended meanwhile
            self._remove(job)
            self.engine.abort(job.seq)
            if job.cancel_seen:
                _log(f"request {job.seq.request_id} was cancelled by its client; its sequence is aborted")
                self._post(job, job.sink.cancel)

    def _step(self) -> None:
        try:
            events = self.engine.step()
        except Exception as e:
            # A failed batched forward may have half-written the cache rows of every sequence
            # holding a slot: fail those; requests still waiting for a slot are unaffected.
            _log(f"engine step failed:\n{traceback.format_exc()}")
            self._fail_jobs([j for j in self._jobs.values() if j.seq.slot >= 0], f"generation failed: {e!r}")
            return
        for event in events:
            job = self._jobs.get(event.seq)
            if job is not None:
                self._advance(job, list(event.new_tokens), event.finished)

    def _advance(self, job: _Job, tokens: list[int], finished: bool) -> None:
        seq = job.seq
        if finished and seq.finish_reason == "stop" and tokens and tokens[-1] in seq.stop_ids:
            tokens.pop()  # the end token ends the output but is not part of it
        keep = stop_cut(job.output_ids, tokens, job.request.stop_words)
        if keep is not None:
            tokens, finished = tokens[:keep], True
            self.engine.abort(seq)  # no-op for a sequence that already finished
        job.output_ids += tokens
        request, metrics = job.request, self._metrics(job)
        if request.stream:
            self._post(job, lambda: self._send_stream_chunk(job, tokens, finished, metrics))
        elif finished:
            ids = job.output_ids if request.exclude_input_in_output else [*request.prompt_ids, *job.output_ids]
            self._post(job, lambda: job.sink.send(Chunk(self.tokenizer.decode(ids), True, metrics)))
        if finished:
            self._remove(job)

    def _send_stream_chunk(self, job: _Job, tokens: list[int], finished: bool, metrics: dict | None) -> None:
        text = job.detok.push(tokens) + (job.detok.flush() if finished else "")
        if text or finished:
            job.sink.send(Chunk(text, finished, metrics))

    def _metrics(self, job: _Job) -> dict | None:
        if not job.request.return_perf_metrics:
            return None
        return perf_metrics(job.seq.stats, self.engine.block_size, len(job.output_ids))

    def _fail_jobs(self, jobs: list[_Job], message: str) -> None:
        for job in jobs:
            self._remove(job)
            try:
                self.engine.abort(job.seq)
            except Exception:
                _log(f"ignored while ending a request:\n{traceback.format_exc()}")
            self._post(job, lambda job=job: job.sink.fail(message))

    def _shutdown(self) -> None:
        self._fail_jobs(list(self._jobs.values()), SHUTTING_DOWN)
        with self._lock:
            self._closed = True  # nothing enters the inbox after this
        while True:
            try:
                job = self._inbox.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                self._post(job, lambda job=job: job.sink.fail(SHUTTING_DOWN))
        self._outbox.put(None)  # the sender sends what is queued, then ends

    # -- the sender thread ------------------------------------------------------------------

    def _post(self, job: _Job, send: Callable[[], None]) -> None:
        self._outbox.put((job, send))

    def _send_loop(self) -> None:
        watched: list[_Job] = []  # admitted requests, polled for cancellation
        next_poll = time.monotonic() + self._cancel_check_s
        while True:
            try:
                item = self._outbox.get(timeout=max(0.0, next_poll - time.monotonic()))
            except queue.Empty:
                item = ()
            if item is None:
                return
            if item:
                job, action = item
                if action is _WATCH:
                    watched.append(job)
                elif job is None:  # a metrics update
                    self._record(action)
                elif not job.send_failed:  # else its client is gone; the engine thread aborts it
                    self._send(job, action)
            if time.monotonic() >= next_poll:
                watched = [job for job in watched if not (job.done or job.send_failed or job.cancel_seen)]
                for job in watched:
                    self._poll_cancelled(job)
                next_poll = time.monotonic() + self._cancel_check_s

    def _record(self, update: Callable[[], None]) -> None:
        try:
            update()
        except Exception:  # metrics must never take serving down
            _log(f"a metrics update failed:\n{traceback.format_exc()}")

    def _send(self, job: _Job, send: Callable[[], None]) -> None:
        try:
            send()
        except Exception:  # the client is gone: stop generating for it
            _log(f"sending a response failed:\n{traceback.format_exc()}")
            job.send_failed = True
            self._dropped.put(job)

    def _poll_cancelled(self, job: _Job) -> None:
        try:
            cancelled = job.sink.is_cancelled()
        except Exception:  # the client side is gone: treat as cancelled
            cancelled = True
        if cancelled:
            job.cancel_seen = True
            self._dropped.put(job)
