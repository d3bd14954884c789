"""The triton_repo model.py adapters, run against a fake triton_python_backend_utils.

The real server runs them in tests/test_triton_e2e.py; these check the adapter contracts
cheaply: FINAL flags, error codes, one bad request not failing the others, cancellation."""

import importlib.util
import json
import sys
import threading
import types

import numpy as np
import pytest

from dflash_trt.build import run
from dflash_trt.config import BuildConfig
from dflash_trt.serving import protocol as p
from dflash_trt.serving.repository import template_dir

FINAL = 1


class Tensor:
    def __init__(self, name, array):
        self._name, self._array = name, np.asarray(array)

    def name(self):
        return self._name

    def as_numpy(self):
        return self._array


class TritonError:
    INTERNAL, INVALID_ARG, CANCELLED = "INTERNAL", "INVALID_ARG", "CANCELLED"

    def __init__(self, message, code=INTERNAL):
        self._message, self._code = message, code

    def message(self):
        return self._message

    def code(self):
        return self._code


class InferenceResponse:
    def __init__(self, output_tensors=(), error=None):
        self.outputs = {t.name(): t.as_numpy() for t in output_tensors}
        self._error = error

    def output_tensors(self):
        return [Tensor(n, a) for n, a in self.outputs.items()]

    def has_error(self):
        return self._error is not None

    def error(self):
        return self._error


class Sender:
    def __init__(self, cancelled=False):
        self.sent, self.cancelled, self.finished = [], cancelled, threading.Event()

    def send(self, response=None, flags=0):
        assert not self.finished.is_set(), "a response after the FINAL flag"
        self.sent.append((response, flags))
        if flags & FINAL:
            self.finished.set()

    def is_cancelled(self):
        return self.cancelled

    def wait(self):
        assert self.finished.wait(60), "no FINAL response"
        return self.sent


class Request:
    def __init__(self, cancelled=False, **arrays):
        self.inputs = {name: Tensor(name, a) for name, a in arrays.items()}
        self.sender = Sender(cancelled)

    def get_response_sender(self):
        return self.sender


class MetricFamily:
    """pb_utils.MetricFamily's surface; the values are checked in test_serving and test_triton_e2e."""

    COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"

    def __init__(self, name, description, kind):
        pass

    def Metric(self, labels, buckets=None):  # noqa: N802 (pb_utils' name)
        return types.SimpleNamespace(increment=lambda v: None, set=lambda v: None, observe=lambda v: None)


@pytest.fixture
def pb_utils(monkeypatch):
    fake = types.ModuleType("triton_python_backend_utils")
    fake.MetricFamily = MetricFamily
    fake.Tensor, fake.TritonError, fake.InferenceResponse = Tensor, TritonError, InferenceResponse
    fake.get_input_tensor_by_name = lambda request, name: request.inputs.get(name)
    fake.TRITONSERVER_RESPONSE_COMPLETE_FINAL = FINAL
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", fake)
    return fake


def load_model(model):
    spec = importlib.util.spec_from_file_location(f"model_{model}", template_dir() / model / "1" / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.TritonPythonModel()


@pytest.fixture(scope="module")
def built(make_pair, tmp_path_factory):
    pair = make_pair()
    config = BuildConfig(target=str(pair.target), drafter=str(pair.drafter), max_input_len=32, max_output_len=16)
    return run(config, tmp_path_factory.mktemp("adapters") / "out")


def args_for(built, model):
    text = (built / "model_repository" / model / "config.pbtxt").read_text()
    engine_dir = text.split('string_value: "')[1].split('"')[0]
    return {"model_name": model, "model_version": "1", "model_repository": str(built / "model_repository" / model),
            "model_config": json.dumps({"parameters": {"engine_dir": {"string_value": engine_dir}}})}


def batch(value, dtype):
    return np.array([[value]], dtype=dtype)


def test_preprocessing_answers_each_request_and_a_bad_one_gets_invalid_arg(pb_utils, built):
    model = load_model(p.PREPROCESSING)
    model.initialize(args_for(built, p.PREPROCESSING))
    good = Request(QUERY=batch(b"hello", object), REQUEST_OUTPUT_LEN=batch(4, np.int32))
    bad = Request(QUERY=batch(b"", object), REQUEST_OUTPUT_LEN=batch(4, np.int32))
    ok, error = model.execute([good, bad])
    assert not ok.has_error() and ok.outputs[p.INPUT_ID].shape[0] == 1
    assert error.error().code() == TritonError.INVALID_ARG and "'text_input' is empty" in error.error().message()


def dflash_request(stream, max_tokens=8, cancelled=False):
    return Request(cancelled=cancelled, INPUT_ID=np.array([[5, 6, 7]], np.int32), REQUEST_INPUT_LEN=batch(3, np.int32),
                   REQUEST_OUTPUT_LEN=batch(max_tokens, np.int32), STREAM=batch(stream, bool),
                   EXCLUDE_INPUT_IN_OUTPUT=batch(True, bool))


@pytest.fixture
def dflash(pb_utils, built):
    model = load_model(p.DFLASH)
    model.initialize(args_for(built, p.DFLASH))
    yield model
    model.finalize()
    assert not model.worker.alive


def texts(sent):
    return [r.outputs[p.OUTPUT_TEXT][0, 0].decode() for r, _ in sent]


def test_dflash_enqueues_and_streams_with_final_only_on_the_last_response(dflash):
    streamed, whole, bad = dflash_request(True), dflash_request(False), dflash_request(True, max_tokens=17)
    assert dflash.execute([streamed, whole, bad]) is None  # decoupled: responses come from the engine thread
    chunks, single, error = streamed.sender.wait(), whole.sender.wait(), bad.sender.wait()
    assert [flags for _, flags in chunks] == [0] * (len(chunks) - 1) + [FINAL] and len(chunks) > 1
    assert [flags for _, flags in single] == [FINAL] and "".join(texts(chunks)) == texts(single)[0]
    (response, flags), = error
    assert flags == FINAL and response.error().code() == TritonError.INVALID_ARG
    assert "max_output_len = 16" in response.error().message()


def test_dflash_ends_a_cancelled_request_with_a_cancelled_error(dflash):
    request = dflash_request(True, max_tokens=16, cancelled=True)
    dflash.execute([request])
    *chunks, (response, flags) = request.sender.wait()  # the worker polls for cancellation
    assert flags == FINAL and response.error().code() == TritonError.CANCELLED
    assert len(chunks) < 16 and all(flags == 0 for _, flags in chunks)


def test_postprocessing_passes_the_text_and_present_metrics(pb_utils):
    model = load_model(p.POSTPROCESSING)
    (response,) = model.execute([Request(OUTPUT_TEXT=batch("é".encode(), object),
                                         NUM_OUTPUT_TOKENS=batch(3, np.int32))])
    assert set(response.outputs) == {p.OUTPUT, "NUM_OUTPUT_TOKENS"}
    assert response.outputs[p.OUTPUT][0, 0].decode() == "é"


def test_the_unary_relay_forwards_all_but_stream_and_returns_the_one_response(pb_utils):
    calls = []

    class InferenceRequest:  # BLS: answers like the ensemble, an empty FINAL response last
        def __init__(self, model_name, inputs, requested_output_names):
            calls.append((model_name, sorted(t.name() for t in inputs)))

        def exec(self, decoupled):
            assert decoupled
            return iter([InferenceResponse([Tensor(p.TEXT_OUTPUT, batch(b"hi", object))]), InferenceResponse()])

    pb_utils.InferenceRequest = InferenceRequest
    model = load_model(p.ENSEMBLE_UNARY)
    request = Request(text_input=batch(b"x", object), max_tokens=batch(4, np.int32), stream=batch(True, bool))
    assert model.execute([request]) is None
    (response, flags), = request.sender.wait()
    assert flags == FINAL and response.outputs[p.TEXT_OUTPUT][0, 0] == b"hi"
    assert calls == [(p.ENSEMBLE, [p.MAX_TOKENS, p.TEXT_INPUT])]


@pytest.mark.parametrize("client_error", [True, False])
def test_the_unary_relay_keeps_a_client_error_a_client_error(pb_utils, client_error):
    # Triton 2.51's BLS returns every error as INTERNAL; the message says whose fault it is.
    error = p.triton_error(pb_utils, "'max_tokens' must be > 0", client_error)

    class InferenceRequest:
        def __init__(self, **kwargs):
            pass

        def exec(self, decoupled):
            return iter([InferenceResponse(error=TritonError(f"in ensemble: {error.message()}"))])

    pb_utils.InferenceRequest = InferenceRequest
    model = load_model(p.ENSEMBLE_UNARY)
    request = Request(text_input=batch(b"x", object), max_tokens=batch(0, np.int32))
    model.execute([request])
    (response, flags), = request.sender.wait()
    assert flags == FINAL and "'max_tokens' must be > 0" in response.error().message()
    assert response.error().code() == (TritonError.INVALID_ARG if client_error else TritonError.INTERNAL)
