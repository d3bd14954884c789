"""The `dflash` Triton model: requests into the EngineWorker, responses out through each
request's sender, and the server's drain and watchdog. Free of Triton's module (the adapter
hands `triton_python_backend_utils` in), so it is tested without a server.

Decoupled: execute() validates and enqueues, then returns None. The worker's thread sends
each request's responses through its response sender, FINAL flag on the last one.

How `dflash-trt serve` stops the server (it cannot see inside this process, so it signals it):
- SIGTERM drains: new requests get UNAVAILABLE, those in flight run to their end, then this
  model stops its worker and sends SIGTERM to tritonserver, which finds nothing in flight
  and unloads the models. Triton's own drain cannot do this: once tritonserver has SIGTERM it
  refuses every new request, the postprocessing step of an ensemble stream included, so its
  streams stall until the exit timeout cuts them.
- a second SIGTERM ends the drain: what is still in flight gets a final error ("the server is
  shutting down"). The stub ignores SIGTERM by itself.
- if the engine thread dies anyway (it catches its own errors), nothing would answer requests
  while Triton still reports ready: the stub exits, and serve, which watches every stub,
  stops the server and exits non-zero so that its supervisor restarts it.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

from dflash_trt.serving import protocol
from dflash_trt.serving.metrics import TritonMetrics
from dflash_trt.serving.repository import draft_window_from_env, engine_dir_from_args, tensor_parallel_from_env
from dflash_trt.serving.worker import SHUTTING_DOWN, EngineWorker

POLL_S = 0.05  # how often the drain looks for the last request; the watchdog checks 10x slower
# Triton 2.51's ensemble never releases a request whose step fails while another of its steps
# runs (PrepareSteps skips the step count once the ensemble failed; fixed in triton core #466):
# the request stays in flight for good, and Triton's shutdown waits for it until its exit
# timeout. So an error waits until the postprocessing of the request's last chunk is surely
# over, which takes milliseconds.
SETTLE_S = 0.05


def _log(message):
    print(f"[dflash-trt] {message}", file=sys.stderr, flush=True)  # the stub's stderr is the server log


class TritonSink:
    """One request's response sender, as the serving.Sink the worker talks to. It is in
    `active` from its request's arrival until its final response (or its failed send: the
    worker then drops the request)."""

    def __init__(self, pb_utils, request, active):
        self._pb = pb_utils
        self._sender = request.get_response_sender()
        self._active = active
        self._last_chunk = -SETTLE_S  # time.monotonic() of its last non-final response
        active.add(self)

    def send(self, chunk):
        tensors = [self._pb.Tensor(name, array) for name, array in chunk.to_arrays().items()]
        self._send(self._pb.InferenceResponse(tensors), chunk.final)

    def fail(self, message, client_error=False):
        self._send(self._pb.InferenceResponse(error=protocol.triton_error(self._pb, message, client_error)), True)

    def refuse(self):
        error = self._pb.TritonError(SHUTTING_DOWN, self._pb.TritonError.UNAVAILABLE)  # not the client's fault
        self._send(self._pb.InferenceResponse(error=error), True)

    def cancel(self):
        error = self._pb.TritonError("the request was cancelled", self._pb.TritonError.CANCELLED)
        self._send(self._pb.InferenceResponse(error=error), True)

    def is_cancelled(self):
        return self._sender.is_cancelled()

    def _send(self, response, final):
        if response.has_error():
            time.sleep(max(0.0, self._last_chunk + SETTLE_S - time.monotonic()))  # see SETTLE_S
        try:
            self._sender.send(response, flags=self._pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0)
        except Exception:
            self._active.discard(self)
            raise
        if final:
            self._active.discard(self)
        else:
            self._last_chunk = time.monotonic()


def on_sigterm(callback):
    """Call `callback` in a thread of its own whenever this process gets SIGTERM.

    The stub's main thread waits in C++ for Triton's messages, so a Python signal handler would
    run only at the next execute(); the wakeup fd is written by the C-level handler at once."""
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)

    def wait():
        while True:
            if os.read(read_fd, 1) == bytes([signal.SIGTERM]):  # other bytes: other signals
                callback()

    threading.Thread(target=wait, name="dflash-sigterm", daemon=True).start()


class DFlashModel:
    """The `dflash` Triton model (triton_repo/dflash/1/model.py subclasses it); `pb_utils`:
    triton_python_backend_utils, which only the stub can import."""

    def __init__(self, pb_utils):
        self._pb = pb_utils

    def initialize(self, args):
        labels = {"model": args["model_name"], "version": args["model_version"]}
        self.worker = EngineWorker.load(engine_dir_from_args(args), draft_window=draft_window_from_env(),
                                        tensor_parallel=tensor_parallel_from_env(),
                                        metrics=lambda block_size: TritonMetrics(self._pb, labels, block_size))
        self._tritonserver = os.getppid()
        self._active = set()  # the TritonSink of every request in flight
        self._draining = threading.Event()
        self._stopping = threading.Event()  # set before every stop we ask for: the watchdog tells them apart
        on_sigterm(self._on_sigterm)
        threading.Thread(target=self._watch, name="dflash-watchdog", daemon=True).start()

    def execute(self, requests):
        for request in requests:
            sink = TritonSink(self._pb, request, self._active)
            if self._draining.is_set():
                sink.refuse()
                continue
            try:
                arrays = protocol.read_request(self._pb, request, protocol.DFLASH_INPUTS)
                self.worker.submit(protocol.Request.from_arrays(arrays), sink)
            except protocol.RequestValidationError as e:  # this request fails, the batch goes on
                sink.fail(str(e), client_error=True)
        return None

    def finalize(self):
        self._stop_worker()

    def _stop_worker(self):
        self._stopping.set()
        self.worker.stop()  # fails what is in flight, refuses what comes

    def _on_sigterm(self):
        if self._draining.is_set():
            _log(f"SIGTERM again: ending the {len(self._active)} requests still in flight")
            self._stop_worker()
            return
        self._draining.set()
        _log(f"SIGTERM: draining {len(self._active)} requests in flight")
        threading.Thread(target=self._drain, name="dflash-drain", daemon=True).start()

    def _drain(self):
        while self._active:
            time.sleep(POLL_S)
        self._stop_worker()
        time.sleep(SETTLE_S)  # the ensembles' last postprocessing steps, which Triton refuses once it has SIGTERM
        if os.getppid() == self._tritonserver:  # else it is gone, and the pid is not its own
            _log("drained: stopping tritonserver")
            os.kill(self._tritonserver, signal.SIGTERM)

    def _watch(self):
        while not self._stopping.wait(10 * POLL_S):
            # alive first: a stop we asked for sets _stopping before the threads end
            if not self.worker.alive and not self._stopping.is_set():
                _log("the engine thread died: ending this process so that the server stops")
                os._exit(1)
                return  # only reached where os._exit is a stand-in (the tests)
