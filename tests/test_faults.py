"""`dflash-trt serve` when things go wrong, as a supervisor sees it: a real serve process, a
real tritonserver, the demo engine. The admin APIs are locked and nothing listens beyond
loopback by default; a dead model process stops the whole server with a non-zero exit; a
stop at any moment leaves no process and no shared-memory region behind, and requests in
flight end with a final response or an error, never a cut stream."""

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from ports import free_ports
from test_serve import live_in_group
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from dflash_trt.build import run
from dflash_trt.config import resolve_config
from dflash_trt.serving import dflash_model

REPO = Path(__file__).resolve().parent.parent
ADMIN_HEADER = "dflash-trt-admin-key"  # the documented interface, spelled out
SHM_DIR = Path("/dev/shm")
EXIT_S = 15  # how long serve may take to exit once it has something to exit for (a few s, measured)
LOOPBACK = {"0100007F", "0000000000000000FFFF00000100007F", "00000000000000000000000001000000"}  # /proc/net


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("faults") / "demo"
    run(resolve_config("tiny", max_output_len=1024), out)  # room for requests that outlast a drain
    return out


class Serve:
    """A `python -m dflash_trt serve` process on free ports, and what it started."""

    def __init__(self, demo, *args):
        self.ports = free_ports(3)
        http, grpc, metrics = self.ports
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dflash_trt", "serve", str(demo), "--http-port", str(http),
             "--grpc-port", str(grpc), "--metrics-port", str(metrics), "--openai-port", "0", *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.pgid = self.shm_prefix = None
        self.err_lines = []  # read as they come: a test waits for a line that may never come
        self._err_reader = threading.Thread(target=self._read_err, daemon=True)
        self._err_reader.start()

    def _read_err(self):
        for line in self.proc.stderr:
            self.err_lines.append(line)

    def wait_for_tritonserver(self, until=lambda serve: True, timeout=60):
        """Wait for its tritonserver (our process group id) and then for `until(self)`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            if self.pgid is None:
                self._find_tritonserver()
            if self.pgid is not None and until(self):
                return
            time.sleep(0.05)
        raise AssertionError(f"serve started no tritonserver in time: {self.proc.poll()}, {self.err_lines}")

    def wait_ready(self):
        line = self.proc.stdout.readline()  # printed once the server is ready
        assert line.startswith("HTTP"), (line, self.proc.wait(60), self.err_lines)
        self.wait_for_tritonserver()
        self.stdout = [line] + [self.proc.stdout.readline() for _ in range(2)]

    def err_line(self, containing: str, timeout=10) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [line for line in self.err_lines if containing in line]
            if found:
                return found[0]
            time.sleep(0.05)
        raise AssertionError(f"serve printed no {containing!r} to stderr: {self.err_lines}")

    def stubs(self) -> dict[int, str]:
        return {pid: cmd for pid, cmd in live_in_group(self.pgid).items() if "triton_python_backend_stub" in cmd}

    def stub_of(self, model: str) -> int:
        (pid,) = [pid for pid, cmd in self.stubs().items() if f"/{model}/1/model.py" in cmd]
        return pid

    def regions(self) -> list[Path]:
        return sorted(SHM_DIR.glob(f"{self.shm_prefix}*"))

    def exit(self, timeout=EXIT_S) -> tuple[int, str, float]:
        """serve's exit code, its stderr, and how long it took to exit; its stdout in self.out."""
        started = time.monotonic()
        self.proc.wait(timeout)
        took = time.monotonic() - started
        self.out = self.proc.stdout.read()
        self._err_reader.join(10)
        return self.proc.returncode, "".join(self.err_lines), took

    def kill(self):
        """End whatever a failed test left running."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.pgid is not None:
            if live_in_group(self.pgid):
                os.killpg(self.pgid, signal.SIGKILL)
            for region in self.regions():
                region.unlink(missing_ok=True)

    def assert_nothing_left(self):
        deadline = time.monotonic() + 5  # SIGKILLed processes take a moment to disappear
        while live_in_group(self.pgid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert live_in_group(self.pgid) == {}
        assert self.regions() == []

    def _find_tritonserver(self):
        for proc in Path("/proc").iterdir():
            try:
                stat = (proc / "stat").read_text()
                argv = (proc / "cmdline").read_bytes().decode().split("\0")
            except (OSError, ValueError):
                continue
            if int(stat[stat.rindex(")") + 2:].split()[1]) == self.proc.pid and argv[0].endswith("tritonserver"):
                self.pgid = int(proc.name)
                options = [a.rsplit("=", 1)[1] for a in argv if "shm-region-prefix-name=" in a]
                # Without the option (an older serve) the regions have Triton's default prefix.
                self.shm_prefix = options[-1] if options else "triton_python_backend_shm_region_"
                return


@pytest.fixture
def make_serve(demo):
    started = []

    def make(*args):
        started.append(Serve(demo, *args))
        return started[-1]

    yield make
    for serve in started:
        serve.kill()


@pytest.fixture(scope="module")
def serving(demo):
    serve = Serve(demo)
    try:
        serve.wait_ready()
        yield serve
        serve.proc.send_signal(signal.SIGTERM)
        assert serve.exit(60)[0] == 0
        serve.assert_nothing_left()
    finally:
        serve.kill()


def http(serve, method, path, body=None, headers=None):
    """(status, body) of one HTTP call, error statuses included."""
    request = urllib.request.Request(f"http://127.0.0.1:{serve.ports[0]}{path}", method=method, headers=headers or {},
                                     data=None if body is None else json.dumps(body).encode())
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(request, timeout=60) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def listening_addresses(port: int) -> set[str]:
    """The local addresses (as /proc/net/tcp* writes them) of the sockets listening on `port`."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, _, state = line.split()[1:4]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:
                found.add(address)
    return found


# -- A: what the server exposes ----------------------------------------------------------------


def test_serve_listens_on_loopback_only_and_prints_it(serving):
    assert [line.split()[0] for line in serving.stdout] == ["HTTP", "GRPC", "metrics"]
    assert all("127.0.0.1" in line for line in serving.stdout), serving.stdout
    for port in serving.ports:
        addresses = listening_addresses(port)
        assert addresses and addresses <= LOOPBACK, (port, addresses)


def test_admin_apis_need_the_key_and_inference_does_not(serving):
    key_line = serving.err_line(ADMIN_HEADER)
    key_file = Path(key_line.split("key in ")[1].strip())
    assert key_file.stat().st_mode & 0o077 == 0  # readable by this user only
    key = key_file.read_text().strip()
    for method, path in [("POST", "/v2/repository/index"), ("GET", "/v2/logging"), ("GET", "/v2/trace/setting"),
                         ("GET", "/v2/systemsharedmemory/status")]:
        status, body = http(serving, method, path, body={} if method == "POST" else None)
        assert status == 403 and ADMIN_HEADER in body, (path, status, body)
        assert http(serving, method, path, body={} if method == "POST" else None, headers={ADMIN_HEADER: key})[0] == 200
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{serving.ports[1]}")
    with pytest.raises(InferenceServerException, match=ADMIN_HEADER):
        client.get_model_repository_index()
    assert client.get_log_settings(headers={f"triton-grpc-protocol-{ADMIN_HEADER}": key})
    client.close()
    status, body = http(serving, "POST", "/v2/models/ensemble/generate", {"text_input": "Hello", "max_tokens": 4})
    assert status == 200 and json.loads(body)["text_output"], body
    assert http(serving, "GET", "/v2/health/ready")[0] == 200


# -- B: a dead model process -------------------------------------------------------------------


@pytest.mark.parametrize("model", ["dflash", "preprocessing"])
def test_serve_exits_non_zero_when_a_model_process_dies(make_serve, model):
    serve = make_serve()
    serve.wait_ready()
    os.kill(serve.stub_of(model), signal.SIGKILL)  # as the OOM killer would
    code, err, took = serve.exit()
    assert code != 0 and f"model '{model}'" in err, err
    assert took < EXIT_S
    serve.assert_nothing_left()


class FakeWorker:
    alive = True

    def stop(self):
        self.alive = False


@pytest.mark.parametrize("stop", [False, True], ids=["engine-thread-dies", "finalize"])
def test_the_dflash_stub_ends_itself_when_its_engine_thread_dies_unasked(monkeypatch, stop):
    worker, exits = FakeWorker(), []
    monkeypatch.setattr(dflash_model.EngineWorker, "load", lambda path, **options: worker)
    monkeypatch.setattr(dflash_model, "engine_dir_from_args", lambda args: None)
    monkeypatch.setattr(dflash_model, "on_sigterm", lambda callback: None)  # not in the test process
    monkeypatch.setattr(os, "_exit", exits.append)
    model = dflash_model.DFlashModel(pb_utils=None)
    model.initialize({"model_name": "dflash", "model_version": "1"})
    try:
        if stop:
            model.finalize()
        else:
            worker.alive = False
        time.sleep(10 * dflash_model.POLL_S + 0.5)
        assert exits == ([] if stop else [1])
    finally:
        model.finalize()  # ends the watchdog before os._exit is real again


# -- C: stopping -------------------------------------------------------------------------------


def loading_dflash(serve) -> bool:
    """Whether the dflash model's stub has started: it loads the engine (seconds) before ready."""
    return any("/dflash/1/model.py" in command for command in serve.stubs().values())


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_while_the_models_load_leaves_nothing_behind(make_serve, signum):
    serve = make_serve()
    serve.wait_for_tritonserver(until=loading_dflash)
    serve.proc.send_signal(signum)
    code, err, took = serve.exit()
    assert serve.out == "", "the server was ready already: this tests nothing"
    assert code == 0, err
    assert took < EXIT_S
    serve.assert_nothing_left()


def stream_inputs(max_tokens):
    arrays = {"text_input": np.array([[b"Hello"]], dtype=object), "max_tokens": np.array([[max_tokens]], dtype=np.int32),
              "stream": np.array([[True]]), "end_id": np.array([[3]], dtype=np.int32)}  # greedy never picks 3 here
    inputs = []
    for name, array in arrays.items():
        tensor = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def stream(serve, max_tokens, outcome: list, started: threading.Event | None = None):
    """One gRPC streaming request; appends ("final", n) or ("error", n, message), or
    ("cut", n) when the stream went silent or the connection dropped."""
    responses = queue.Queue()
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{serve.ports[1]}")
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    client.async_stream_infer("ensemble", stream_inputs(max_tokens), enable_empty_final_response=True)
    n = 0
    try:
        while True:
            result, error = responses.get(timeout=30)
            if started is not None:
                started.set()
            if error is not None:
                outcome.append(("cut", n, str(error)) if "Socket closed" in str(error) else ("error", n, str(error)))
                return
            n += 1
            if result.get_response().parameters["triton_final_response"].bool_param:
                outcome.append(("final", n))
                return
    except queue.Empty:
        outcome.append(("cut", n))
    finally:
        client.stop_stream()
        client.close()


def test_sigterm_drains_the_streams_in_flight_then_fails_the_rest(make_serve):
    drain = 2.0
    serve = make_serve("--drain-timeout", str(drain))
    serve.wait_ready()
    # Two requests end within the drain, two cannot (1024 tokens take the demo engine ~20 s).
    outcomes = [[] for _ in range(4)]
    started = [threading.Event() for _ in range(4)]
    threads = [threading.Thread(target=stream, args=(serve, tokens, outcome, event))
               for tokens, outcome, event in zip([8, 8, 1024, 1024], outcomes, started)]
    for thread in threads:
        thread.start()
    for event in started:
        assert event.wait(30)
    serve.proc.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    time.sleep(0.5)
    refused = []
    stream(serve, 8, refused)  # a request arriving during the drain
    code, err, _ = serve.exit(drain + EXIT_S)
    took = time.monotonic() - signalled
    for thread in threads:
        thread.join(30)
    results = [outcome[0] for outcome in outcomes]
    assert [result[0] for result in results[:2]] == ["final", "final"], results
    assert all(result[0] == "error" and "the server is shutting down" in result[2] for result in results[2:]), results
    assert refused[0][0] == "error" and "the server is shutting down" in refused[0][2], refused
    assert code == 0, err
    assert took < drain + 8, took  # the drain, then Triton unloads the models (~2 s)
    serve.assert_nothing_left()
