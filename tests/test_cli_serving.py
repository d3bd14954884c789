"""`dflash-trt serve` and `dflash-trt generate` as a user runs them: real processes, a real
tritonserver, the demo engine."""

import os
import signal
from concurrent.futures import ThreadPoolExecutor
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner
from openai import OpenAI
from ports import free_ports

from dflash_trt.build import run
from dflash_trt.cli import cli
from dflash_trt.config import resolve_config
from dflash_trt.loading import load_engine
from dflash_trt.sampling import SamplingParams

pytestmark = pytest.mark.slow
PROMPT = "Zürich"


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "demo"
    run(resolve_config("tiny"), out)
    return out


def start_serve(demo, ports, tritonserver_args=(), before=()):
    http, grpc, metrics, openai = ports
    cmd = [sys.executable, "-m", "dflash_trt", "serve", str(demo), "--host", "127.0.0.1", "--http-port", str(http),
           "--grpc-port", str(grpc), "--metrics-port", str(metrics), "--openai-port", str(openai), *before,
           "--", *tritonserver_args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def serving(demo):
    ports = free_ports(4)
    proc = start_serve(demo, ports)
    lines = [proc.stdout.readline() for _ in range(4)]  # printed once the server is ready
    assert lines[1].startswith("GRPC") and lines[3].startswith("OpenAI"), \
        (lines, proc.stderr.read() if proc.poll() is not None else "")
    yield proc, ports
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        proc.wait(60)


def expected_text(demo, max_tokens):
    local = load_engine(demo / "engine")
    tok = local.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": PROMPT}], enable_thinking=False)
    ids = local.engine.generate([tok.encode(text)], SamplingParams(max_tokens=max_tokens,
                                                                   stop_token_ids=tuple(tok.stop_token_ids)))[0]
    return tok.decode(ids.token_ids)


@pytest.mark.parametrize("args", [["--stream"], ["--protocol", "http"]])
def test_generate_prints_the_engines_text_and_stats(demo, serving, args):
    _, (http, grpc, _, _) = serving
    url = f"127.0.0.1:{grpc}" if "http" not in args else f"127.0.0.1:{http}"
    result = CliRunner().invoke(cli, ["generate", PROMPT, "--url", url, "--max-tokens", "12", "--stats", *args])
    assert result.exit_code == 0, result.output
    assert result.stdout.rstrip("\n") == expected_text(demo, 12)
    assert "mean acceptance length" in result.stderr and "tok/s" in result.stderr


def test_generate_against_no_server_fails_clearly():
    (port,) = free_ports(1)
    result = CliRunner().invoke(cli, ["generate", "hi", "--url", f"127.0.0.1:{port}", "--max-tokens", "4"])
    assert result.exit_code == 1 and f"127.0.0.1:{port}" in result.stderr


def test_generate_over_http_defaults_to_the_http_port():
    result = CliRunner().invoke(cli, ["generate", "hi", "--protocol", "http", "--max-tokens", "4"])
    assert result.exit_code == 1 and "localhost:8000" in result.stderr and "Traceback" not in result.output


def test_generate_over_http_at_a_grpc_port_fails_clearly(serving):
    _, (_, grpc, _, _) = serving
    result = CliRunner().invoke(cli, ["generate", "hi", "--protocol", "http", "--url", f"127.0.0.1:{grpc}"])
    assert result.exit_code == 1 and f"127.0.0.1:{grpc}" in result.stderr and "Traceback" not in result.output


def test_serve_exits_1_with_the_reason_when_a_port_is_taken(demo, serving):
    _, (http, _, _, _) = serving
    grpc, metrics, openai = free_ports(3)
    proc = start_serve(demo, (http, grpc, metrics, openai))
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1 and str(http) in err


def test_serve_passes_arguments_after_the_double_dash_to_tritonserver(demo):
    proc = start_serve(demo, free_ports(4), ["--model-control-mode=sometimes"])
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1 and "exited with code" in err, err


def test_serve_passes_the_draft_window_to_the_engine(demo):
    """The override reaches the dflash model (serve's environment): one below the block size
    fails its load, and serve says why."""
    proc = start_serve(demo, free_ports(4), before=["--draft-window-size", "3"])
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1 and "draft_window_size = 3 must be 0 (no window)" in err, err


def servers_of(demo) -> set[str]:
    return set(subprocess.run(["pgrep", "-f", f"model-repository={demo}"], capture_output=True, text=True).stdout.split())


def test_serve_stops_cleanly_on_sigterm_leaving_no_processes(demo):
    before = servers_of(demo)  # the module's other server may be running on the same repository
    proc = start_serve(demo, free_ports(4))
    assert proc.stdout.readline().startswith("HTTP")
    children = servers_of(demo) - before
    assert children, "tritonserver should be running"
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    proc.send_signal(signal.SIGINT)  # an impatient second signal must not orphan the server
    assert proc.wait(60) == 0
    deadline = time.time() + 10
    while time.time() < deadline and any(os.path.exists(f"/proc/{pid}") for pid in children):
        time.sleep(0.2)
    assert not any(os.path.exists(f"/proc/{pid}") for pid in children)


def test_serve_stops_promptly_after_openai_requests_left_idle_streams(demo):
    """The API keeps each finished request's gRPC stream for the next one: open, idle streams
    must not hold up Triton's shutdown."""
    ports = free_ports(4)
    proc = start_serve(demo, ports)
    assert [proc.stdout.readline() for _ in range(4)][3].startswith("OpenAI")
    client = OpenAI(base_url=f"http://127.0.0.1:{ports[3]}/v1", api_key="EMPTY")
    with ThreadPoolExecutor(3) as pool:  # three at once: three streams in the pool afterwards
        answers = list(pool.map(lambda _: client.completions.create(model="any", prompt=PROMPT, max_tokens=4,
                                                                    temperature=0.0), range(3)))
    # greedy: the same answer three times (the trained demo may end it before 4 tokens)
    assert len({a.choices[0].text for a in answers}) == 1 and all(0 < a.usage.completion_tokens <= 4 for a in answers)
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert time.monotonic() - start < 15, "idle streams held the shutdown up"


def test_serve_starts_the_openai_api_beside_triton(demo, serving):
    _, (_, _, _, openai_port) = serving
    client = OpenAI(base_url=f"http://127.0.0.1:{openai_port}/v1", api_key="EMPTY")
    answer = client.chat.completions.create(model="any", messages=[{"role": "user", "content": PROMPT}], max_tokens=12,
                                            temperature=0.0,
                                            extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert answer.choices[0].message.content == expected_text(demo, 12)
    assert [m.id for m in client.models.list().data] == ["dflash-trt-demo"]


def test_serve_refuses_an_openai_port_that_is_taken(demo, serving):
    _, (_, _, _, openai_port) = serving
    proc = start_serve(demo, (*free_ports(3), openai_port))
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1 and str(openai_port) in err
