"""`dflash-trt bench` and dflash_trt.bench: shipped prompt sets, rows, oracle τ, the CLI."""

import dataclasses
import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

from dflash_trt.benchmark import bench
from dflash_trt.benchmark.datasets import NAMES, load_prompts
from dflash_trt.build import run
from dflash_trt.cli import cli
from dflash_trt.config import resolve_config
from dflash_trt.errors import ConfigError
from dflash_trt.loading import load_engine
from dflash_trt.sampling import SamplingParams


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    return run(resolve_config("tiny"), tmp_path_factory.mktemp("bench") / "demo")


@pytest.fixture(scope="module")
def loaded(out):
    return load_engine(out / "engine")


@pytest.mark.parametrize("name", NAMES)
def test_shipped_sets_load_with_a_limit(name):
    prompts = load_prompts(name, 5)
    assert len(prompts) == 5 and all(isinstance(p, str) and p for p in prompts)
    assert len(load_prompts(name)) == {"gsm8k": 128, "humaneval": 64, "mt_bench": 80}[name]


def test_shipped_prompts_are_worded_like_the_reference_benchmark():
    assert load_prompts("gsm8k", 1)[0].endswith("put your final answer within \\boxed{}.")
    assert load_prompts("humaneval", 1)[0].startswith("Write a solution to the following problem")


def test_user_jsonl_and_errors_that_name_the_line(tmp_path):
    good = tmp_path / "mine.jsonl"
    good.write_text('{"prompt": "a"}\n\n{"prompt": "b", "extra": 1}\n')
    assert load_prompts(good) == ["a", "b"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{"text": "b"}\n')
    with pytest.raises(ConfigError, match=r"bad\.jsonl:2: .*'prompt'"):
        load_prompts(bad)
    bad.write_text('{"prompt": "a"}\n{not json\n')
    with pytest.raises(ConfigError, match=r"bad\.jsonl:2: not valid JSON"):
        load_prompts(bad)
    with pytest.raises(ConfigError, match="not a dataset name"):
        load_prompts(tmp_path / "missing.jsonl")


def test_rows_per_concurrency_are_lossless_and_positive(loaded):
    prompts = load_prompts("mt_bench", 3)
    rows = bench.run_bench(loaded, prompts, dataset="mt_bench", concurrencies=(1, 2), max_tokens=12)
    assert [r.concurrency for r in rows] == [1, 2]
    for r in rows:
        assert r.mode_label == "real acceptance" and r.dataset == "mt_bench" and r.num_prompts == 3
        assert r.identical_share == 1.0  # greedy fp32: DFlash reproduces AR exactly
        assert min(r.ar_tok_s, r.dflash_tok_s, r.ar_decode_tok_s, r.dflash_decode_tok_s, r.speedup) > 0
        assert 1.0 <= r.tau_steps <= loaded.engine.block_size and r.tau_per_request >= 1.0
        assert 0 < r.ttft_p50_s <= r.ttft_p99_s


def test_ar_runs_overlapped_unless_told_not_to_with_the_same_tokens(loaded):
    prompts = load_prompts("gsm8k", 3)
    outputs = {}
    for overlap in (None, False):
        outputs[overlap] = {}
        (row,) = bench.run_bench(loaded, prompts, dataset="gsm8k", concurrencies=(2,), max_tokens=12,
                                 ar_outputs=outputs[overlap], overlap=overlap)
        assert row.ar_overlap is (overlap is None) and row.identical_share == 1.0
    assert outputs[None] == outputs[False]


def test_the_engines_hold_max_seq_len_tokens_a_request_when_given_as_a_server_would(loaded, monkeypatch):
    prompts = load_prompts("gsm8k", 2)
    sizes, sibling = [], loaded.engine.sibling

    def recorded(**changes):
        sizes.append(changes["max_seq_len"])
        return sibling(**changes)

    monkeypatch.setattr(loaded.engine, "sibling", recorded)
    need = max(len(p) for p in bench.encode_prompts(loaded.tokenizer, prompts, chat=True, thinking=False)) + 8
    for max_seq_len, held in ((None, need), (loaded.engine.max_seq_len, loaded.engine.max_seq_len)):
        sizes.clear()
        (row,) = bench.run_bench(loaded, prompts, dataset="gsm8k", concurrencies=(2,), max_tokens=8,
                                 max_seq_len=max_seq_len)
        assert row.identical_share == 1.0 and set(sizes) == {held}
    for bad in (need - 1, loaded.engine.max_seq_len + 1):
        with pytest.raises(ConfigError, match=f"max_seq_len = {bad} must hold the longest prompt"):
            bench.run_bench(loaded, prompts, concurrencies=(1,), max_tokens=8, max_seq_len=bad)


def test_oracle_tau_sets_the_mean_acceptance_length(loaded):
    assert loaded.engine.block_size == 16  # the demo drafter's
    prompts = load_prompts("gsm8k", 4)
    (row,) = bench.run_bench(loaded, prompts, dataset="gsm8k", concurrencies=(4,), max_tokens=64,
                             oracle_tau=4, seed=1)
    assert row.mode_label == "oracle τ=4"
    assert abs(row.tau_steps - 4) <= 0.5, row
    assert row.identical_share is None  # the forced oracle follows AR by construction
    assert "| n/a |" in bench.format_table([row])


def test_a_sampled_bench_seeds_each_prompt_and_reports_no_identity(loaded):
    prompts = load_prompts("gsm8k", 3)
    sampled, greedy = {}, {}
    settings = SamplingParams(temperature=0.8, top_k=40, top_p=0.9)
    rows = bench.run_bench(loaded, prompts, dataset="gsm8k", concurrencies=(1, 3), max_tokens=12, sampling=settings,
                           seed=7, ar_outputs=sampled)
    assert [r.mode_label for r in rows] == ["real acceptance, T=0.8, top-k 40, top-p 0.9"] * 2
    assert all(r.identical_share is None and r.ar_tok_s > 0 and r.dflash_tok_s > 0 for r in rows)
    assert "| n/a |" in bench.format_table(rows)
    # prompt i draws with seed 7 + i whatever runs beside it (fp32 on the CPU: the same logits)
    assert sampled[1] == sampled[3]
    bench.run_bench(loaded, prompts, concurrencies=(1,), max_tokens=12, ar_outputs=greedy)
    assert greedy[1] != sampled[1]
    with pytest.raises(ConfigError, match="oracle acceptance forces greedy outcomes: temperature = 0.8"):
        bench.run_bench(loaded, prompts, oracle_tau=3, sampling=settings)
    with pytest.raises(ConfigError, match="temperature = 0.5 is for the throughput rows"):
        bench.run_report(loaded, ["gsm8k"], compare_transformers=True, sampling=SamplingParams(temperature=0.5))


def test_a_repeated_bench_reports_its_median_run_and_the_range_of_all(loaded):
    prompts = load_prompts("gsm8k", 3)
    (row,) = bench.run_bench(loaded, prompts, dataset="gsm8k", concurrencies=(2,), max_tokens=12, oracle_tau=3,
                             repeat=3)
    low, high = row.speedup_range
    assert row.runs == 3 and 0 < low <= row.speedup <= high
    assert f"{row.speedup:.2f}x ({low:.2f}-{high:.2f}x, 3 runs)" in bench.format_table([row])
    (once,) = bench.run_bench(loaded, prompts, dataset="gsm8k", concurrencies=(2,), max_tokens=12)
    assert once.runs == 1 and once.speedup_range is None and "runs)" not in bench.format_table([once])
    with pytest.raises(ConfigError, match="repeat must be >= 1, got 0"):
        bench.run_bench(loaded, prompts, repeat=0)
    runs = [dataclasses.replace(row, speedup=x, ar_tok_s=x) for x in (1.2, 3.0, 2.0, 2.5)]
    assert (bench.median_run(runs[:3]).ar_tok_s, bench.median_run(runs[:3]).speedup_range) == (2.0, (1.2, 3.0))
    assert bench.median_run(runs).speedup == 2.0  # of an even count, the lower middle run


def test_oracle_num_correct_mean_and_bounds():
    draw = bench.OracleNumCorrect(6.5, 16, seed=0)
    ks = [draw(None) for _ in range(4000)]
    assert set(ks) == {5, 6} and abs(sum(ks) / len(ks) - 5.5) < 0.05
    assert {bench.OracleNumCorrect(8, 8)(None) for _ in range(10)} == {7}
    with pytest.raises(ConfigError, match="block size"):
        bench.OracleNumCorrect(9, 8)


def bench_cli(out, report, *args) -> tuple[list[str], dict, str]:
    """`dflash-trt bench OUT ARGS --json REPORT` that must succeed -> (its table's lines, the
    JSON it wrote, its stderr)."""
    result = CliRunner().invoke(cli, ["bench", str(out), *map(str, args), "--json", str(report)])
    assert result.exit_code == 0, result.output
    return result.stdout.strip().splitlines(), json.loads(report.read_text()), result.stderr


def test_cli_prints_a_table_and_writes_json(out, tmp_path):
    table, report, stderr = bench_cli(out, tmp_path / "bench.json", "--dataset", "humaneval", "--concurrency", "1,2",
                                      "--num-prompts", 2, "--max-tokens", 6)
    assert table[0].startswith("| Dataset | Concurrency | AR tok/s | DFlash tok/s | Speedup | τ |")
    assert len(table) == 4 and "| humaneval | 2 |" in table[3] and "real acceptance" in table[3]
    assert "humaneval c=1 AR" in stderr
    rows = report["rows"]
    assert [r["concurrency"] for r in rows] == [1, 2]
    assert all(r["ar_tok_s"] > 0 and r["dflash_tok_s"] > 0 and r["identical_share"] == 1.0 for r in rows)


def test_cli_rejects_bad_input(out, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("[1]\n")
    result = CliRunner().invoke(cli, ["bench", str(out), "--dataset", str(bad), "--num-prompts", "1"])
    assert result.exit_code == 1 and "bad.jsonl:1:" in result.output
    result = CliRunner().invoke(cli, ["bench", str(out), "--concurrency", "1,x"])
    assert result.exit_code == 2 and "--concurrency" in result.output
    result = CliRunner().invoke(cli, ["bench", str(out), "--num-prompts", "1", "--max-seq-len", "5"])
    assert result.exit_code == 1 and "max_seq_len = 5 must hold the longest prompt" in result.output
    result = CliRunner().invoke(cli, ["bench", str(out), "--num-prompts", "1", "--temperature", "0.7", "--oracle-tau",
                                      "3"])
    assert result.exit_code == 1 and "temperature = 0.7 needs real acceptance" in result.output
    result = CliRunner().invoke(cli, ["bench", str(out), "--temperature", "-1"])
    assert result.exit_code == 2 and "--temperature" in result.output
    result = CliRunner().invoke(cli, ["bench", str(out), "--top-p", "0.9"])
    assert result.exit_code == 2 and "--top-k and --top-p shape sampling: they need --temperature > 0" in result.output
    result = CliRunner().invoke(cli, ["bench", str(out), "--temperature", "0.7", "--top-p", "0"])
    assert result.exit_code == 2 and "--top-p" in result.output


def test_cli_stall_prompt_prints_one_row_per_mode_and_chunk_setting(out, tmp_path):
    table, report, _ = bench_cli(out, tmp_path / "stall.json", "--stall-prompt", 48, "--prefill-chunk-size", 16,
                                 "--concurrency", 2, "--max-tokens", 64)
    assert table[0].startswith("| Mode | Prefill chunk | Decoding requests | Long prompt |")
    assert [line.split(" | ")[:2] for line in table[2:]] == [["| ar", "none"], ["| ar", "16"], ["| dflash", "none"],
                                                            ["| dflash", "16"]]
    rows = report["stall_rows"]
    # chunked: a gap per chunk step and request; AR reads the step it queued before prefilling: one more
    assert [r["deliveries"] for r in rows] == [4, 8, 2, 6]
    result = CliRunner().invoke(cli, ["bench", str(out), "--stall-prompt", "48", "--concurrency", "2"])
    assert result.exit_code == 1 and "--prefill-chunk-size N" in result.output


# -- the transformers baseline (--compare-transformers) -----------------------------------------


def test_transformers_greedy_output_equals_the_engine_ar_output_token_for_token(loaded):
    from dflash_trt.benchmark.transformers_baseline import generate_tok_s, to_transformers

    target = loaded.engine.target
    model = to_transformers(target)
    qkv = target.model.layers[1].self_attn.qkv_proj.weight
    v_proj = model.model.layers[1].self_attn.v_proj.weight
    assert v_proj.untyped_storage().data_ptr() == qkv.untyped_storage().data_ptr()
    assert model.lm_head.weight.data_ptr() == target.lm_head.weight.data_ptr()  # shared, not copied

    prompt_ids = bench.encode_prompts(loaded.tokenizer, load_prompts("mt_bench", 3))
    ours = loaded.engine.generate(prompt_ids, SamplingParams(max_tokens=8, ignore_eos=True), mode="ar")
    theirs, tok_s = generate_tok_s(model, prompt_ids, 8)  # no eos ids: never stops early, like ignore_eos
    assert [r.token_ids for r in ours] == theirs and {len(t) for t in theirs} == {8} and tok_s > 0

    stop = theirs[0][3]  # a stop token both must end on, and keep, at its first occurrence
    ours = loaded.engine.generate(prompt_ids, SamplingParams(max_tokens=8, stop_token_ids=(stop,), ignore_eos=True))
    theirs, _ = generate_tok_s(model, prompt_ids, 8, eos_token_ids=(stop,))
    assert [r.token_ids for r in ours] == theirs and theirs[0][-1] == stop and len(theirs[0]) <= 4


def test_cli_compare_transformers_prints_the_transformers_row(out):
    result = CliRunner().invoke(cli, ["bench", str(out), "--dataset", "mt_bench", "--concurrency", "1",
                                      "--num-prompts", "2", "--max-tokens", "4", "--compare-transformers"])
    assert result.exit_code == 0, result.output
    in_process, baseline = result.stdout.strip().split("\n\n")
    assert len(in_process.splitlines()) == 3
    header, _, row = baseline.splitlines()
    assert header.startswith("| Dataset | Concurrency | transformers tok/s | AR tok/s | DFlash tok/s |")
    assert row.startswith("| mt_bench | 1 |") and "| 100% | 2 |" in row  # fp32: transformers = our AR
    assert row.endswith("| transformers generate (static cache, greedy); DFlash real acceptance |")


# -- where the in-process engine comes from ------------------------------------------------------


@pytest.mark.parametrize("args, message", [
    (["OUT", "--random-weights", "qwen3-1.7b"], "give OUTPUT_DIR or --random-weights, not both"),
    ([], "give OUTPUT_DIR, --random-weights PRESET or --url HOST:PORT"),
    (["--random-weights", "qwen3-70b"], "'qwen3-70b' is not one of 'qwen3-8b', "),
    (["--url", "localhost:1", "--compare-transformers"], "need an in-process engine"),
    (["--url", "localhost:1", "--oracle-tau", "4"], "need an in-process engine"),
    (["OUT", "--stall-prompt", "9", "--oracle-tau", "4"], "--stall-prompt runs alone"),
])
def test_cli_engine_source_errors_are_usage_errors(out, args, message):
    result = CliRunner().invoke(cli, ["bench", *[str(out) if a == "OUT" else a for a in args]])
    assert result.exit_code == 2 and message in result.stderr, result.output


def test_bench_help_lists_the_random_weights_presets_but_root_help_imports_no_torch():
    from dflash_trt.benchmark.random_weights import PRESETS

    help_text = CliRunner().invoke(cli, ["bench", "--help"]).stdout
    assert f"--random-weights [{'|'.join(PRESETS)}]" in help_text
    code = ("import sys; from click.testing import CliRunner; from dflash_trt.cli import cli; "
            "assert CliRunner().invoke(cli, ['--help']).exit_code == 0; assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.cuda
@pytest.mark.slow
def test_random_weights_bench_on_the_gpu_reports_oracle_rows():
    result = CliRunner().invoke(cli, ["bench", "--random-weights", "qwen3-1.7b", "--oracle-tau", "4",
                                      "--concurrency", "1,2", "--num-prompts", "2", "--max-tokens", "32"])
    assert result.exit_code == 0, result.output
    rows = result.stdout.strip().splitlines()[2:]
    assert len(rows) == 2 and all(r.endswith("| oracle τ=4 |") for r in rows)


def test_a_hybrid_engine_benches_like_a_qwen3_one(tmp_path):
    """A tiny Qwen3.5 pair (Gated DeltaNet target) through build and bench: real acceptance is
    lossless (fp32), and oracle mode reaches its τ with the recurrent state's rollback."""
    from dflash_trt.fixtures.pair import TinyPairSpec, write_tiny_pair

    spec = TinyPairSpec(target_type="qwen3_5", tokenizer_tokens=2000, head_dim=32, rope_theta=1e7,
                        draft_rope_theta=1e7, target_layer_ids=(1, 3), block_size=8)
    pair = write_tiny_pair(tmp_path / "pair", spec)
    out = run(resolve_config(target=str(pair.target), drafter=str(pair.drafter), max_batch_size=2,
                             max_input_len=256, max_output_len=64), tmp_path / "out")
    hybrid = load_engine(out / "engine")
    assert hybrid.engine.target.stateful
    prompts = load_prompts("gsm8k", 2)
    real, = bench.run_bench(hybrid, prompts, dataset="gsm8k", concurrencies=(2,), max_tokens=24, chat=False)
    assert real.identical_share == 1.0 and real.mode_label == "real acceptance"
    oracle, = bench.run_bench(hybrid, prompts, dataset="gsm8k", concurrencies=(2,), max_tokens=48,
                              oracle_tau=4, seed=1)
    assert abs(oracle.tau_steps - 4) <= 1.0, oracle
