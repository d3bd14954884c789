"""The OpenAI-compatible API in front of a real tritonserver, driven by the real `openai`
package: answers equal the in-process engine's greedy text, streaming included, and bad
requests get OpenAI-format errors while the server serves on."""

import json
import urllib.error
import urllib.request

import pytest
from openai import AuthenticationError, BadRequestError, OpenAI
from ports import free_ports
from test_triton_e2e import engine_dir  # noqa: F401  (module fixtures: build the demo, serve it, load it)
from triton_clients import greedy_reference, local, server  # noqa: F401 (local, server: fixtures)

from dflash_trt.serving.openai_api import ApiServer, Frontend, StopCut, parse_generation

pytestmark = pytest.mark.slow
MAX_OUTPUT_LEN = 256  # the tiny preset's
QUESTION = "Write a quicksort in Python."


@pytest.fixture(scope="module")
def expected(local):  # noqa: F811
    return greedy_reference(local)


def start_api(frontend: Frontend) -> ApiServer:
    (port,) = free_ports(1)
    return ApiServer(frontend, "127.0.0.1", port)


@pytest.fixture(scope="module")
def api_url(server, local):  # noqa: F811
    api = start_api(Frontend(server.endpoints.grpc, local.tokenizer, MAX_OUTPUT_LEN, "demo"))
    yield api.url
    api.stop()


def chat_text(local, content, enable_thinking=True):  # noqa: F811
    return local.tokenizer.apply_chat_template([{"role": "user", "content": content}], enable_thinking=enable_thinking)


def test_the_model_cards_snippet_runs_as_written(api_url, local, expected):  # noqa: F811
    client = OpenAI(base_url=api_url, api_key="EMPTY")
    response = client.chat.completions.create(
        model="Qwen/Qwen3.5-9B",
        messages=[{"role": "user", "content": "Write a quicksort in Python."}],
        max_tokens=4096,
        temperature=0.0
    )
    want = local.tokenizer.decode(expected(chat_text(local, QUESTION), MAX_OUTPUT_LEN))
    assert response.choices[0].message.content == want
    usage = response.usage
    assert usage.prompt_tokens == len(local.tokenizer.encode(chat_text(local, QUESTION)))
    assert usage.completion_tokens == len(expected(chat_text(local, QUESTION), MAX_OUTPUT_LEN))
    greedy_length = len(expected(chat_text(local, QUESTION), MAX_OUTPUT_LEN))
    assert response.choices[0].finish_reason == ("length" if greedy_length == MAX_OUTPUT_LEN else "stop")
    stats = response.model_extra["dflash"]
    assert stats["draft_tokens"] > 0 and 1.0 <= stats["mean_acceptance_length"]


def test_streamed_chat_concatenates_to_the_whole_answer_with_usage(api_url, local, expected):  # noqa: F811
    client = OpenAI(base_url=api_url, api_key="EMPTY")
    stream = client.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": QUESTION}], max_tokens=24, temperature=0.0,
        stream=True, stream_options={"include_usage": True},
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    ids = expected(chat_text(local, QUESTION, enable_thinking=False), 24)
    assert text == local.tokenizer.decode(ids)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == ("length" if len(ids) == 24 else "stop")
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == len(ids)
    assert len(chunks) > 4  # it really streamed


def test_completions_take_the_prompt_raw(api_url, local, expected):  # noqa: F811
    client = OpenAI(base_url=api_url, api_key="EMPTY")
    for stream in (False, True):
        response = client.completions.create(model="demo", prompt="The capital of France is", max_tokens=16,
                                             temperature=0, stream=stream)
        text = "".join(c.choices[0].text for c in response) if stream else response.choices[0].text
        assert text == local.tokenizer.decode(expected("The capital of France is", 16))


def test_a_stop_string_ends_the_answer_and_is_left_out(api_url, local, expected):  # noqa: F811
    ids, tok = expected("The capital of France is", 16), local.tokenizer
    full = tok.decode(ids)
    # a token in the middle of the answer that tokenizes alone to itself (the engine matches
    # stop words as token sequences, as TensorRT-LLM does) and does not occur before it
    stop = next(s for i in range(3, len(ids) - 1) if (s := tok.decode([ids[i]])).strip()
                and tok.encode(s) == [ids[i]] and s not in tok.decode(ids[:i]))
    client = OpenAI(base_url=api_url, api_key="EMPTY")
    for stream in (False, True):
        response = client.completions.create(model="demo", prompt="The capital of France is", max_tokens=16,
                                             temperature=0, stop=[stop], stream=stream)
        text = "".join(c.choices[0].text for c in response) if stream else response.choices[0].text
        assert full.startswith(text) and stop not in text and len(text) < len(full), (text, full, stop)


def test_the_model_list_names_the_served_model(api_url):
    models = OpenAI(base_url=api_url, api_key="EMPTY").models.list()
    assert [m.id for m in models.data] == ["demo"]


BAD = {
    "n": dict(n=2),
    "logprobs": dict(logprobs=True),
    "tools": dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}]),
    "temperature": dict(temperature=-1),
    "top_p": dict(top_p=0),
    "max_tokens": dict(max_tokens=0),
    "presence_penalty": dict(presence_penalty=1.0),
    "seed": dict(seed=-1),
}


@pytest.mark.parametrize("field", BAD)
def test_a_field_the_engine_cannot_honour_is_a_400_naming_it(api_url, field):
    client = OpenAI(base_url=api_url, api_key="EMPTY", max_retries=0)
    with pytest.raises(BadRequestError) as error:
        client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "hi"}], **BAD[field])
    assert error.value.status_code == 400 and field in error.value.message
    assert error.value.body["param"] == field
    answer = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert answer.choices[0].message.content is not None  # served on


def post(url, body: bytes, headers=None):
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json", **(headers or {})})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.parametrize("body", [b"{not json", b"[1, 2]", b'{"messages": []}', b'{"messages": [{"role": "x"}]}'])
def test_a_malformed_body_is_a_400_in_openai_format(api_url, body):
    status, error = post(f"{api_url}/chat/completions", body)
    assert status == 400 and error["error"]["type"] == "invalid_request_error" and error["error"]["message"]


def test_null_fields_take_their_defaults_as_absent_ones_do():
    nulls = {name: None for name in ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream",
                                     "stream_options")}
    assert parse_generation(nulls, "p", 16) == parse_generation({}, "p", 16)


def test_what_the_server_refuses_comes_back_as_a_400(api_url):
    status, error = post(f"{api_url}/completions", json.dumps({"prompt": "hello " * 600, "max_tokens": 4}).encode())
    assert status == 400 and "max_input_len = 512" in error["error"]["message"], error


def test_with_an_api_key_a_request_without_it_is_a_401(server, local):  # noqa: F811
    api = start_api(Frontend(server.endpoints.grpc, local.tokenizer, MAX_OUTPUT_LEN, "demo", "secret"))
    try:
        with pytest.raises(AuthenticationError):
            OpenAI(base_url=api.url, api_key="wrong", max_retries=0).models.list()
        assert OpenAI(base_url=api.url, api_key="secret").models.list().data[0].id == "demo"
    finally:
        api.stop()


@pytest.mark.parametrize("chunks, stop, want", [  # want: what each push streams, then what end() adds
    (["a b", " c", "XY"], ("XY",), ["a", " b", " c", ""]),
    (["a", "bX", "Y"], ("XY",), ["", "a", "b", ""]),
    (["abc"], (), ["abc", ""]),
    (["ab", "XZ"], ("XY",), ["", "ab", "XZ"]),
])
def test_stop_cut_streams_all_but_the_last_stop_length_characters(chunks, stop, want):
    cut = StopCut(stop)
    streamed = []
    for chunk in chunks:
        streamed.append(cut.push(chunk))
        assert len(cut.held) <= max(map(len, stop), default=0)  # only a possible stop string waits
    assert streamed + [cut.end()] == want
