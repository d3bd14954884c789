"""Triton adapter for preprocessing; the logic is dflash_trt.serving.text.Preprocessor."""

import triton_python_backend_utils as pb_utils

from dflash_trt.serving import protocol
from dflash_trt.serving.repository import engine_dir_from_args
from dflash_trt.serving.text import Preprocessor


class TritonPythonModel:
    def initialize(self, args):
        self.preprocess = Preprocessor.load(engine_dir_from_args(args))

    def execute(self, requests):
        return [self._respond(request) for request in requests]

    def _respond(self, request):
        try:
            outputs = self.preprocess(protocol.read_request(pb_utils, request, protocol.PREPROCESSING_INPUTS))
        except protocol.RequestValidationError as e:  # this request fails, the batch goes on
            return pb_utils.InferenceResponse(error=protocol.triton_error(pb_utils, str(e), client_error=True))
        return pb_utils.InferenceResponse([pb_utils.Tensor(name, array) for name, array in outputs.items()])
