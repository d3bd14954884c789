"""What the served end-to-end tests share: a real tritonserver on a built output directory,
clients that call it the way Triton TensorRT-LLM clients do (tritonclient HTTP and gRPC,
gRPC streaming, the HTTP generate endpoints), and the in-process greedy reference that
every served output is compared with."""

import contextlib
import json
import queue
import re
import urllib.request
from pathlib import Path

import numpy as np
import pytest

grpcclient = pytest.importorskip("tritonclient.grpc", reason="needs tritonclient[grpc,http]")
httpclient = pytest.importorskip("tritonclient.http", reason="needs tritonclient[grpc,http]")
from ports import free_ports  # noqa: E402
from tritonclient.utils import InferenceServerException, np_to_triton_dtype  # noqa: E402, F401 (for the tests)

from dflash_trt.sampling import SamplingParams  # noqa: E402
from dflash_trt.serving import protocol as p  # noqa: E402
from dflash_trt.serving.server import TritonServer  # noqa: E402

MAX_TOKENS = 32  # what a request asks for unless a test says otherwise
TIMEOUT_S = 60


@contextlib.contextmanager
def serving(output: Path):
    """A tritonserver on `output`/model_repository (as `dflash-trt build` writes it), on free
    local ports; its log goes next to `output`."""
    http, grpc, metrics = free_ports(3)
    server = TritonServer(output / "model_repository", http_port=http, grpc_port=grpc, metrics_port=metrics,
                          host="127.0.0.1", log_path=output.parent / "tritonserver.log")
    server.start(timeout=180)
    try:
        yield server
    finally:
        server.stop()


# The served-engine fixtures of a module that defines `engine_dir` (a `dflash-trt build` output)
# and imports these three.


@pytest.fixture(scope="module")
def server(engine_dir):
    with serving(engine_dir) as server:
        yield server


@pytest.fixture(scope="module")
def local(engine_dir):
    """The same engine in-process: the reference every server output is compared with."""
    from dflash_trt.loading import load_engine

    return load_engine(engine_dir / "engine")


@pytest.fixture(scope="module")
def expected(local):
    """prompt (or chat text) -> greedy AR output ids without the end token, computed once."""
    return greedy_reference(local)


def greedy_reference(local):
    """(prompt or chat text, max_tokens) -> the in-process engine's greedy AR output ids
    without the end token, each computed once. `local` is a build.LoadedEngine."""
    cache = {}
    tok = local.tokenizer

    def get(prompt, max_tokens=MAX_TOKENS):
        if (prompt, max_tokens) not in cache:
            params = SamplingParams(max_tokens=max_tokens, stop_token_ids=tuple(tok.stop_token_ids))
            ids = local.engine.generate([tok.encode(prompt)], params, mode="ar")[0].token_ids
            cache[prompt, max_tokens] = ids[:-1] if ids and ids[-1] in tok.stop_token_ids else ids
        return cache[prompt, max_tokens]

    return get


def expected_text(local, expected, prompt, max_tokens=MAX_TOKENS):
    return local.tokenizer.decode(expected(prompt, max_tokens))


def tensors(module, text=None, max_tokens=MAX_TOKENS, **extra):
    """Client input tensors with the batch dimension; a value of None leaves the input out."""
    values = {p.TEXT_INPUT: None if text is None else np.array([[text.encode()]], dtype=object),
              p.MAX_TOKENS: None if max_tokens is None else np.array([[max_tokens]], dtype=np.int32)}
    dtypes = {s.name: p.NUMPY_DTYPES[s.dtype] for s in p.ENSEMBLE_INPUTS}
    for name, value in extra.items():
        values[name] = value if isinstance(value, np.ndarray) else np.array([[value]], dtype=dtypes[name])
    out = []
    for name, array in values.items():
        if array is not None:
            tensor = module.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
            tensor.set_data_from_numpy(array)
            out.append(tensor)
    return out


def http_client(server):
    return httpclient.InferenceServerClient(server.endpoints.http.removeprefix("http://"))


def grpc_client(server):
    return grpcclient.InferenceServerClient(server.endpoints.grpc)


def text_of(result):
    return result.as_numpy(p.TEXT_OUTPUT)[0, 0].decode("utf-8")


def http_infer(server, model=p.ENSEMBLE_UNARY, inputs=None, **kw):
    # Clients are closed after use: the server waits for open HTTP connections at shutdown.
    with http_client(server) as client:
        return client.infer(model, inputs or tensors(httpclient, **kw))


def grpc_infer(server, **kw):
    with grpc_client(server) as client:
        return text_of(client.infer(p.ENSEMBLE_UNARY, tensors(grpcclient, **kw)))


def grpc_stream(server, model=p.ENSEMBLE, inputs=None, stop_after=None, **kw):
    """Raw text_output bytes of every response of one gRPC streaming request.

    stop_after=n cancels the stream after n responses (a client that goes away)."""
    client, responses = grpc_client(server), queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        client.async_stream_infer(model, inputs or tensors(grpcclient, **kw), enable_empty_final_response=True)
        chunks = []
        while stop_after is None or len(chunks) < stop_after:
            result, error = responses.get(timeout=TIMEOUT_S)
            if error is not None:
                raise error
            output = result.as_numpy(p.TEXT_OUTPUT if model == p.ENSEMBLE else p.OUTPUT_TEXT)
            if output is not None:
                chunks.append(output[0, 0])
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
        return chunks
    finally:
        client.stop_stream(cancel_requests=stop_after is not None)
        client.close()


def post(server, path, body):
    request = urllib.request.Request(f"{server.endpoints.http}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(request, timeout=TIMEOUT_S) as response:
        return response.read().decode("utf-8")


def server_rss_kib(server) -> dict[str, int]:
    """Resident memory of tritonserver and of each Python backend stub it runs, by name."""
    rss = {}
    needle = str(server.repository).encode()
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            if proc.name == str(server.pid):
                name = "tritonserver"
            elif argv[0].endswith(b"triton_python_backend_stub") and any(needle in arg for arg in argv):
                name = next(a.decode() for a in argv if needle in a).split("/")[-3]  # .../<model>/1/model.py
            else:
                continue
            rss[name] = int(re.search(r"VmRSS:\s+(\d+)", (proc / "status").read_text()).group(1))
        except (OSError, IndexError, AttributeError, StopIteration):
            continue
    return rss
