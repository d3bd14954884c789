"""`dflash-trt build` / `run`: outputs, exit codes, and nothing half-written on failure."""

import json
import shutil

import pytest
from click.testing import CliRunner

from dflash_trt.cli import cli
from dflash_trt.loading import load_engine, load_pair
from dflash_trt.sampling import SamplingParams
from dflash_trt.speculate import OracleDrafts


def invoke(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def leftovers(parent, name):
    """Anything the build left beside its output: the output itself or a temporary sibling."""
    return sorted(p.name for p in parent.iterdir() if p.name == name or p.name.startswith(f".{name}."))


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("build") / "demo"
    result = invoke("build", "-o", out, "--preset", "tiny")
    assert result.exit_code == 0, result.output
    return out, result


def test_build_of_the_demo_prints_the_output_path_and_writes_the_engine(demo):
    out, result = demo
    assert result.stdout.strip() == str(out)
    assert "embedded demo pair" in result.stderr
    record = json.loads((out / "engine" / "engine.json").read_text())
    assert record["build_config"]["preset"] == "tiny" and record["block_size"] == 8
    for part in ("target/config.json", "drafter/config.json", "tokenizer/tokenizer.json"):
        assert (out / "engine" / part).exists(), part


def test_packed_engine_generates_what_the_source_checkpoints_generate(make_pair, tmp_path):
    pair = make_pair()
    out = tmp_path / "engine-out"
    assert invoke("build", "--target", pair.target, "--drafter", pair.drafter, "--dtype", "float32",
                  "-o", out).exit_code == 0
    weights = (out / "engine" / "target" / "model.safetensors").read_bytes()[:4000]
    assert b"qkv_proj" in weights and b"q_proj" not in weights  # fused at build time
    prompts = [[5, 6, 7], [100, 200]]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    packed = load_engine(out / "engine").engine.generate(prompts, params, mode="dflash")
    source = load_pair(pair.target, pair.drafter).generate(prompts, params, mode="dflash")
    assert [r.token_ids for r in packed] == [r.token_ids for r in source]


def test_build_block_size_sets_the_engines_block_and_leaves_the_drafter_config_alone(make_pair, tmp_path):
    pair = make_pair()  # trained block size 8
    out = tmp_path / "block4"
    assert invoke("build", "--target", pair.target, "--drafter", pair.drafter, "--dtype", "float32",
                  "--block-size", 4, "-o", out).exit_code == 0
    engine = load_engine(out / "engine").engine
    assert engine.block_size == engine.passes.block_size == 4 and engine.drafter.config.block_size == 8
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    reference = engine.generate([[5, 6, 7]], params, mode="ar")[0].token_ids
    engine.oracle = OracleDrafts({(5, 6, 7): reference}, lambda seq: 99)  # every draft right
    result = engine.generate([[5, 6, 7]], params, mode="dflash")[0]
    assert result.token_ids == reference and max(result.stats.acceptance_lengths) == 4


def test_run_generates_text_and_reports_stats(demo):
    result = invoke("run", demo[0], "Hello", "--max-tokens", "5", "--stats")
    assert result.exit_code == 0, result.output
    assert "mean acceptance length" in result.stderr and result.stdout.strip()


def test_existing_output_needs_force(demo):
    out, _ = demo
    before = (out / "engine" / "engine.json").read_text()
    result = invoke("build", "-o", out)
    assert result.exit_code == 1 and "already exists; pass --force" in result.stderr
    assert (out / "engine" / "engine.json").read_text() == before


def broken_pair(make_pair, tmp_path, damage):
    pair = make_pair()
    target, drafter = tmp_path / "t", tmp_path / "d"
    shutil.copytree(pair.target, target)
    shutil.copytree(pair.drafter, drafter)
    damage(target, drafter)
    return target, drafter


def _edit_config(path, **changes):
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


DAMAGES = {
    "mismatched hidden size": (lambda t, d: _edit_config(d / "config.json", hidden_size=32, head_dim=8),
                               "hidden_size = 32 differs from the target's hidden_size = 64"),
    "missing weights": (lambda t, d: (d / "model.safetensors").unlink(), "no model.safetensors"),
    "corrupt safetensors": (lambda t, d: (t / "model.safetensors").write_bytes(b"\x00" * 100),
                            "corrupt safetensors file"),
    "missing tokenizer": (lambda t, d: (t / "tokenizer.json").unlink(), "tokenizer.json"),
}


@pytest.mark.parametrize("name", DAMAGES)
def test_build_failures_exit_1_and_leave_nothing(make_pair, tmp_path, name):
    damage, message = DAMAGES[name]
    target, drafter = broken_pair(make_pair, tmp_path, damage)
    result = invoke("build", "--target", target, "--drafter", drafter, "-o", tmp_path / "out")
    assert result.exit_code == 1, result.output
    assert message in result.stderr
    assert leftovers(tmp_path, "out") == []


def test_unknown_key_in_a_config_file_is_an_error(tmp_path):
    config = tmp_path / "my.toml"
    config.write_text('max_batch_size = 4\nmax_batchsize = 8\n')
    result = invoke("build", "--config", config, "-o", tmp_path / "out")
    assert result.exit_code == 1
    assert "unknown key(s) max_batchsize" in result.stderr and str(config) in result.stderr
    assert leftovers(tmp_path, "out") == []


@pytest.mark.parametrize("args, message", [
    (["--preset", "nope"], "Invalid value for '--preset'"),
    (["--max-batch-size", "0"], "Invalid value for '--max-batch-size'"),
    (["--dtype", "int8"], "Invalid value for '--dtype'"),
])
def test_bad_flags_exit_2(tmp_path, args, message):
    result = invoke("build", "-o", tmp_path / "out", *args)
    assert result.exit_code == 2 and message in result.stderr
    assert leftovers(tmp_path, "out") == []


def test_target_without_drafter_is_rejected(make_pair, tmp_path):
    result = invoke("build", "--target", make_pair().target, "-o", tmp_path / "out")
    assert result.exit_code == 1 and "give both target and drafter" in result.stderr


def test_hugging_face_id_not_in_the_cache_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    result = invoke("build", "--target", "Qwen/Qwen3-8B", "--drafter", "z-lab/Qwen3-8B-DFlash-b16", "-o", tmp_path / "o")
    assert result.exit_code == 1
    assert "'Qwen/Qwen3-8B' is not in the local Hugging Face cache" in result.stderr


def test_hugging_face_id_resolves_through_the_local_cache(make_pair, tmp_path, monkeypatch):
    pair = make_pair()
    hub = tmp_path / "hub"
    for repo, src in (("models--acme--target", pair.target), ("models--acme--drafter", pair.drafter)):
        shutil.copytree(src, hub / repo / "snapshots" / "abc123")
        (hub / repo / "refs").mkdir()
        (hub / repo / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    result = invoke("build", "--target", "acme/target", "--drafter", "acme/drafter", "-o", tmp_path / "o")
    assert result.exit_code == 0, result.output


def test_help_is_instant_and_lists_the_commands():
    result = invoke("--help")
    assert result.exit_code == 0 and "build" in result.stdout and "run" in result.stdout
