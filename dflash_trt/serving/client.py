"""A small tritonclient wrapper for the `ensemble` model (what `dflash-trt generate` uses).

Any tritonclient script that speaks the Triton TensorRT-LLM backend's ensemble contract
works the same way; this module only saves the boilerplate.
"""

from __future__ import annotations

import http.client
import json
import queue
import urllib.parse
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from dflash_trt.errors import DFlashError
from dflash_trt.serving import protocol as p


class ClientError(DFlashError):
    """The server answered with an error, or could not be reached."""


@dataclass
class Completion:
    """Filled as responses arrive; `metrics` holds the perf outputs when they were asked for."""

    text: str = ""
    metrics: dict[str, float] = field(default_factory=dict)


def _inputs(module, prompt: str, *, max_tokens: int, stream: bool, temperature: float, top_k: int, top_p: float,
            seed: int | None, chat: bool, thinking: bool, stats: bool, stop_words: tuple[str, ...] = ()):
    values = [
        (p.TEXT_INPUT, np.array([[prompt.encode()]], dtype=np.object_)),
        (p.MAX_TOKENS, np.array([[max_tokens]], dtype=np.int32)),
        (p.STREAM, np.array([[stream]])),
        (p.TEMPERATURE, np.array([[temperature]], dtype=np.float32)),
        (p.TOP_K, np.array([[top_k]], dtype=np.int32)),
        (p.TOP_P, np.array([[top_p]], dtype=np.float32)),
        (p.CHAT, np.array([[chat]])),
        (p.THINKING, np.array([[thinking]])),
        (p.RETURN_PERF_METRICS, np.array([[stats]])),
        (p.EXCLUDE_INPUT_IN_OUTPUT, np.array([[True]])),  # print the answer, not the prompt again
    ]
    if seed is not None:
        values.append((p.SEED, np.array([[seed]], dtype=np.uint64)))
    if stop_words:
        values.append((p.STOP_WORDS, np.array([[w.encode() for w in stop_words]], dtype=np.object_)))
    tensors = []
    for name, value in values:
        dtype = "BYTES" if value.dtype == np.object_ else {np.bool_: "BOOL", np.int32: "INT32", np.float32: "FP32",
                                                           np.uint64: "UINT64"}[value.dtype.type]
        tensor = module.InferInput(name, list(value.shape), dtype)
        tensor.set_data_from_numpy(value)
        tensors.append(tensor)
    return tensors


def _read(result, completion: Completion) -> str:
    chunk = b"".join(result.as_numpy(p.TEXT_OUTPUT).reshape(-1)).decode()
    completion.text += chunk
    for spec in p.PERF_OUTPUTS:
        value = result.as_numpy(spec.name)
        if value is not None:
            completion.metrics[spec.name] = value.reshape(-1)[0].item()
    return chunk


def generate(url: str, prompt: str, *, protocol: str = "grpc", stream: bool = False,
             completion: Completion | None = None, **options) -> Iterator[str]:
    """Yield the text as it arrives (one chunk when not streaming); fills `completion`."""
    completion = completion if completion is not None else Completion()
    if stream and protocol != "grpc":
        raise ClientError("streaming needs --protocol grpc (Triton's HTTP streaming is the generate_stream endpoint)")
    if protocol == "http":
        # tritonclient is optional (the serve extra), and its HTTP client pulls in gevent
        import tritonclient.http as module
        from tritonclient.utils import InferenceServerException

        try:
            client = module.InferenceServerClient(url)
            # Triton 2.51 refuses unary calls on an ensemble with a decoupled step; ensemble_unary relays them.
            result = client.infer(p.ENSEMBLE_UNARY, _inputs(module, prompt, stream=False, **options))
        except (InferenceServerException, ConnectionError, OSError, http.client.HTTPException) as e:
            # HTTPException: what answered is not an HTTP server (e.g. the gRPC port)
            raise ClientError(f"{url}: {e!r}") from None
        yield _read(result, completion)
        return
    yield from _grpc(url, prompt, stream, completion, options)


def _grpc(url, prompt, stream, completion, options) -> Iterator[str]:
    from tritonclient.utils import InferenceServerException  # optional (the serve extra)

    try:
        with GrpcStream(url) as connection:
            yield from connection.generate(prompt, stream=stream, completion=completion, **options)
    except InferenceServerException as e:
        raise ClientError(f"{url}: {e}") from None


class GrpcStream:
    """One gRPC stream to the `ensemble`; requests go over it one after another, each
    read to its final response before the next is sent (what a closed-loop client does)."""

    def __init__(self, url: str):
        import tritonclient.grpc as module  # optional (the serve extra)

        self.url, self._module = url, module
        self._responses: queue.Queue = queue.Queue()
        self._unfinished = False  # a request whose final response has not been read
        self._client = module.InferenceServerClient(url)
        try:
            self._client.start_stream(callback=lambda result, error: self._responses.put((result, error)))
        except BaseException:
            self._client.close()
            raise

    def generate(self, prompt: str, *, stream: bool, completion: Completion, timeout_s: float | None = None,
                 **options) -> Iterator[str]:
        """Yield the text as it arrives; `completion` gets the text and the perf metrics."""
        self._client.async_stream_infer(p.ENSEMBLE, _inputs(self._module, prompt, stream=stream, **options),
                                        enable_empty_final_response=True)
        self._unfinished = True
        while True:
            try:
                result, error = self._responses.get(timeout=timeout_s)
            except queue.Empty:
                raise ClientError(f"{self.url}: no response within {timeout_s:g} s") from None
            if error is not None:
                raise ClientError(f"{self.url}: {error}")
            final = result.get_response().parameters.get("triton_final_response")
            if result.as_numpy(p.TEXT_OUTPUT) is not None:
                yield _read(result, completion)
            if final is None or final.bool_param:
                self._unfinished = False
                return

    def close(self) -> None:
        # Cancel only a request left unfinished (an error, an abandoned generator). After many
        # idle streams were stopped with cancellation, Triton 2.51 kept the ensemble loaded at
        # shutdown and waited out its whole exit timeout (seen in tests/test_bench_triton.py).
        try:
            self._client.stop_stream(cancel_requests=self._unfinished)
        finally:
            self._client.close()

    def __enter__(self) -> "GrpcStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class OpenAIStream:
    """The same contract as GrpcStream over the OpenAI-compatible API (`serve --openai-port`):
    one kept-alive HTTP connection, a streamed (server-sent events) chat or text completion
    per request. The final events' `usage` and `dflash` fields fill completion.metrics under
    the perf output names, so a bench over either path reads the same figures."""

    def __init__(self, url: str, api_key: str | None = None):
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ClientError(f"{url}: not an http(s):// address of the OpenAI API")
        self.url = url
        self._prefix = parts.path.rstrip("/").removesuffix("/v1") + "/v1"
        kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        self._connection = kind(parts.hostname, parts.port)
        self._headers = {"Content-Type": "application/json"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"

    def models(self, timeout_s: float = 10.0) -> list[str]:
        """The model ids the API lists (a liveness check)."""
        self._connection.timeout = timeout_s
        body = self._call("GET", "/models", None)
        return [m["id"] for m in json.loads(body.read())["data"]]

    def generate(self, prompt: str, *, stream: bool, completion: Completion, timeout_s: float | None = None,
                 max_tokens: int, temperature: float, top_k: int, top_p: float, seed: int | None, chat: bool,
                 thinking: bool, stats: bool = True, stop_words: tuple[str, ...] = ()) -> Iterator[str]:
        request = {"max_tokens": max_tokens, "temperature": temperature, "top_k": top_k, "top_p": top_p,
                   "stream": True, "stream_options": {"include_usage": True}}
        if seed is not None:
            request["seed"] = seed
        if stop_words:
            request["stop"] = list(stop_words)
        if chat:
            request.update(messages=[{"role": "user", "content": prompt}],
                           chat_template_kwargs={"enable_thinking": thinking})
        else:
            request["prompt"] = prompt
        self._connection.timeout = timeout_s
        response = self._call("POST", "/chat/completions" if chat else "/completions", request)
        for line in response:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise ClientError(f"{self.url}: {event['error'].get('message')}")
            for choice in event["choices"]:
                text = choice["delta"].get("content", "") if chat else choice["text"]
                if text:
                    completion.text += text
                    yield text
            self._record(event, completion)

    @staticmethod
    def _record(event: dict, completion: Completion) -> None:
        if usage := event.get("usage"):
            completion.metrics[p.NUM_INPUT_TOKENS] = usage["prompt_tokens"]
            completion.metrics[p.NUM_OUTPUT_TOKENS] = usage["completion_tokens"]
        if stats := event.get("dflash"):
            completion.metrics.update({p.MEAN_ACCEPTANCE_LENGTH: stats["mean_acceptance_length"],
                                       p.ACCEPTANCE_RATE: stats["acceptance_rate"],
                                       p.TOTAL_ACCEPTED_DRAFT_TOKENS: stats["accepted_draft_tokens"],
                                       p.TOTAL_DRAFT_TOKENS: stats["draft_tokens"]})

    def _call(self, method: str, path: str, body: dict | None) -> http.client.HTTPResponse:
        try:
            self._connection.request(method, self._prefix + path, json.dumps(body) if body is not None else None,
                                     self._headers)
            response = self._connection.getresponse()
        except (OSError, http.client.HTTPException) as e:
            self._connection.close()
            raise ClientError(f"{self.url}: cannot reach the OpenAI API ({e!r})") from None
        if response.status != 200:
            detail = response.read().decode(errors="replace")
            raise ClientError(f"{self.url}: HTTP {response.status}: {detail}")
        return response

    def close(self) -> None:
        self._connection.close()

    def __enter__(self) -> "OpenAIStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
