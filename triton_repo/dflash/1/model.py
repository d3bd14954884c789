"""Triton adapter for the engine; the logic is dflash_trt.serving.worker.EngineWorker.

Decoupled: execute() validates and enqueues, then returns None. The worker's thread sends
each request's responses through its response sender, FINAL flag on the last one.
"""

import triton_python_backend_utils as pb_utils

from dflash_trt.serving import protocol
from dflash_trt.serving.repository import engine_dir_from_args
from dflash_trt.serving.worker import EngineWorker

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class _Sink:
    """One request's response sender, as the serving.Sink the worker talks to."""

    def __init__(self, request):
        self._sender = request.get_response_sender()

    def send(self, chunk):
        tensors = [pb_utils.Tensor(name, array) for name, array in chunk.to_arrays().items()]
        self._sender.send(pb_utils.InferenceResponse(tensors), flags=FINAL if chunk.final else 0)

    def fail(self, message, client_error=False):
        error = protocol.triton_error(pb_utils, message, client_error)
        self._sender.send(pb_utils.InferenceResponse(error=error), flags=FINAL)

    def cancel(self):
        error = pb_utils.TritonError("the request was cancelled", pb_utils.TritonError.CANCELLED)
        self._sender.send(pb_utils.InferenceResponse(error=error), flags=FINAL)

    def is_cancelled(self):
        return self._sender.is_cancelled()


class TritonPythonModel:
    def initialize(self, args):
        self.worker = EngineWorker.load(engine_dir_from_args(args))

    def execute(self, requests):
        for request in requests:
            sink = _Sink(request)
            try:
                self.worker.submit(protocol.Request.from_arrays(protocol.read_request(pb_utils, request, protocol.DFLASH_INPUTS)), sink)
            except protocol.RequestValidationError as e:  # this request fails, the batch goes on
                sink.fail(str(e), client_error=True)
        return None

    def finalize(self):
        self.worker.stop()
