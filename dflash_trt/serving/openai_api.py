"""An OpenAI-compatible HTTP API in front of the Triton server: `GET /v1/models`,
`POST /v1/completions`, `POST /v1/chat/completions` (streaming as server-sent events).

A thin adapter: each request becomes one gRPC streaming call of the `ensemble` (the one way
into the engine), so everything behind it (validation, batching, stop words) is the server's.
Chat messages are rendered here with the engine's own chat template (any number of turns and
roles; `chat_template_kwargs.enable_thinking` as SGLang and vLLM take it) and sent as raw text.

Departures from OpenAI's API, all deliberate:
- fields the engine cannot honour (`n` > 1, `logprobs`, tools, `logit_bias`, penalties, ...)
  are refused with a 400 naming the field, never ignored;
- `top_k` is accepted, as vLLM and SGLang accept it;
- `max_tokens` above the engine's max_output_len is capped to it (so a model card's snippet
  runs on any build), and `finish_reason` says "length" when the cap ends the answer;
- `stop` strings are left out of the answer, as OpenAI does (the engine's stop words end the
  output with the word: the adapter holds back that many characters and cuts it);
- the model name in a request is not checked (the server serves one model, as SGLang does);
- `finish_reason` is "length" when the answer has exactly max_tokens tokens, else "stop";
- each response carries its request's speculative statistics under `dflash`
  (`mean_acceptance_length`, `acceptance_rate`, `accepted_draft_tokens`, `draft_tokens`).
"""

from __future__ import annotations

import json
import math
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import uvicorn
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from dflash_trt.config import TOKENIZER_DIR, read_engine_record
from dflash_trt.errors import DFlashError
from dflash_trt.serving import protocol as p
from dflash_trt.serving.client import ClientError, Completion, GrpcStream
from dflash_trt.tokenizer import Tokenizer

# field -> the values that mean "not used": anything else is refused, naming the field
UNSUPPORTED = {
    "n": (None, 1), "best_of": (None, 1), "logprobs": (None, False), "top_logprobs": (None, 0),
    "echo": (None, False), "suffix": (None, ""), "logit_bias": (None, {}), "tools": (None, []),
    "tool_choice": (None, "none"), "functions": (None, []), "function_call": (None, "none"),
    "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
    "response_format": (None, {"type": "text"}),
}
ROLES = ("system", "user", "assistant")
_END = object()  # what next() returns on an exhausted chunk iterator


class OpenAIError(DFlashError):
    """An error response in OpenAI's format."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code

    def response(self) -> JSONResponse:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        body = {"error": {"message": str(self), "type": kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status)


@dataclass(frozen=True)
class Generation:
    """One request, as the ensemble takes it."""

    prompt: str  # the text sent as text_input (a chat is rendered already)
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool


# -- requests -----------------------------------------------------------------------------------


def _field(body: dict, name: str, kinds: tuple[type, ...], default: Any = None) -> Any:
    """body[name] checked against `kinds`; absent or null (as OpenAI's clients send unset fields)
    gives the default."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds):
        return value
    raise OpenAIError(f"'{name}' must be {' or '.join(k.__name__ for k in kinds)}, got {value!r}", param=name)


def _number(body: dict, name: str, default: float, ok, expected: str) -> float:
    value = _field(body, name, (int, float), default)
    if not (math.isfinite(value) and ok(value)):
        raise OpenAIError(f"'{name}' must be {expected}, got {value!r}", param=name)
    return value


def parse_generation(body: Any, prompt: str, max_output_len: int) -> Generation:
    """The sampling fields both endpoints share, checked here so that a bad one is a 400 in
    OpenAI's format before anything reaches the server."""
    for name, unused in UNSUPPORTED.items():
        if name in body and body[name] not in unused:
            raise OpenAIError(f"'{name}' is not supported by dflash-trt (got {body[name]!r})", param=name)
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _field(body, name, (int,))
    if max_tokens is not None and max_tokens < 1:
        raise OpenAIError(f"'{name}' must be >= 1, got {max_tokens}", param=name)
    max_tokens = min(max_tokens or max_output_len, max_output_len)
    stop = _field(body, "stop", (str, list))
    stop = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if not all(isinstance(s, str) and s for s in stop):
        raise OpenAIError(f"'stop' must be a non-empty string or a list of them, got {body['stop']!r}", param="stop")
    top_k = _field(body, "top_k", (int,), 0)
    if top_k < -1:
        raise OpenAIError(f"'top_k' must be >= 0 (or -1: off), got {top_k}", param="top_k")
    seed = _field(body, "seed", (int,))
    if seed is not None and not 0 <= seed < 2**64:
        raise OpenAIError(f"'seed' must be in [0, 2^64), got {seed}", param="seed")
    options = _field(body, "stream_options", (dict,)) or {}
    return Generation(
        prompt=prompt, max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, lambda t: t >= 0, "a number >= 0"),
        top_p=_number(body, "top_p", 1.0, lambda v: 0 < v <= 1, "in (0, 1]"),
        top_k=max(top_k, 0), seed=seed, stop=stop,
        stream=bool(_field(body, "stream", (bool,), False)), include_usage=bool(options.get("include_usage")),
    )


def completion_prompt(body: dict) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]  # a batch of one
    if not isinstance(prompt, str) or not prompt:
        raise OpenAIError("'prompt' must be a non-empty string (one prompt per request)", param="prompt")
    return prompt


def chat_prompt(body: dict, tokenizer) -> str:
    """The messages rendered with the engine's chat template, ready for the assistant's turn."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise OpenAIError("'messages' must be a non-empty list", param="messages")
    plain = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise OpenAIError(f"messages[{i}] must have a role among {', '.join(ROLES)}", param=f"messages[{i}]")
        content = message.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(part, dict) and part.get("type") == "text" for part in content):
                raise OpenAIError(f"messages[{i}].content: only text parts are supported", param=f"messages[{i}]")
            content = "".join(str(part.get("text", "")) for part in content)
        if not isinstance(content, str):
            raise OpenAIError(f"messages[{i}].content must be a string or text parts", param=f"messages[{i}]")
        plain.append({"role": message["role"], "content": content})
    kwargs = _field(body, "chat_template_kwargs", (dict,)) or {}
    unknown = sorted(set(kwargs) - {"enable_thinking"})
    if unknown:
        raise OpenAIError(f"chat_template_kwargs: only enable_thinking is supported, got {unknown}",
                          param="chat_template_kwargs")
    try:
        return tokenizer.apply_chat_template(plain, add_generation_prompt=True,
                                             enable_thinking=bool(kwargs.get("enable_thinking", True)))
    except (DFlashError, ValueError) as e:
        raise OpenAIError(f"the chat template failed on these messages: {e}", param="messages") from None


# -- responses ----------------------------------------------------------------------------------


class StopCut:
    """Text chunks in, the same text out without a final stop string. The engine ends its
    output with the stop word, so a stop string can only stand at the very end: the last
    len(longest stop) characters are held back until the end shows whether they are one."""

    def __init__(self, stop: tuple[str, ...]):
        self.stop, self.hold, self.held = stop, max(map(len, stop), default=0), ""

    def push(self, text: str) -> str:
        self.held += text
        cut = max(0, len(self.held) - self.hold)
        out, self.held = self.held[:cut], self.held[cut:]
        return out

    def end(self) -> str:
        held = self.held
        for word in self.stop:
            if held.endswith(word):
                return held[: len(held) - len(word)]
        return held


def usage_of(metrics: dict) -> dict:
    prompt, completion = int(metrics.get(p.NUM_INPUT_TOKENS, 0)), int(metrics.get(p.NUM_OUTPUT_TOKENS, 0))
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def dflash_stats(metrics: dict) -> dict:
    return {"mean_acceptance_length": metrics.get(p.MEAN_ACCEPTANCE_LENGTH, 0.0),
            "acceptance_rate": metrics.get(p.ACCEPTANCE_RATE, 0.0),
            "accepted_draft_tokens": int(metrics.get(p.TOTAL_ACCEPTED_DRAFT_TOKENS, 0)),
            "draft_tokens": int(metrics.get(p.TOTAL_DRAFT_TOKENS, 0))}


def finish_reason(metrics: dict, generation: Generation) -> str:
    return "length" if int(metrics.get(p.NUM_OUTPUT_TOKENS, 0)) >= generation.max_tokens else "stop"


def _error_of(e: ClientError) -> OpenAIError:
    message = str(e)
    if p.is_client_error(message):
        return OpenAIError(message.split(p.CLIENT_ERROR, 1)[1], 400)
    return OpenAIError(f"the server failed: {message}", 500)


class Frontend:
    """The API's state: where the Triton server listens, the tokenizer for chat templates, the
    engine's output limit, the name it serves under and the optional API key."""

    def __init__(self, triton_url: str, tokenizer, max_output_len: int, model_name: str, api_key: str | None = None):
        self.triton_url, self.tokenizer, self.max_output_len = triton_url, tokenizer, max_output_len
        self.model_name, self.api_key = model_name, api_key
        # Idle gRPC streams, reused: opening one (a channel and a stream) per request cost the
        # requests of a burst their TTFT (commit ea7e8ec, BENCHMARKS.md at that commit, "Through
        # Triton"). Triton 2.51 does not exit while a stream is open, so release_streams ends the
        # reuse before a shutdown.
        self._streams: list[GrpcStream] = []
        self._reuse = True
        self._lock = threading.Lock()

    def release_streams(self) -> None:
        """Close the idle streams, and from now on each request's stream when it ends."""
        with self._lock:
            self._reuse, idle, self._streams = False, self._streams, []
        for stream in idle:
            stream.close()

    def _put_back(self, stream: GrpcStream) -> None:
        with self._lock:
            if self._reuse:
                self._streams.append(stream)
                return
        stream.close()

    def app(self) -> Starlette:
        return Starlette(routes=[
            Route("/v1/models", self._guarded(self.models), methods=["GET"]),
            Route("/v1/completions", self._guarded(self.completions), methods=["POST"]),
            Route("/v1/chat/completions", self._guarded(self.chat_completions), methods=["POST"]),
        ])

    def _guarded(self, endpoint):
        async def handle(request: Request):
            try:
                if self.api_key and request.headers.get("authorization") != f"Bearer {self.api_key}":
                    raise OpenAIError("a valid API key is needed (Authorization: Bearer ...)", 401,
                                      code="invalid_api_key")
                return await endpoint(request)
            except OpenAIError as e:
                return e.response()
        return handle

    async def models(self, request: Request) -> JSONResponse:
        model = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "dflash-trt"}
        return JSONResponse({"object": "list", "data": [model]})

    async def completions(self, request: Request):
        body = await _json(request)
        generation = parse_generation(body, completion_prompt(body), self.max_output_len)
        return await self._respond(body, generation, chat=False)

    async def chat_completions(self, request: Request):
        body = await _json(request)
        prompt = chat_prompt(body, self.tokenizer)
        return await self._respond(body, parse_generation(body, prompt, self.max_output_len), chat=True)

    async def _respond(self, body: dict, generation: Generation, chat: bool):
        meta = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", "created": int(time.time()),
                "model": str(body.get("model") or self.model_name)}
        completion = Completion()
        chunks = self._generate(generation, completion)
        # The first chunk is awaited before answering: an error the server finds in the request
        # becomes an HTTP status, not an event inside a 200 stream.
        first = await run_in_threadpool(next, chunks, "")
        if not generation.stream:
            cut = StopCut(generation.stop)
            text = cut.push(first + "".join(await run_in_threadpool(list, chunks))) + cut.end()
            return JSONResponse(_whole(meta, chat, text, completion.metrics, generation))
        return StreamingResponse(_events(meta, chat, first, chunks, completion, generation),
                                 media_type="text/event-stream")

    def _generate(self, g: Generation, completion: Completion) -> Iterator[str]:
        """The answer's text chunks from one streaming ensemble call; the call is cancelled if
        the iterator is closed early (its client went away)."""
        options = dict(max_tokens=g.max_tokens, temperature=g.temperature, top_k=g.top_k, top_p=g.top_p, seed=g.seed,
                       chat=False, thinking=False, stats=True, stop_words=g.stop)
        with self._lock:
            stream = self._streams.pop() if self._streams else None
        stream = stream or GrpcStream(self.triton_url)
        try:
            yield from stream.generate(g.prompt, stream=True, completion=completion, **options)
        except ClientError as e:
            stream.close()
            raise _error_of(e) from None
        except BaseException:  # GeneratorExit (the client went away) included: close cancels the request
            stream.close()
            raise
        self._put_back(stream)  # read to its final response: ready for the next request


async def _json(request: Request) -> dict:
    try:
        body = json.loads(await request.body())
    except (ValueError, UnicodeDecodeError) as e:
        raise OpenAIError(f"the request body is not valid JSON ({e})") from None
    if not isinstance(body, dict):
        raise OpenAIError("the request body must be a JSON object")
    return body


def _whole(meta: dict, chat: bool, text: str, metrics: dict, g: Generation) -> dict:
    reason = finish_reason(metrics, g)
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason}
    else:
        choice = {"index": 0, "text": text, "finish_reason": reason}
    return {**meta, "object": "chat.completion" if chat else "text_completion", "choices": [choice],
            "usage": usage_of(metrics), "dflash": dflash_stats(metrics)}


async def _events(meta: dict, chat: bool, first: str, chunks: Iterator[str], completion: Completion, g: Generation):
    kind = "chat.completion.chunk" if chat else "text_completion"

    def event(choices: list, **extra) -> str:
        return f"data: {json.dumps({**meta, 'object': kind, 'choices': choices, **extra})}\n\n"

    def delta(text: str, reason: str | None = None, role: bool = False) -> dict:
        if not chat:
            return {"index": 0, "text": text, "finish_reason": reason}
        change = {"role": "assistant", "content": text} if role else {"content": text} if text else {}
        return {"index": 0, "delta": change, "finish_reason": reason}

    cut = StopCut(g.stop)
    try:
        yield event([delta(cut.push(first), role=True)])
        while (text := await run_in_threadpool(next, chunks, _END)) is not _END:
            if text := cut.push(text):
                yield event([delta(text)])
        if text := cut.end():
            yield event([delta(text)])
        yield event([delta("", finish_reason(completion.metrics, g))], dflash=dflash_stats(completion.metrics))
        if g.include_usage:
            yield event([], usage=usage_of(completion.metrics))
    except OpenAIError as e:  # mid-stream: the status is sent already
        yield f"data: {json.dumps({'error': {'message': str(e), 'type': 'server_error', 'code': e.code}})}\n\n"
    finally:
        await run_in_threadpool(chunks.close)  # a client that went away cancels its server request
    yield "data: [DONE]\n\n"


class ApiServer:
    """The API served by uvicorn on a thread of the calling process (`dflash-trt serve` runs it
    beside tritonserver); `stop` ends it."""

    def __init__(self, frontend: Frontend, host: str, port: int, start_timeout_s: float = 30.0):
        self._frontend = frontend
        self._server = uvicorn.Server(uvicorn.Config(frontend.app(), host=host, port=port, log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, name="openai-api", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + start_timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise DFlashError(f"the OpenAI API could not listen on {host}:{port}")
            time.sleep(0.05)
        self.url = f"http://{host}:{port}/v1"

    def release_streams(self) -> None:
        """Before the Triton server stops: keep no gRPC stream open past a request (see Frontend)."""
        self._frontend.release_streams()

    def stop(self, timeout_s: float = 30.0) -> None:
        self._server.should_exit = True
        self._thread.join(timeout_s)
        self._frontend.release_streams()


def start_api(engine_dir: Path, triton_grpc: str, host: str, port: int, api_key: str | None = None,
              model_name: str | None = None) -> ApiServer:
    """The API of a built engine directory (its chat template and limits), in front of the
    Triton server whose gRPC endpoint is `triton_grpc`; it serves under `model_name`, by
    default the target checkpoint's name."""
    _, config = read_engine_record(engine_dir)
    name = model_name or (Path(config.target).name if config.target else "dflash-trt-demo")
    frontend = Frontend(triton_grpc, Tokenizer.from_dir(Path(engine_dir) / TOKENIZER_DIR), config.max_output_len,
                        name, api_key)
    return ApiServer(frontend, host, port)
