"""Triton adapter for postprocessing; the logic is dflash_trt.serving.text.postprocess."""

import triton_python_backend_utils as pb_utils

from dflash_trt.serving import protocol
from dflash_trt.serving.text import postprocess


class TritonPythonModel:
    def execute(self, requests):
        return [self._respond(request) for request in requests]

    def _respond(self, request):
        try:
            outputs = postprocess(protocol.read_request(pb_utils, request, protocol.POSTPROCESSING_INPUTS))
        except protocol.RequestValidationError as e:
            return pb_utils.InferenceResponse(error=protocol.triton_error(pb_utils, str(e), client_error=True))
        return pb_utils.InferenceResponse([pb_utils.Tensor(name, array) for name, array in outputs.items()])
