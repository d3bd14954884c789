"""`dflash-trt build` / `run`: outputs, exit codes, and nothing half-written on failure."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from click.testing import CliRunner

from dflash_trt import build
from dflash_trt.cli import cli
from dflash_trt.loading import load_engine, load_pair
from dflash_trt.sampling import SamplingParams
from dflash_trt.speculate import OracleDrafts
from dflash_trt.weights import write_safetensors


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
    assert record["build_config"]["preset"] == "tiny" and record["block_size"] == 16  # the demo drafter's
    for part in ("target/config.json", "drafter/config.json", "tokenizer/tokenizer.json"):
        assert (out / "engine" / part).exists(), part


def test_the_engines_files_get_the_mode_any_new_file_gets(demo):
    """safetensors writes its files 0600 (a temporary file renamed); a server or another user
    reading the engine needs the mode the umask gives every other file the build writes."""
    out, _ = demo
    config_mode = (out / "engine" / "target" / "config.json").stat().st_mode & 0o777
    for weights in (out / "engine").rglob("*.safetensors"):
        assert weights.stat().st_mode & 0o777 == config_mode, weights


@pytest.mark.parametrize("umask", [0o022, 0o077])
@pytest.mark.parametrize("num_shards", [1, 3])
def test_written_weights_follow_the_umask(tmp_path, umask, num_shards):
    old = os.umask(umask)
    try:
        write_safetensors(tmp_path, {f"w{i}": torch.zeros(2) for i in range(3)}, num_shards)
    finally:
        os.umask(old)
    files = sorted(tmp_path.glob("*.safetensors"))
    assert len(files) == num_shards
    assert {f.stat().st_mode & 0o777 for f in files} == {0o666 & ~umask}


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


def test_build_records_the_draft_window_prefill_chunk_and_overlap_and_run_can_override_the_window(make_pair,
                                                                                                   tmp_path):
    pair = make_pair()  # block size 8
    out = tmp_path / "window"
    assert invoke("build", "--target", pair.target, "--drafter", pair.drafter, "--dtype", "float32",
                  "--draft-window-size", 16, "--prefill-chunk-size", 4, "--no-overlap", "-o", out).exit_code == 0
    record = json.loads((out / "engine" / "engine.json").read_text())
    assert record["build_config"]["draft_window_size"] == 16
    assert record["build_config"]["prefill_chunk_size"] == 4
    assert record["build_config"]["overlap"] is False
    engine = load_engine(out / "engine").engine
    assert engine.draft_window == 16 and engine.draft_cache.k.shape[2] == 2 * (16 + 8 - 1)
    assert engine.prefill_chunk == 4 and engine.overlap is False
    assert load_engine(out / "engine", draft_window=0).engine.draft_window == 0
    result = invoke("run", out, "Hello", "--max-tokens", 3, "--no-chat", "--draft-window-size", 5)
    assert result.exit_code == 1 and "draft_window_size = 5 must be 0 (no window) or at least the block size (8)" \
        in result.stderr


def test_a_draft_window_below_the_block_size_fails_the_build_and_leaves_nothing(make_pair, tmp_path):
    pair = make_pair()
    result = invoke("build", "--target", pair.target, "--drafter", pair.drafter, "--draft-window-size", 4,
                    "-o", tmp_path / "out")
    assert result.exit_code == 1 and "draft_window_size = 4" in result.stderr
    assert leftovers(tmp_path, "out") == []


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


def snapshot(directory):
    """Every path under `directory` with its bytes (None for a directory), to prove nothing changed."""
    return {str(p.relative_to(directory)): None if p.is_dir() else p.read_bytes() for p in directory.rglob("*")}


def test_build_marks_its_output_as_its_own(demo):
    marker = json.loads((demo[0] / ".dflash-trt-build").read_text())
    assert marker["tool"] == "dflash-trt" and marker["contents"] == ["engine", "model_repository"]


def test_force_replaces_an_earlier_build_and_leaves_no_temporary_directory(tmp_path):
    out = tmp_path / "out"
    assert invoke("build", "-o", out, "--preset", "tiny").exit_code == 0
    (out / "engine" / "engine.json").write_text("{}")  # so the replacement shows
    result = invoke("build", "-o", out, "--preset", "tiny", "--force")
    assert result.exit_code == 0, result.output
    assert json.loads((out / "engine" / "engine.json").read_text())["build_config"]["preset"] == "tiny"
    assert leftovers(tmp_path, "out") == ["out"]


@pytest.mark.parametrize("where", [".", ".."])
def test_force_never_replaces_the_current_directory_or_its_parents(tmp_path, monkeypatch, where):
    here = tmp_path / "project"
    (here / "src").mkdir(parents=True)
    (here / "src" / "main.py").write_text("keep me")
    monkeypatch.chdir(here)
    before = snapshot(tmp_path)
    result = invoke("build", "-o", where, "--force")
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert "current directory" in result.stderr and "embedded demo pair" not in result.stderr  # refused before work
    assert snapshot(tmp_path) == before


def test_force_never_replaces_the_home_directory(tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    (home / ".dflash-trt-build").write_text('{"tool": "dflash-trt"}')  # even one that looks like a build
    monkeypatch.setenv("HOME", str(home))
    result = invoke("build", "-o", home, "--force")
    assert result.exit_code == 1 and "home directory" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["home"] and (home / ".dflash-trt-build").exists()


def _foreign_file(out):
    (out / "notes.txt").write_text("mine")


def _no_marker(out):
    (out / ".dflash-trt-build").unlink(missing_ok=True)  # builds older than the marker have none


def _only_foreign(out):
    shutil.rmtree(out)
    out.mkdir()
    (out / "thesis.tex").write_text("years of work")


def _a_file(out):
    shutil.rmtree(out)
    out.write_text("not a directory")


def _a_symlink(out):
    real = out.parent / "real"
    out.rename(real)
    out.symlink_to(real)


NOT_OURS = {
    "a build plus a foreign file": (_foreign_file, "notes.txt"),
    "a build without the marker": (_no_marker, "no .dflash-trt-build marker"),
    "a directory of someone else's files": (_only_foreign, "thesis.tex"),
    "a regular file": (_a_file, "not a directory"),
    "a symlink to a build": (_a_symlink, "symbolic link"),
}


@pytest.mark.parametrize("name", NOT_OURS)
def test_force_refuses_an_output_a_build_did_not_make_and_changes_nothing(demo, tmp_path, name):
    damage, reason = NOT_OURS[name]
    out = tmp_path / "out"
    shutil.copytree(demo[0], out)
    damage(out)
    before = snapshot(tmp_path)
    result = invoke("build", "-o", out, "--force")
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert str(out) in result.stderr and reason in result.stderr and "remove it yourself" in result.stderr
    assert "embedded demo pair" not in result.stderr  # refused before any work
    assert snapshot(tmp_path) == before


def test_a_failed_swap_keeps_the_old_output(demo, tmp_path, monkeypatch):
    out = tmp_path / "out"
    shutil.copytree(demo[0], out)
    before = snapshot(out)
    real_replace = os.replace

    def failing_replace(src, dst):
        if os.fspath(dst) == os.fspath(out) and os.path.basename(src) == "out":  # the new build moving in
            raise OSError(28, "No space left on device", os.fspath(dst))
        real_replace(src, dst)

    monkeypatch.setattr(build.os, "replace", failing_replace)
    result = invoke("build", "-o", out, "--preset", "tiny", "--force")
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert str(out) in result.stderr and "No space left on device" in result.stderr
    assert snapshot(out) == before and leftovers(tmp_path, "out") == ["out"]


def test_output_blocked_by_a_file_is_one_clear_error(tmp_path):
    (tmp_path / "somefile").write_text("x")
    for output in (tmp_path / "somefile" / "out", tmp_path / "somefile" / "deeper" / "out"):
        result = invoke("build", "-o", output)
        assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.exception
        assert "Traceback" not in result.output
        assert str(output) in result.stderr and "somefile is not a directory" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["somefile"]


def test_read_only_parent_is_one_clear_error(tmp_path):
    parent = tmp_path / "ro"
    parent.mkdir()
    parent.chmod(0o555)
    try:
        try:  # root (CAP_DAC_OVERRIDE) writes into it anyway: then there is nothing to test
            (parent / "probe").mkdir()
        except PermissionError:
            result = invoke("build", "-o", parent / "out")
        else:
            pytest.skip("this user can write into read-only directories")
    finally:
        parent.chmod(0o755)
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.output
    assert str(parent / "out") in result.stderr and "Permission denied" in result.stderr
    assert list(parent.iterdir()) == []


def test_sigterm_during_a_build_exits_143_and_leaves_nothing(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "dflash_trt", "build", "-o", "X"], cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while not list(tmp_path.glob(".X.*")):
            assert proc.poll() is None and time.monotonic() < deadline, "the build never made its temp directory"
            time.sleep(0.005)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 143, proc.stderr.read().decode()
    finally:
        proc.kill()
        proc.wait()
    assert leftovers(tmp_path, "X") == []


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


@pytest.mark.parametrize("line, message", [
    ('overlap = "no"', "key 'overlap' must be bool, got 'no'"),
    ("max_batch_size = true", "key 'max_batch_size' must be int, got True"),
])
def test_a_config_files_value_of_the_wrong_type_is_named(tmp_path, line, message):
    config = tmp_path / "my.toml"
    config.write_text(line + "\n")
    result = invoke("build", "--config", config, "-o", tmp_path / "out")
    assert result.exit_code == 1 and message in result.stderr and str(config) in result.stderr
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


def test_every_shipped_preset_is_a_valid_build_config():
    from dflash_trt.config import preset_names, resolve_config

    names = preset_names()
    assert {"qwen3.6-35b-a3b-b16", "qwen3.5-35b-a3b-b16", "qwen3.5-397b-a17b-b16"} <= set(names)
    for name in names:
        config = resolve_config(preset=name)
        assert config.preset == name and config.max_batch_size > 0
