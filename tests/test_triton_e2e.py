"""A real tritonserver (the one bundled in nvidia-pytriton) serving the tiny demo engine,
called the way existing Triton TensorRT-LLM clients call it: tritonclient HTTP and gRPC,
gRPC streaming, the HTTP generate endpoints. Outputs must equal the in-process engine's
greedy output; bad requests must get clear errors while the server keeps serving."""

import json
import threading
import time
import urllib.request

import numpy as np
import pytest
from triton_clients import (  # noqa: F401 (server, local, expected: fixtures)
    MAX_TOKENS,
    TIMEOUT_S,
    InferenceServerException,
    expected,
    expected_text,
    grpc_client,
    grpc_infer,
    grpc_stream,
    grpcclient,
    http_client,
    http_infer,
    local,
    httpclient,
    np_to_triton_dtype,
    post,
    server,
    server_rss_kib,
    tensors,
    text_of,
)

from dflash_trt.build import run
from dflash_trt.config import resolve_config
from dflash_trt.sampling import SamplingParams
from dflash_trt.serving import protocol as p
from dflash_trt.serving.worker import perf_metrics

pytestmark = pytest.mark.slow

# The demo model's output holds multi-byte characters for the first four (checked below).
PROMPTS = ["你好，世界", "1 2 3", "中文", "        self.assertEqual('é'", "Hello", "The capital of France is", "import os",
           "Once upon a time"]


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("e2e") / "demo"
    run(resolve_config("tiny"), out)
    return out


# -- tests ------------------------------------------------------------------------------------


def test_http_and_grpc_infer_return_the_in_process_greedy_text(server, local, expected):
    for prompt in ("Hello", "你好，世界"):
        want = expected_text(local, expected, prompt)
        assert text_of(http_infer(server, text=prompt, exclude_input_in_output=True)) == want
        assert grpc_infer(server, text=prompt, exclude_input_in_output=True) == want
        # TensorRT-LLM's default: the unstreamed output starts with the prompt.
        assert text_of(http_infer(server, text=prompt)) == prompt + want


def test_the_decoupled_ensemble_refuses_unary_infer_with_triton_s_message(server):
    with pytest.raises(InferenceServerException, match="decoupled transaction policy"):
        http_infer(server, p.ENSEMBLE, text="Hello")


def test_grpc_stream_chunks_concatenate_to_the_text_and_keep_characters_whole(server, local, expected):
    multibyte = set()
    for prompt in PROMPTS[:4]:
        chunks = grpc_stream(server, text=prompt, stream=True)
        texts = [c.decode("utf-8") for c in chunks]  # strict: a split character would raise here
        want = expected_text(local, expected, prompt)
        assert "".join(texts) == want and len(texts) > 1, prompt
        multibyte |= {c for c in want if ord(c) > 127 and c != "\ufffd"}
    # The demo's 8000-merge vocabulary spells these characters with one token each; characters
    # spelled by several tokens are covered with a smaller vocabulary in test_serving.py.
    assert multibyte, "the demo generated no multi-byte character; pick other prompts"


def test_unstreamed_grpc_stream_request_gets_exactly_one_response(server, local, expected):
    chunks = grpc_stream(server, text="Hello", exclude_input_in_output=True)
    assert [c.decode() for c in chunks] == [expected_text(local, expected, "Hello")]


def test_generate_and_generate_stream_endpoints(server, local, expected):
    want = expected_text(local, expected, "Hello")
    body = {"text_input": "Hello", "max_tokens": MAX_TOKENS, "exclude_input_in_output": True}
    assert json.loads(post(server, "/v2/models/ensemble/generate", body))["text_output"] == want
    events = post(server, "/v2/models/ensemble/generate_stream", {**body, "stream": True})
    texts = [json.loads(line.removeprefix("data: "))["text_output"]
             for line in events.splitlines() if line.startswith("data: ")]
    assert len(texts) > 1 and "".join(texts) == want


def test_eight_concurrent_clients_each_get_their_own_greedy_output(server, local, expected):
    wants = {prompt: expected_text(local, expected, prompt) for prompt in PROMPTS}
    calls = [  # a mix of the ways clients call
        lambda prompt: "".join(c.decode() for c in grpc_stream(server, text=prompt, stream=True)),
        lambda prompt: text_of(http_infer(server, text=prompt, exclude_input_in_output=True)),
        lambda prompt: grpc_infer(server, text=prompt, exclude_input_in_output=True),
        lambda prompt: json.loads(post(server, "/v2/models/ensemble/generate",
                                       {"text_input": prompt, "max_tokens": MAX_TOKENS,
                                        "exclude_input_in_output": True}))["text_output"],
    ]
    got, errors = {}, []

    def client(i, prompt):
        try:
            got[prompt] = calls[i % len(calls)](prompt)
        except Exception as e:  # reported below, with the prompt
            errors.append((prompt, e))

    threads = [threading.Thread(target=client, args=(i, prompt)) for i, prompt in enumerate(PROMPTS)]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S)
    assert not errors
    assert got == wants
    assert time.monotonic() - start < TIMEOUT_S


def test_chat_applies_the_chat_template(server, local, expected):
    chat = local.tokenizer.apply_chat_template([{"role": "user", "content": "Hi!"}], enable_thinking=False)
    want = expected_text(local, expected, chat)
    assert text_of(http_infer(server, text="Hi!", chat=True, exclude_input_in_output=True)) == want


def first_stop_word(tok, ids, start):
    """A two-token stop word taken from `ids` at or after `start` that the tokenizer encodes to
    those very tokens and that does not occur earlier; returns (word, index after it)."""
    for k in range(start, len(ids) - 1):
        word = tok.decode(ids[k:k + 2])
        earlier = any(ids[j:j + 2] == ids[k:k + 2] for j in range(k))
        if tok.encode(word) == ids[k:k + 2] and not earlier and "\ufffd" not in word:
            return word, k + 2
    pytest.fail("no usable stop word in the expected output")


def test_stop_words_end_generation_after_the_stop_word(server, local, expected):
    tok, ids = local.tokenizer, expected("Once upon a time")
    word, end = first_stop_word(tok, ids, start=5)
    stop_words = np.array([[word.encode(), b"never generated \x01"]], dtype=object)
    got = text_of(http_infer(server, text="Once upon a time", exclude_input_in_output=True, stop_words=stop_words))
    assert got == tok.decode(ids[:end]) and got.endswith(word)
    streamed = grpc_stream(server, text="Once upon a time", stream=True, stop_words=stop_words)
    assert b"".join(streamed).decode() == got


def test_end_id_replaces_the_eos_and_is_left_out(server, local, expected):
    tok, ids = local.tokenizer, expected("import os")
    end = ids[6]
    got = http_infer(server, text="import os", exclude_input_in_output=True, end_id=end)
    assert text_of(got) == tok.decode(ids[:ids.index(end)])


def test_perf_metrics_match_the_in_process_dflash_run_and_appear_only_when_asked(server, local, expected):
    tok, prompt = local.tokenizer, "Hello"
    params = SamplingParams(max_tokens=MAX_TOKENS, stop_token_ids=tuple(tok.stop_token_ids))
    run_ = local.engine.generate([tok.encode(prompt)], params, mode="dflash")[0]
    want = perf_metrics(run_.stats, local.engine.block_size, len(expected(prompt)))
    result = http_infer(server, text=prompt, return_perf_metrics=True)
    got = {name: result.as_numpy(name)[0, 0].item() for name in want}
    assert got == pytest.approx(want)
    assert got[p.TOTAL_DRAFT_TOKENS] == run_.stats.verify_steps * (local.engine.block_size - 1) > 0
    plain = http_infer(server, text=prompt)
    assert [o["name"] for o in plain.get_response()["outputs"]] == [p.TEXT_OUTPUT]


BAD_REQUESTS = {
    "missing text_input": (dict(text=None), "missing required input(s) ['text_input']"),
    "max_tokens 0": (dict(text="Hello", max_tokens=0), "'max_tokens' must be an int > 0, got 0"),
    "max_tokens beyond max_output_len": (dict(text="Hello", max_tokens=257),
                                         "'max_tokens' is 257, more than this engine's max_output_len = 256"),
    "max_tokens as FP32": (dict(text="Hello", max_tokens=None, max_tokens_fp32=np.array([[8.0]], np.float32)),
                           "data-type is 'FP32', but model 'ensemble_unary' expects 'INT32'"),
    "empty prompt": (dict(text=""), "'text_input' is empty"),
    "prompt beyond max_input_len": (dict(text="hello " * 600), "tokens, more than this engine's max_input_len = 512"),
    "top_p 0": (dict(text="Hello", top_p=0.0), "'top_p' must be in (0, 1]"),
    "bad_words": (dict(text="Hello", bad_words=np.array([[b"foo"]], dtype=object)), "'bad_words' is not supported"),
}


@pytest.mark.parametrize("case", BAD_REQUESTS)
def test_a_bad_request_gets_a_clear_error_and_the_server_serves_on(server, local, expected, case):
    kw, message = BAD_REQUESTS[case]
    kw = dict(kw)
    inputs = tensors(httpclient, **{k: v for k, v in kw.items() if k != "max_tokens_fp32"})
    if "max_tokens_fp32" in kw:  # the right name with the wrong dtype
        wrong = httpclient.InferInput(p.MAX_TOKENS, [1, 1], "FP32")
        wrong.set_data_from_numpy(kw["max_tokens_fp32"])
        inputs.append(wrong)
    with pytest.raises(InferenceServerException) as error:
        http_infer(server, inputs=inputs)
    assert message in str(error.value) and error.value.status() == "400", (error.value.status(), str(error.value))
    if "max_tokens_fp32" not in kw:  # the same request as a unary gRPC call
        with grpc_client(server) as client, pytest.raises(InferenceServerException) as error:
            client.infer(p.ENSEMBLE_UNARY, tensors(grpcclient, **kw))
        assert message in str(error.value) and error.value.status() == "StatusCode.INVALID_ARGUMENT"
    with http_client(server) as client:
        assert client.is_server_live() and client.is_model_ready(p.ENSEMBLE)
    got = http_infer(server, text="Hello", max_tokens=8, exclude_input_in_output=True)
    assert text_of(got) == expected_text(local, expected, "Hello", 8)


def test_an_oversized_text_input_is_refused_fast_without_growing_preprocessing(server, local, expected):
    before = server_rss_kib(server)[p.PREPROCESSING]
    huge = "word " * (4 << 20)  # 20 MiB, far over what max_input_len = 512 tokens can spell
    for _ in range(3):
        start = time.perf_counter()
        with pytest.raises(InferenceServerException) as error:
            http_infer(server, text=huge)
        assert error.value.status() == "400" and "'text_input' is 20,971,520 bytes" in str(error.value)
        assert time.perf_counter() - start < 10, "refused only after tokenizing"
    assert server_rss_kib(server)[p.PREPROCESSING] - before < 64 << 10  # KiB
    got = http_infer(server, text="Hello", max_tokens=8, exclude_input_in_output=True)
    assert text_of(got) == expected_text(local, expected, "Hello", 8)


def test_a_bad_streamed_request_gets_its_error_through_the_stream(server):
    with pytest.raises(InferenceServerException, match="'max_tokens' must be an int > 0"):
        grpc_stream(server, text="Hello", max_tokens=0, stream=True)


def test_a_client_that_cancels_mid_stream_does_not_wedge_the_engine(server, local, expected):
    # Triton 2.51 does not pass the cancellation of an ensemble stream on to the running dflash
    # request, so its generation runs to max_tokens; 24 lets it end before the next request's
    # 32 tokens do (a server stopped while it runs would wait out its exit timeout).
    assert len(expected("The capital of France is")) == MAX_TOKENS > 24
    chunks = grpc_stream(server, text="Hello", max_tokens=24, stream=True, stop_after=3)
    assert len(chunks) == 3
    got = http_infer(server, text="The capital of France is", exclude_input_in_output=True)
    assert text_of(got) == expected_text(local, expected, "The capital of France is")


def test_cancelling_a_direct_dflash_stream_aborts_its_sequence(server, local):
    # Triton 2.51 does not pass an ensemble client's cancellation on to the running dflash
    # request (it only stops between steps), so this calls dflash directly to check that
    # the engine thread notices cancellation and aborts the sequence.
    ids = np.array([local.tokenizer.encode("Hello")], dtype=np.int32)
    arrays = {p.INPUT_ID: ids, p.REQUEST_INPUT_LEN: np.array([[ids.shape[1]]], np.int32),
              p.REQUEST_OUTPUT_LEN: np.array([[250]], np.int32), p.STREAM_IN: np.array([[True]])}
    inputs = []
    for name, array in arrays.items():
        tensor = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    assert len(grpc_stream(server, model=p.DFLASH, inputs=inputs, stop_after=2)) == 2
    deadline = time.monotonic() + 10
    while "was cancelled by its client; its sequence is aborted" not in server.log_path.read_text():
        assert time.monotonic() < deadline, "the dflash model never noticed the cancellation"
        time.sleep(0.1)


def scrape(server) -> dict[str, float]:
    """The dflash model's series on Triton's metrics port: name (labels dropped) -> value."""
    values = {}
    for line in urllib.request.urlopen(server.endpoints.metrics, timeout=10).read().decode().splitlines():
        if line.startswith("dflash_") and 'model="dflash"' in line:
            name, value = line.split("{")[0], float(line.rsplit(" ", 1)[1])
            if name.endswith("_bucket"):
                continue
            values[name] = values.get(name, 0.0) + value
    return values


def idle_metrics(server) -> dict[str, float]:
    """The series once no request is running (an earlier test's cancelled stream may still be
    finishing: an ensemble does not pass cancellation on)."""
    deadline = time.monotonic() + 30
    while True:
        values = scrape(server)
        if values.get("dflash_running_requests") == 0 and values.get("dflash_kv_slots_used") == 0:
            return values
        assert time.monotonic() < deadline, "the server never went idle"
        time.sleep(0.2)


def test_metrics_count_what_the_responses_report(server):
    before = idle_metrics(server)
    reported = []
    for prompt in ("Hello", "The capital of France is", "import os"):
        result = http_infer(server, text=prompt, max_tokens=16, return_perf_metrics=True)
        reported.append({name: result.as_numpy(name).item() for name in
                         (p.NUM_OUTPUT_TOKENS, p.TOTAL_DRAFT_TOKENS, p.TOTAL_ACCEPTED_DRAFT_TOKENS)})
    want = {"dflash_output_tokens_total": sum(r[p.NUM_OUTPUT_TOKENS] for r in reported),
            "dflash_draft_tokens_total": sum(r[p.TOTAL_DRAFT_TOKENS] for r in reported),
            "dflash_accepted_draft_tokens_total": sum(r[p.TOTAL_ACCEPTED_DRAFT_TOKENS] for r in reported)}
    deadline = time.monotonic() + 10  # the worker sends its updates from its sender thread
    while True:
        after = scrape(server)
        got = {name: after.get(name, 0) - before.get(name, 0) for name in want}
        idle = after.get("dflash_running_requests") == 0 and after.get("dflash_kv_slots_used") == 0
        if (got == want and idle) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert got == want and want["dflash_draft_tokens_total"] > 0, (got, want)
    steps = after["dflash_verify_steps_total"] - before.get("dflash_verify_steps_total", 0)
    assert after["dflash_acceptance_length_count"] - before.get("dflash_acceptance_length_count", 0) == steps > 0
    assert after["dflash_running_requests"] == 0 and after["dflash_kv_slots_used"] == 0
