"""Triton adapter relaying a unary call to the decoupled ensemble through BLS (see config.pbtxt).

execute() hands each request to a thread and returns None; the thread sends the one response
through the request's response sender (Triton >= 24.04 allows that in non-decoupled models),
so one instance relays any number of concurrent calls.
"""

import threading

import triton_python_backend_utils as pb_utils

from dflash_trt.serving import protocol

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
OUTPUT_NAMES = [spec.name for spec in protocol.ENSEMBLE_OUTPUTS]


def _relay(request):
    # Every input but `stream` passes as it is: without it the ensemble sends one response.
    inputs = [pb_utils.get_input_tensor_by_name(request, spec.name) for spec in protocol.ENSEMBLE_INPUTS
              if spec.name != protocol.STREAM]
    call = pb_utils.InferenceRequest(model_name=protocol.ENSEMBLE, inputs=[t for t in inputs if t is not None],
                                     requested_output_names=OUTPUT_NAMES)
    outputs = []
    for response in call.exec(decoupled=True):
        if response.has_error():
            message = response.error().message()
            code = pb_utils.TritonError.INVALID_ARG if protocol.is_client_error(message) else response.error().code()
            return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code))
        outputs = response.output_tensors() or outputs  # the last response may be an empty FINAL
    return pb_utils.InferenceResponse(outputs)


def _serve(request):
    sender = request.get_response_sender()
    try:
        response = _relay(request)
    except Exception as e:  # a failed relay fails this request only
        response = pb_utils.InferenceResponse(error=pb_utils.TritonError(f"relay to the ensemble failed: {e}"))
    sender.send(response, flags=FINAL)


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            threading.Thread(target=_serve, args=(request,), daemon=True).start()
        return None
