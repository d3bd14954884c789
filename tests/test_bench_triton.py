"""`dflash-trt bench --url`: the closed-loop load generator (dflash_trt.benchmark.loadgen) against the
real tritonserver of test_triton_e2e.py serving the tiny demo engine. Greedy decoding is
deterministic, so what the server counts must equal what the in-process engine produces."""

import json

import pytest
from click.testing import CliRunner

pytest.importorskip("tritonclient.grpc", reason="needs tritonclient[grpc,http]")

from ports import free_ports  # noqa: E402
from test_triton_e2e import engine_dir  # noqa: E402, F401  (module fixtures: build the demo, serve it, load it)
from triton_clients import local, server  # noqa: E402, F401

from dflash_trt.benchmark import bench, loadgen  # noqa: E402
from dflash_trt.benchmark.datasets import load_prompts  # noqa: E402
from dflash_trt.cli import cli  # noqa: E402
from dflash_trt.sampling import SamplingParams  # noqa: E402
from dflash_trt.serving.client import ClientError  # noqa: E402
from dflash_trt.serving.openai_api import start_api  # noqa: E402

pytestmark = pytest.mark.slow
MAX_TOKENS = 12
DFLASH_THROUGH_TRITON = "DFlash through Triton (real acceptance)"
DFLASH_THROUGH_OPENAI = "DFlash through the OpenAI API (real acceptance)"


@pytest.fixture(scope="module")
def prompts():
    return load_prompts("mt_bench", 3)


@pytest.fixture(scope="module")
def in_process(local, prompts):
    """Greedy outputs of the same chat prompts in-process, as the server returns them:
    the same stop tokens and max_tokens, the end token left out."""
    tok = local.tokenizer
    params = SamplingParams(max_tokens=MAX_TOKENS, stop_token_ids=tuple(tok.stop_token_ids))
    results = local.engine.generate(bench.encode_prompts(tok, prompts), params, mode="ar")
    return [r.token_ids[:-1] if r.token_ids[-1] in tok.stop_token_ids else r.token_ids for r in results]


def test_closed_loop_requests_get_the_in_process_greedy_outputs(server, local, prompts, in_process):
    run = loadgen.closed_loop(server.endpoints.grpc, prompts, 2, max_tokens=MAX_TOKENS)
    assert [r.index for r in run.results] == [0, 1, 2]
    assert [r.num_output_tokens for r in run.results] == [len(ids) for ids in in_process]
    assert [r.text for r in run.results] == [local.tokenizer.decode(ids) for ids in in_process]
    assert all(0 < r.ttft_s <= r.latency_s <= run.wall_s for r in run.results)


@pytest.fixture(scope="module")
def openai_url(engine_dir, server):
    (port,) = free_ports(1)
    api = start_api(engine_dir / "engine", server.endpoints.grpc, "127.0.0.1", port)
    yield api.url
    api.stop()


def test_closed_loop_through_the_openai_api_gets_the_same_outputs_and_counts(openai_url, local, prompts, in_process):
    run = loadgen.closed_loop(openai_url, prompts, 2, max_tokens=MAX_TOKENS)
    assert [r.num_output_tokens for r in run.results] == [len(ids) for ids in in_process]
    assert [r.text for r in run.results] == [local.tokenizer.decode(ids) for ids in in_process]
    assert all(0 < r.ttft_s <= r.latency_s <= run.wall_s and r.speculative for r in run.results)
    assert all(r.itl_s == pytest.approx((r.latency_s - r.ttft_s) / (r.num_output_tokens - 1)) for r in run.results)
    accepted = [r.metrics["total_accepted_draft_tokens"] for r in run.results]
    steps = [r.metrics["total_draft_tokens"] / (local.engine.block_size - 1) for r in run.results]
    assert [r.metrics["mean_acceptance_length"] for r in run.results] == pytest.approx(
        [1 + a / n for a, n in zip(accepted, steps)])


def test_sampled_requests_through_either_path_draw_what_the_engine_draws(server, openai_url, local, prompts):
    # prompt i seeded 5 + i: the server's DFlash draws what the in-process engine's does (fp32
    # on the CPU: a row's logits do not depend on its batch)
    tok = local.tokenizer
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=5 + i, stop_token_ids=tuple(tok.stop_token_ids))
              for i in range(len(prompts))]
    results = local.engine.generate(bench.encode_prompts(tok, prompts), params, mode="dflash")
    want = [tok.decode(r.token_ids[:-1] if r.token_ids[-1] in tok.stop_token_ids else r.token_ids) for r in results]
    greedy = loadgen.closed_loop(server.endpoints.grpc, prompts, 2, max_tokens=MAX_TOKENS)
    assert [r.text for r in greedy.results] != want
    for url, path in ((server.endpoints.grpc, "Triton"), (openai_url, "the OpenAI API")):
        run = loadgen.closed_loop(url, prompts, 2, max_tokens=MAX_TOKENS, sampling=SamplingParams(temperature=0.8),
                                  seed=5)
        assert [r.text for r in run.results] == want
        assert loadgen.row(run, "mt_bench").mode_label == f"DFlash through {path} (real acceptance, T=0.8)"


def test_one_bench_compares_grpc_and_the_openai_api(engine_dir, server, openai_url, tmp_path):
    report = tmp_path / "both.json"
    result = CliRunner().invoke(cli, ["bench", "--url", server.endpoints.grpc, "--url", openai_url, "--dataset",
                                      "mt_bench", "--concurrency", "1", "--num-prompts", "2", "--max-tokens", "4",
                                      "--json", str(report)])
    assert result.exit_code == 0, result.output
    data = json.loads(report.read_text())
    assert data["meta"]["urls"] == [server.endpoints.grpc, openai_url]
    assert [r["mode_label"] for r in data["triton_rows"]] == [DFLASH_THROUGH_TRITON, DFLASH_THROUGH_OPENAI]
    assert len({r["output_tokens"] for r in data["triton_rows"]}) == 1  # the same greedy answers


def test_an_openai_url_with_nothing_there_is_a_clear_error():
    (port,) = free_ports(1)
    url = f"http://127.0.0.1:{port}"
    with pytest.raises(ClientError, match=f"{url}: cannot reach the OpenAI API"):
        loadgen.check_server(url)


def test_url_bench_rows_count_the_in_process_tokens_at_each_concurrency(server, prompts, in_process):
    rows = loadgen.run_triton_bench(server.endpoints.grpc, prompts, dataset="mt_bench", concurrencies=(1, 2),
                                    max_tokens=MAX_TOKENS)
    assert [r.concurrency for r in rows] == [1, 2]
    for r in rows:
        assert r.output_tokens == sum(map(len, in_process)) and r.num_prompts == 3
        assert r.mode_label == DFLASH_THROUGH_TRITON and r.dataset == "mt_bench"
        assert min(r.tok_s, r.requests_s) > 0 and r.tau >= 1.0
        assert 0 < r.ttft_p50_s <= r.ttft_p99_s and r.latency_p50_s >= r.ttft_p50_s
        assert 0 < r.itl_p50_s < r.latency_p50_s


def test_a_server_that_is_not_there_is_a_clear_error_before_any_in_process_run(engine_dir):
    (port,) = free_ports(1)
    url = f"127.0.0.1:{port}"
    with pytest.raises(ClientError, match=f"{url}: cannot reach a Triton server"):
        loadgen.run_triton_bench(url, ["hi"], concurrencies=(1,), max_tokens=4)
    result = CliRunner().invoke(cli, ["bench", str(engine_dir), "--url", url, "--num-prompts", "1", "--max-tokens", "4"])
    assert result.exit_code == 1 and url in result.stderr
    assert "AR:" not in result.stderr  # failed before the in-process runs


def test_cli_prints_both_tables_and_the_serving_overhead(engine_dir, server, tmp_path):
    report = tmp_path / "bench.json"
    args = ["--dataset", "mt_bench", "--concurrency", "1,2", "--num-prompts", "2", "--max-tokens", "4"]
    result = CliRunner().invoke(cli, ["bench", str(engine_dir), "--url", server.endpoints.grpc, *args,
                                      "--json", str(report)])
    assert result.exit_code == 0, result.output
    local_table, triton_table, overhead = result.stdout.strip().split("\n\n")
    assert local_table.startswith("| Dataset | Concurrency | AR tok/s | DFlash tok/s |")
    assert triton_table.startswith("| Dataset | Concurrency | Output tok/s | Requests/s | τ |")
    assert all(line.endswith(f"| {DFLASH_THROUGH_TRITON} |") for line in triton_table.splitlines()[2:])
    lines = overhead.splitlines()
    assert len(lines) == 2 and lines[1].startswith("serving overhead mt_bench c=2: ")
    assert "DFlash in-process (real acceptance)" in lines[1]
    data = json.loads(report.read_text())
    assert [r["concurrency"] for r in data["triton_rows"]] == [1, 2] and data["meta"]["urls"] == [server.endpoints.grpc]
    assert all(e["ratio"] > 0 and e["like_for_like"] for e in data["serving_overhead"])

    sampled = CliRunner().invoke(cli, ["bench", str(engine_dir), "--url", server.endpoints.grpc, *args,
                                       "--temperature", "0.8", "--top-k", "40", "--top-p", "0.9"])
    assert sampled.exit_code == 0, sampled.output
    local_table, triton_table, overhead = sampled.stdout.strip().split("\n\n")
    assert local_table.splitlines()[-1].endswith("| real acceptance, T=0.8, top-k 40, top-p 0.9 |")
    assert triton_table.splitlines()[-1].endswith(
        "| DFlash through Triton (real acceptance, T=0.8, top-k 40, top-p 0.9) |")
    assert "like-for-like" not in overhead  # both sides sampled alike with real acceptance

    alone = CliRunner().invoke(cli, ["bench", "--url", server.endpoints.grpc, *args])
    assert alone.exit_code == 0, alone.output
    table = alone.stdout.strip().splitlines()
    assert len(table) == 4 and table[0] == triton_table.splitlines()[0] and "| mt_bench | 2 |" in table[3]
