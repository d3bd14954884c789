"""`serving/server.py` against a real tritonserver (nvidia-pytriton's) on throwaway Python-backend models."""

import importlib.metadata
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from ports import free_ports

import dflash_trt
from dflash_trt.errors import ServeError
from dflash_trt.serving.server import SHM_DIR, TritonServer, _check_stub_numpy, check_ports_free, find_tritonserver

CONFIG = """
name: "{name}"
backend: "python"
max_batch_size: 0
input [
  {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] }},
  {{ name: "TEXT" data_type: TYPE_STRING dims: [ -1 ] }}
]
output [
  {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] }},
  {{ name: "TEXT_OUT" data_type: TYPE_STRING dims: [ -1 ] }},
  {{ name: "WHERE" data_type: TYPE_STRING dims: [ 3 ] }}
]
instance_group [ {{ kind: KIND_CPU count: 1 }} ]
"""

# Imports numpy and dflash_trt as the real adapters do, echoes its inputs, and says which
# dflash_trt, environment and Python build (libpython) the stub process runs.
ECHO = """
import sys

import numpy as np
import triton_python_backend_utils as pb_utils

import dflash_trt


class TritonPythonModel:
    def initialize(self, args):
        pass  # WORKER

    def execute(self, requests):
        where = np.array([s.encode() for s in (dflash_trt.__file__, sys.prefix, sys.version)], dtype=object)
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            text = pb_utils.get_input_tensor_by_name(request, "TEXT").as_numpy()
            outputs = [pb_utils.Tensor("OUTPUT0", x), pb_utils.Tensor("TEXT_OUT", text),
                       pb_utils.Tensor("WHERE", where)]
            responses.append(pb_utils.InferenceResponse(outputs))
        return responses
"""

# A model that starts a worker process, as a tensor-parallel model would; nothing ends the
# worker when Triton stops, except killing the server's whole process group.
WORKER = ECHO.replace("pass  # WORKER", "import subprocess; self.worker = subprocess.Popen(['sleep', '600'])")

FAILING = """
class TritonPythonModel:
    def initialize(self, args):
        raise RuntimeError("echo cannot start: engine.json is missing")
"""


def write_repository(tmp: Path, model_py: str, name: str = "echo") -> Path:
    root = tmp / "repository"
    (root / name / "1").mkdir(parents=True)
    (root / name / "config.pbtxt").write_text(CONFIG.format(name=name))
    (root / name / "1" / "model.py").write_text(model_py)
    return root


def make_server(repository: Path, ports=None, **kwargs) -> TritonServer:
    http, grpc, metrics = ports or free_ports()
    # A PATH without this venv, as when .venv/bin/dflash-trt runs unactivated: the server
    # must still hand the stub this interpreter.
    return TritonServer(repository, http_port=http, grpc_port=grpc, metrics_port=metrics, host="127.0.0.1",
                        env={"PATH": os.defpath}, log_path=repository.parent / "tritonserver.log", **kwargs)


def live_in_group(pgid: int) -> dict[int, str]:
    """pid -> command line of every non-zombie process in a process group."""
    found = {}
    for proc in Path("/proc").iterdir():
        try:
            stat = (proc / "stat").read_text()
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, ValueError):
            continue
        state, _, pgrp = stat[stat.rindex(")") + 2:].split()[:3]
        if int(pgrp) == pgid and state not in "ZX":
            found[int(proc.name)] = cmdline
    return found


def regions(server: TritonServer) -> list[Path]:
    """The shared-memory regions of the server's stubs that are still there."""
    return list(SHM_DIR.glob(f"{server.shm_prefix}*"))


@pytest.fixture(scope="module")
def echo_server(tmp_path_factory):
    repository = write_repository(tmp_path_factory.mktemp("repo"), ECHO)
    with make_server(repository) as server:
        yield server


def echo_inputs(client_module, x, text):
    inputs = [client_module.InferInput("INPUT0", list(x.shape), "FP32"),
              client_module.InferInput("TEXT", list(text.shape), "BYTES")]
    inputs[0].set_data_from_numpy(x)
    inputs[1].set_data_from_numpy(text)
    return inputs


def test_started_server_is_ready(echo_server):
    with urllib.request.urlopen(f"{echo_server.endpoints.http}/v2/health/ready", timeout=5) as r:
        assert r.status == 200
    with urllib.request.urlopen(echo_server.endpoints.metrics, timeout=5) as r:
        assert b"nv_inference_request_success" in r.read()


@pytest.mark.parametrize("client_module", [httpclient, grpcclient], ids=["http", "grpc"])
def test_echo_model_answers_over_http_and_grpc(echo_server, client_module):
    endpoints = echo_server.endpoints
    url = endpoints.http.removeprefix("http://") if client_module is httpclient else endpoints.grpc
    x = np.array([1.5, -2.0, 3.25], dtype=np.float32)
    text = np.array(["héllo", "wörld"], dtype=object)
    result = client_module.InferenceServerClient(url).infer("echo", echo_inputs(client_module, x, text))
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), x)
    assert [t.decode() for t in result.as_numpy("TEXT_OUT")] == ["héllo", "wörld"]
    # The stub runs model.py in this very environment, with this checkout's dflash_trt, on
    # this interpreter's libpython (not a system one of another patch release).
    module_file, prefix, version = (t.decode() for t in result.as_numpy("WHERE"))
    assert (Path(module_file), prefix, version) == (Path(dflash_trt.__file__), sys.prefix, sys.version)


def test_stop_ends_the_server_its_stubs_and_their_workers(tmp_path):
    server = make_server(write_repository(tmp_path, WORKER))
    server.start()
    pgid = server.pid
    commands = " | ".join(live_in_group(pgid).values())
    assert "triton_python_backend_stub" in commands and "sleep 600" in commands
    assert len(regions(server)) == 1  # the stub's
    assert server.stop() == 0
    assert live_in_group(pgid) == {}
    assert regions(server) == []
    check_ports_free("127.0.0.1", server.ports)


def test_wait_returns_when_the_server_is_killed_and_ends_what_it_started(tmp_path):
    server = make_server(write_repository(tmp_path, WORKER))
    server.start()
    pgid = server.pid
    os.kill(pgid, signal.SIGKILL)
    assert server.wait() == -signal.SIGKILL
    assert live_in_group(pgid) == {}
    assert regions(server) == []  # a killed stub cannot remove its own region


def test_watch_returns_naming_the_stub_that_died_and_stop_removes_what_it_left(tmp_path):
    server = make_server(write_repository(tmp_path, ECHO))
    server.start()
    (stub,) = server.stubs()
    assert server.stubs() == {stub: "echo"}
    found = []
    watcher = threading.Thread(target=lambda: found.append(server.watch()))
    watcher.start()
    time.sleep(0.5)
    assert found == []  # nothing died yet
    os.kill(stub, signal.SIGKILL)
    watcher.join(10)
    assert found == [f"the Python backend stub of model 'echo' (pid {stub}) exited"]
    server.stop()
    assert live_in_group(server.pid) == {}
    assert regions(server) == []


def test_server_stops_when_the_process_that_started_it_is_killed(tmp_path):
    repository = write_repository(tmp_path, ECHO)
    launcher = f"""
import sys, time
from dflash_trt.serving.server import TritonServer
server = TritonServer({str(repository)!r}, http_port={{}}, grpc_port={{}}, metrics_port={{}}, host="127.0.0.1",
                      log_path={str(tmp_path / "tritonserver.log")!r})
server.start()
print(server.pid, server.shm_prefix, flush=True)
time.sleep(600)
""".format(*free_ports())
    parent = subprocess.Popen([sys.executable, "-c", launcher], stdout=subprocess.PIPE, text=True)
    try:
        pgid, prefix = parent.stdout.readline().split()
        pgid = int(pgid)
    finally:
        parent.kill()  # SIGKILL: no Python cleanup runs, only the parent-death signal
        parent.wait()
    deadline = time.monotonic() + 30
    while live_in_group(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert live_in_group(pgid) == {}
    assert list(SHM_DIR.glob(f"{prefix}*")) == []  # tritonserver's own clean shutdown removed them


def fake_numpy(site: Path, version: str) -> Path:
    (site / "numpy").mkdir(parents=True)
    (site / "numpy" / "__init__.py").write_text(f"__version__ = {version!r}\n")
    return site


def test_a_numpy_2_the_stub_would_import_is_refused_naming_it(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next(venv.glob("lib/python3.*/site-packages"))
    fake_numpy(site, "2.0.0")
    with pytest.raises(ServeError, match="numpy 2.0.0") as e:
        _check_stub_numpy(venv / "bin")
    assert str(site / "numpy") in str(e.value)


def test_a_numpy_on_pythonpath_neither_breaks_nor_satisfies_the_stub_numpy_check(tmp_path, monkeypatch):
    # The stub runs Python isolated: only what this interpreter's environment holds counts.
    monkeypatch.setenv("PYTHONPATH", str(fake_numpy(tmp_path / "shadow", "2.0.0")))
    _check_stub_numpy(Path(sys.executable).parent)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    monkeypatch.setenv("PYTHONPATH", str(Path(np.__file__).parent.parent))
    with pytest.raises(ServeError, match="without PYTHONPATH"):
        _check_stub_numpy(venv / "bin")


def test_an_environment_without_python3_is_named(tmp_path):
    with pytest.raises(ServeError, match=f"{tmp_path} has no runnable python3"):
        _check_stub_numpy(tmp_path)


def test_busy_port_is_named_before_launch(tmp_path):
    ports = free_ports()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", ports[1]))
        taken.listen()
        server = make_server(write_repository(tmp_path, ECHO), ports)
        with pytest.raises(ServeError, match=f"port {ports[1]} "):
            server.start()
    assert server.pid is None


def test_busy_port_met_by_tritonserver_fails_with_its_log(tmp_path):
    ports = free_ports()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", ports[2]))
        taken.listen()
        server = make_server(write_repository(tmp_path, ECHO), ports, check_ports=False)
        started = time.monotonic()
        with pytest.raises(ServeError) as error:
            server.start(timeout=60)
    assert time.monotonic() - started < 30
    assert f"127.0.0.1:{ports[2]}' already in use" in str(error.value)
    assert live_in_group(server.pid) == {}
    assert regions(server) == []  # tritonserver exited without unloading: its stub removed nothing


def test_failing_model_fails_start_with_the_model_error(tmp_path):
    server = make_server(write_repository(tmp_path, FAILING))
    with pytest.raises(ServeError) as error:
        server.start(timeout=60)
    message = str(error.value)
    assert "exited with code 1" in message
    assert "echo cannot start: engine.json is missing" in message
    assert live_in_group(server.pid) == {}


def test_missing_repository_fails_before_launch(tmp_path):
    server = make_server(tmp_path / "nope")
    with pytest.raises(ServeError, match="nope"):
        server.start()
    assert server.pid is None


def test_find_tritonserver_rejects_a_missing_explicit_path(tmp_path):
    with pytest.raises(ServeError, match=str(tmp_path / "tritonserver")):
        find_tritonserver(tmp_path / "tritonserver")


def test_find_tritonserver_prefers_path_over_the_bundled_binary(tmp_path, monkeypatch):
    fake = tmp_path / "tritonserver"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert find_tritonserver() == fake


def test_find_tritonserver_defaults_to_the_pytriton_binary(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty PATH: no tritonserver there
    wheel = importlib.metadata.distribution("nvidia-pytriton")
    bundled = Path(wheel.locate_file("pytriton/tritonserver/bin/tritonserver"))
    assert find_tritonserver() == bundled
    assert os.access(bundled, os.X_OK)
