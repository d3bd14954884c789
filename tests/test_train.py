"""Training drafters: the training forward is the inference drafter's, anchors and labels follow
the recipe, a tiny drafter learns and `build` loads it, a killed run resumes to the same
weights, data-parallel ranks step with the averaged gradients of their halves, and a target
sharded over the ranks (FSDP) computes what the whole one does."""

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file
from torch.distributed.device_mesh import init_device_mesh

from dflash_trt import parallel, weights
from dflash_trt.engine import Engine
from dflash_trt.errors import ConfigError
from dflash_trt.fixtures import DEMO_DIR
from dflash_trt.kv_cache import Batch
from dflash_trt.loading import load_drafter, load_target
from dflash_trt.sampling import SamplingParams
from dflash_trt.training import data, trainer
from dflash_trt.training.drafter_files import DrafterShape
from dflash_trt.training.objective import IGNORE, Blocks, DraftObjective, attention_mask, block_inputs, sample_anchors
from dflash_trt.training.trainer import TrainConfig, Trainer, initial_drafter, rank_device, sharded_engine

SLIDING = dict(draft_layer_types=("sliding_attention", "full_attention"), sliding_window=3)


def tapped(target, ids):
    S = ids.shape[1]
    with torch.no_grad():
        return target(ids, Batch.make([0], [0], [S], S, "cpu"), target.new_cache(1, S), (0, 2))[1]


@pytest.mark.parametrize("lengths", [None, [4, 2, 3, 4]], ids=["whole", "shorter"])
@pytest.mark.parametrize("spec", [{}, SLIDING], ids=["full", "sliding"])
def test_the_training_forward_computes_the_inference_drafters_block_logits(make_pair, no_tokenizer, spec, lengths):
    """Also for blocks shorter than the drafter's: their rows are what a drafter run at that block size computes."""
    pair = make_pair(block_size=4, **spec, **no_tokenizer)
    target = load_target(pair.target)
    drafter = load_drafter(pair.drafter, target)
    B, S = drafter.config.block_size, 20
    ids = torch.randint(0, 500, (1, S), generator=torch.Generator().manual_seed(0))
    taps = tapped(target, ids)
    anchors = [0, 5, 13, 18]  # no context; some; a block running past the end
    blocks = Blocks(anchors=torch.tensor([anchors]), valid=torch.ones(1, len(anchors), dtype=torch.bool),
                    lengths=None if lengths is None else torch.tensor([lengths]))
    block_ids, positions, labels = block_inputs(ids, torch.ones_like(ids, dtype=torch.bool), blocks, B,
                                                drafter.config.mask_token_id)
    objective = DraftObjective(drafter)
    masks = {w: attention_mask(blocks, S, B, w) for w in {layer.self_attn.window for layer in drafter.layers}}
    with torch.no_grad():
        trained = drafter.logits(objective.hidden(taps, block_ids, positions, masks)).view(len(anchors), B, -1)
    for i, (anchor, rows) in enumerate(zip(anchors, lengths or [B] * len(anchors))):
        cache = drafter.new_cache(1, S + B)
        if anchor:
            drafter.append_context(taps[:, :anchor], Batch.make([0], [0], [anchor], anchor, "cpu"), cache)
        with torch.no_grad():
            served = drafter.logits(drafter(block_ids[:, i * B:i * B + rows],
                                            Batch.make([0], [anchor], [rows], rows, "cpu"), cache))[0]
        torch.testing.assert_close(trained[i, :rows], served, atol=2e-4 * served.abs().max().item(), rtol=0)
        assert (labels.view(len(anchors), B)[i, rows:] == IGNORE).all()  # rows the block lacks learn nothing


def test_distillation_learns_the_distribution_the_target_gave_each_rows_token(make_pair, no_tokenizer):
    pair = make_pair(block_size=4, **no_tokenizer)
    target = load_target(pair.target)
    drafter = load_drafter(pair.drafter, target)
    taps_ids = drafter.config.target_layer_ids

    def target_pass(ids):
        S = ids.shape[1]
        with torch.no_grad():
            return target(ids, Batch.make([0], [0], [S], S, "cpu"), target.new_cache(1, S), taps_ids)

    ids = torch.randint(0, 500, (1, 6), generator=torch.Generator().manual_seed(1))
    for _ in range(18):  # the target's own greedy text, as training data is
        ids = torch.cat([ids, target.logits(target_pass(ids)[0])[:, -1:].argmax(-1)], dim=1)
    mask = torch.arange(ids.shape[1])[None] >= 6
    hidden, taps = target_pass(ids)
    blocks = sample_anchors(mask, 4, torch.Generator().manual_seed(0))
    _, positions, labels = block_inputs(ids, mask, blocks, 4, drafter.config.mask_token_id)
    rows = labels.flatten() != IGNORE
    every = target.logits(hidden)[0]
    at = positions.flatten()[rows]
    assert (every[at - 1].argmax(-1) == labels.flatten()[rows]).all()  # row p - 1 picked the token at p
    objective = DraftObjective(drafter)
    with torch.no_grad():
        assert objective.distillation(every[at - 1], hidden, positions, rows).abs().max() < 1e-5  # that very one
        assert objective.distillation(every[at], hidden, positions, rows).max() > 1e-2
        distilled, per_slot, counts = objective(ids, mask, taps, blocks, hidden)
        plain = objective(ids, mask, taps, blocks)
    # the per-slot log stays the cross-entropy, so runs of either loss compare; the loss is not it
    assert torch.equal(per_slot, plain[1]) and torch.equal(counts, plain[2])
    assert distilled > 0 and not torch.isclose(distilled, plain[0])


def test_anchors_are_distinct_sorted_and_only_on_a_supervised_token_before_another():
    mask = torch.zeros(3, 40, dtype=torch.bool)
    mask[0, 10:30] = True  # 19 candidates (10..28)
    mask[1, 35:] = True  # 4 candidates: fewer than asked for
    blocks = sample_anchors(mask, 8, torch.Generator().manual_seed(0))
    for row, candidates in ((0, set(range(10, 29))), (1, set(range(35, 39))), (2, set())):
        chosen = blocks.anchors[row][blocks.valid[row]].tolist()
        assert chosen == sorted(set(chosen)) and set(chosen) <= candidates
        assert len(chosen) == min(8, len(candidates))
    ids = torch.arange(40).expand(3, -1)
    _, positions, labels = block_inputs(ids, mask, blocks, 4, mask_token_id=999)
    for row in range(3):
        for slot, (pos, label) in enumerate(zip(positions[row].tolist(), labels[row].tolist())):
            supervised = slot % 4 > 0 and pos < 40 and bool(mask[row, pos]) and bool(blocks.valid[row, slot // 4])
            assert label == (pos if supervised else IGNORE)  # ids are positions here: slot j learns a + j


def test_prompts_are_read_as_prompts_openai_messages_or_sharegpt_conversations(tmp_path):
    lines = [{"prompt": "What is 2 + 3?"},
             {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                           {"role": "assistant", "content": "Hello"}]},
             {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi"},
                                {"from": "gpt", "value": "Hello"}, {"from": "human", "value": "Again"}]}]
    source = tmp_path / "p.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert data.read_conversations(source) == [
        [{"role": "user", "content": "What is 2 + 3?"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],  # the last answer dropped
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Again"}]]
    source.write_text(json.dumps({"conversations": [{"from": "bot", "value": "x"}]}) + "\n")
    with pytest.raises(ConfigError, match=r"p.jsonl:1: a conversation turn from 'bot'; known speakers: human"):
        data.read_conversations(source)
    source.write_text(json.dumps({"conversations": [{"from": "human"}]}) + "\n")
    with pytest.raises(ConfigError, match=r"p.jsonl:1: each line needs .* 'conversations' of \{from, value\}"):
        data.read_conversations(source)


def dflash_trt(*args, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dflash_trt", *map(str, args)], capture_output=True, text=True,
                          timeout=600, **kwargs)


TRAIN = ["--block-size", 4, "--draft-layers", 1, "--batch-size", 4, "--max-length", 320, "--num-anchors", 16,
         "--eval-prompts", 4, "--eval-max-tokens", 16, "--response-tokens", 32, "--log-every", 5]


@pytest.fixture(scope="module")
def trained(make_pair, tmp_path_factory):
    pair = make_pair()
    out = tmp_path_factory.mktemp("train") / "drafter"
    done = dflash_trt("train", "--target", pair.target, "--data", "gsm8k", "--num-prompts", 40, "-o", out,
                      "--steps", 40, "--lr", 3e-3, "--extra-block-size", 2, *TRAIN)
    assert done.returncode == 0, done.stderr
    return pair, out, done


@pytest.mark.slow
def test_a_tiny_drafter_learns_and_build_loads_it(trained, tmp_path):
    pair, out, done = trained
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == list(range(5, 41, 5))
    assert log[-1]["loss"] < 0.8 * log[0]["loss"], [r["loss"] for r in log]
    report = json.loads((out / "eval.json").read_text())
    assert report["prompts"] == 4 and report["temperature_0"]["verify_steps"] > 0
    assert "block 4, temperature 0: mean acceptance length" in done.stdout
    # trained at block 2 too, and measured there: at most one draft a step
    assert report["block_2"]["block_size"] == 2 and len(report["block_2"]["temperature_0"]["acceptance_histogram"]) == 2
    assert "block 2, temperature 0: mean acceptance length" in done.stdout
    built = dflash_trt("build", "--target", pair.target, "--drafter", out, "-o", tmp_path / "engine")
    assert built.returncode == 0, built.stderr
    ran = dflash_trt("run", tmp_path / "engine", "What is 2 + 3?", "--max-tokens", 8, "--stats")
    assert ran.returncode == 0 and "mean acceptance length" in ran.stderr, ran.stderr


@pytest.mark.slow
def test_a_drafter_distilled_from_the_targets_distributions_learns_its_tokens(trained, tmp_path):
    pair, first, _ = trained
    out = tmp_path / "distilled"
    done = dflash_trt("train", "--target", pair.target, "--data", first / "data", "-o", out, "--steps", 20,
                      "--lr", 3e-3, "--distill", *TRAIN[:-6], "--eval-max-tokens", 4, "--log-every", 5)
    assert done.returncode == 0, done.stderr
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert log[-1]["loss"] < 0.8 * log[0]["loss"], [r["loss"] for r in log]  # the divergence it trains on
    assert log[-1]["slot_loss"][0] < log[0]["slot_loss"][0], log  # and the cross-entropy of the target's tokens
    assert torch.load(out / "checkpoint.pt", weights_only=True)["train_config"]["distill"] is True


@pytest.mark.slow
def test_a_killed_run_resumed_ends_with_the_uninterrupted_runs_weights(trained, tmp_path):
    pair, first, _ = trained
    args = ["--target", pair.target, "--data", first / "data", "--steps", 12, "--checkpoint-every", 2, "--lr", 3e-3,
            *TRAIN[:-6]]
    whole = dflash_trt("train", *args, "-o", tmp_path / "whole", "--eval-max-tokens", 4)
    assert whole.returncode == 0, whole.stderr
    killed = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-m", "dflash_trt", "train", *map(str, args), "-o", killed],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while not (killed / "checkpoint.pt").exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    at_kill = torch.load(killed / "checkpoint.pt", weights_only=True)["step"]
    assert 0 < at_kill < 12  # killed part-way, not after the end
    resumed = dflash_trt("train", *args, "-o", killed, "--resume", "--eval-max-tokens", 4)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed at step {at_kill}" in resumed.stderr
    a, b = load_file(tmp_path / "whole" / "model.safetensors"), load_file(killed / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_bad_training_input_fails_by_name_and_leaves_no_run(make_pair, tmp_path):
    pair = make_pair()
    missing = dflash_trt("train", "--target", pair.target, "--data", tmp_path / "nope.jsonl", "-o", tmp_path / "d")
    assert missing.returncode == 1 and "nope.jsonl" in missing.stderr
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "fine"}\n{"question": "no prompt"}\n')
    wrong = dflash_trt("train", "--target", pair.target, "--data", bad, "-o", tmp_path / "d")
    assert wrong.returncode == 1 and "bad.jsonl:2" in wrong.stderr
    taps = dflash_trt("train", "--target", pair.target, "--data", "gsm8k", "--target-layer-ids", "0,9",
                      "--num-prompts", 2, "-o", tmp_path / "d2", "--response-tokens", 2)
    assert taps.returncode == 1 and "target_layer_ids = [0, 9]" in taps.stderr
    assert not (tmp_path / "d2").exists() and not (tmp_path / "d").exists()
    block = dflash_trt("train", "--target", pair.target, "--data", "gsm8k", "--block-size", 8, "--extra-block-size", 8,
                       "-o", tmp_path / "d10")
    assert block.returncode == 1 and "block size 8 to train beside the drafter's 8" in block.stderr
    no_run = dflash_trt("train", "--target", pair.target, "--data", "gsm8k", "-o", tmp_path / "d3", "--resume")
    assert no_run.returncode == 1 and "no checkpoint to resume from" in no_run.stderr
    alone = dflash_trt("train", "--target", pair.target, "--data", "gsm8k", "-o", tmp_path / "d4", "--shard-target")
    assert alone.returncode == 1 and "--nproc N" in alone.stderr and not (tmp_path / "d4").exists()
    # in processes of their own, the same errors reach the CLI as themselves, not as a rank's traceback
    ranked = dflash_trt("train", "--target", pair.target, "--data", tmp_path / "nope.jsonl", "-o", tmp_path / "d5",
                        "--nproc", 2)
    assert ranked.returncode == 1 and "Error: " in ranked.stderr and "nope.jsonl" in ranked.stderr
    assert "Traceback" not in ranked.stderr
    few = dflash_trt("train", "--target", pair.target, "--data", "gsm8k", "--num-prompts", 1, "-o", tmp_path / "d6",
                     "--nproc", 2)
    assert few.returncode == 1 and "1 prompts are fewer than the 2 processes" in few.stderr
    odd = make_pair(num_heads=3, num_kv_heads=1)
    unsplit = dflash_trt("train", "--target", odd.target, "--data", "gsm8k", "-o", tmp_path / "d7", "--nproc", 2,
                         "--shard-target")
    assert unsplit.returncode == 1 and "num_attention_heads = 3 does not split over 2 ranks" in unsplit.stderr
    wide = dflash_trt("train", "--target", pair.target, "--data", "gsm8k", "-o", tmp_path / "d8", "--nproc", 2,
                      "--shard-target", "--intermediate-size", 129)
    assert wide.returncode == 1 and "the drafter's intermediate_size = 129 does not split over 2 ranks" in wide.stderr
    short = dflash_trt("train", "--target", pair.target, "--data", "gsm8k", "--num-prompts", 3, "--eval-prompts", 2,
                       "--batch-size", 2, "-o", tmp_path / "d9")
    assert short.returncode == 1
    assert "3 sequences leave 1 for training after 2 held out; one step needs 2" in short.stderr
    assert not any((tmp_path / d).exists() for d in ("d5", "d6", "d7", "d8", "d9", "d10"))


def test_each_rank_trains_on_its_own_gpu_and_one_named_gpu_cannot_serve_several(monkeypatch):
    assert rank_device("cuda", 1, 2, cuda=True) == torch.device("cuda", 1)
    assert rank_device(None, 1, 2, cuda=True) == torch.device("cuda", 1)
    assert rank_device("cuda:1", 0, 1, cuda=True) == torch.device("cuda", 1)  # one process: as named
    assert rank_device(None, 1, 2, cuda=False) == torch.device("cpu")
    with pytest.raises(ConfigError, match="--device cuda:0 names one GPU for 2 processes"):
        rank_device("cuda:0", 1, 2, cuda=True)
    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    assert trainer._device(0, "cuda", 1) == torch.device("cuda") and chosen == []  # one process: the current GPU
    assert trainer._device(1, None, 2) == torch.device("cuda", 1) and chosen == [torch.device("cuda", 1)]


# no clipping: a rank clips the averaged gradient, one process would clip each half
ONE_STEP = TrainConfig(batch_size=2, max_length=320, num_anchors=8, eval_prompts=0, grad_clip=1e9)


def _ddp_rank(rank: int, world: int, init: str, pair, dataset_dir, out_dir, result: str) -> None:
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank))
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        trainer = Trainer(pair.target, data.TokenDataset(dataset_dir), out_dir, ONE_STEP, torch.device("cpu"), rank,
                          world)
        batch = next(data.batches(trainer.dataset, len(trainer.dataset), 2, 320, 0, data.Cursor(), rank, world))
        trainer.train_step(*batch[1:])
        if rank == 0:
            torch.save({k: v.grad for k, v in trainer.drafter.named_parameters()}, result)
    finally:
        dist.destroy_process_group()
    parallel.leave()  # not through the interpreter's teardown (its docstring)


@pytest.mark.slow
def test_data_parallel_ranks_step_with_the_mean_of_their_halves_gradients(trained, tmp_path):
    pair, first, _ = trained
    out = tmp_path / "ddp"
    out.mkdir()
    for name in ("config.json", "model.safetensors"):
        (out / name).write_bytes((first / name).read_bytes())
    mp.start_processes(_ddp_rank, args=(2, str(tmp_path / "init"), pair, first / "data", out, str(tmp_path / "g.pt")),
                       nprocs=2, start_method="spawn")
    ddp = torch.load(tmp_path / "g.pt", weights_only=True)
    alone = Trainer(pair.target, data.TokenDataset(first / "data"), out, ONE_STEP, torch.device("cpu"))
    grads = []
    for rank in range(2):  # what each rank computed: its batch, its anchors
        alone.rank, alone.step = rank, 0
        batch = next(data.batches(alone.dataset, len(alone.dataset), 2, 320, 0, data.Cursor(), rank, 2))
        alone.optimizer.zero_grad()
        alone.train_step(*batch[1:])
        grads.append({k: v.grad.clone() for k, v in alone.drafter.named_parameters()})
        alone.drafter.load_state_dict(load_drafter(out, alone.target).state_dict())  # undo the step
    for name, g in ddp.items():
        torch.testing.assert_close(g, (grads[0][name] + grads[1][name]) / 2, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_data_answered_in_shares_over_the_ranks_is_the_one_process_data(make_pair, tmp_path):
    """Each rank answers every second prompt (an odd count: unequal shares) and rank 0
    interleaves the parts: sampled, each prompt's seed is its place in the whole dataset, so
    the data is the one-process run's byte for byte."""
    pair = make_pair()
    args = ["--target", pair.target, "--data", "gsm8k", "--num-prompts", 11, "--response-tokens", 24,
            "--response-temperature", 0.8, "--steps", 1, "--batch-size", 2, "--eval-prompts", 2, "--eval-max-tokens", 4]
    for name, nproc in (("one", 1), ("two", 2)):
        done = dflash_trt("train", *args, "--nproc", nproc, "-o", tmp_path / name)
        assert done.returncode == 0, done.stderr
    for name in ("tokens.bin", "index.json"):
        assert (tmp_path / "one/data" / name).read_bytes() == (tmp_path / "two/data" / name).read_bytes(), name
    assert len(data.TokenDataset(tmp_path / "two/data")) == 11
    assert not list((tmp_path / "two").glob(".data-part*"))  # the parts are removed


def test_fine_tuning_starts_from_the_drafters_weights_and_reads_no_target_weight(tmp_path):
    """--init-from a drafter of a 397B target must not read 793 GB on rank 0: the target lends
    only its config (no weight file here at all)."""
    target = tmp_path / "target"
    target.mkdir()
    for f in (DEMO_DIR / "target").iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, target)
    config, tensors = initial_drafter(target, DrafterShape(), DEMO_DIR / "drafter", seed=0)
    stored = load_file(DEMO_DIR / "drafter" / "model.safetensors")
    assert tensors.keys() == stored.keys()
    assert all(torch.equal(tensors[k], stored[k].to(tensors[k].dtype)) for k in stored)
    assert config["dflash_config"] == json.loads((DEMO_DIR / "drafter" / "config.json").read_text())["dflash_config"]


DEMO_TRAIN = ["--init-from", DEMO_DIR / "drafter", "--data", "gsm8k", "--num-prompts", 12, "--steps", 2, "--lr", 1e-6,
              "--batch-size", 4, "--max-length", 320, "--num-anchors", 16, "--eval-prompts", 4,
              "--eval-max-tokens", 32, "--response-tokens", 64, "--eval-temperature", 0, "--eval-temperature", 0.7,
              "--nproc", 2]


@pytest.mark.slow
def test_a_target_sharded_over_the_ranks_writes_the_same_data_drafter_and_evaluation(tmp_path):
    """Sharding changes where the target's weights live, not the result: the data its
    tensor-parallel engine writes, the drafter trained on its FSDP taps and the tensor-parallel
    evaluation are the unsharded run's (CPU, fp32). The demo pair, so that drafts are accepted."""
    runs = {}
    for name, extra in (("whole", []), ("sharded", ["--shard-target"])):
        done = dflash_trt("train", "--target", DEMO_DIR / "target", *DEMO_TRAIN, *extra, "-o", tmp_path / name)
        assert done.returncode == 0, done.stderr
        runs[name] = tmp_path / name
    whole, sharded = runs["whole"], runs["sharded"]
    for name in ("tokens.bin", "index.json"):
        assert (whole / "data" / name).read_bytes() == (sharded / "data" / name).read_bytes(), name
    a, b = load_file(whole / "model.safetensors"), load_file(sharded / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    reports = [json.loads((run / "eval.json").read_text()) for run in (whole, sharded)]
    for report in reports:
        report.pop("train_seconds")
    assert reports[0] == reports[1]
    assert reports[1]["temperature_0"]["tau"] > 1.5 and reports[1]["temperature_0.7"]["verify_steps"] > 0


def _sharded_rank(rank: int, world: int, init: str, pair, result: str) -> None:
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank))
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        target = load_target(pair.target, fsdp=init_device_mesh("cpu", (world,)))
        ids = torch.randint(0, 500, (1, 24), generator=torch.Generator().manual_seed(rank))  # each rank its own
        taps = tapped(target, ids)
        engine = sharded_engine(pair.target, pair.drafter, torch.device("cpu"), rank, world, max_batch_size=2,
                                max_seq_len=64)
        outputs = None
        if engine is not None:  # rank 0; the others followed until it released them
            outputs = [r.token_ids for r in engine.generate([[1, 5, 9, 14], [3, 3, 8]], SamplingParams(max_tokens=12),
                                                            mode="dflash")]
            engine.release()
        torch.save({"ids": ids, "taps": taps, "outputs": outputs}, f"{result}.{rank}")
    finally:
        dist.destroy_process_group()
    parallel.leave()


@pytest.mark.slow
@pytest.mark.parametrize("spec", [dict(target_type="qwen3_5", num_experts=4), dict(num_experts=4)],
                         ids=["qwen3_5_moe", "qwen3_moe"])
def test_sharded_targets_tap_and_generate_as_the_whole_target(make_pair, no_tokenizer, spec, tmp_path):
    pair = make_pair(**spec, **no_tokenizer)
    mp.start_processes(_sharded_rank, args=(2, str(tmp_path / "init"), pair, str(tmp_path / "r")), nprocs=2,
                       start_method="spawn")
    target = load_target(pair.target)
    for rank in range(2):
        got = torch.load(tmp_path / f"r.{rank}", weights_only=True)
        assert torch.equal(got["taps"], tapped(target, got["ids"]))
    engine = Engine(target, load_drafter(pair.drafter, target), max_batch_size=2, max_seq_len=64)
    want = [r.token_ids for r in engine.generate([[1, 5, 9, 14], [3, 3, 8]], SamplingParams(max_tokens=12),
                                                 mode="dflash")]
    assert torch.load(tmp_path / "r.0", weights_only=True)["outputs"] == want


@pytest.mark.slow
def test_a_run_under_torchrun_trains_over_its_ranks_and_speaks_once(tmp_path):
    args = ["train", "--target", DEMO_DIR / "target", "--init-from", DEMO_DIR / "drafter", "--data", "gsm8k",
            "--num-prompts", 8, "--response-tokens", 8, "--steps", 2, "--eval-prompts", 2, "--eval-max-tokens", 8,
            "--batch-size", 2, "--device", "cpu", "-o", tmp_path / "d"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m"]
    run = subprocess.run([*torchrun, "dflash_trt", *map(str, args)], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-2000:]
    assert "data: 4/4 responses (a share on each of 2 processes)" in run.stderr
    assert run.stdout.count("drafter: ") == 1 and "held-out prompts (2)" in run.stdout
    assert json.loads((tmp_path / "d" / "eval.json").read_text())["steps"] == 2


def _fsdp_reading_rank(rank: int, world: int, init: str, target_dir, result: str) -> None:
    from torch.distributed.tensor import DTensor

    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank))
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        reads = []  # (stored name, bytes, whole or a part)
        get, part = weights.Checkpoint.get, weights.Unread.__getitem__
        weights.Checkpoint.get = lambda self, name: _noted(reads, name, "whole", get(self, name))
        weights.Unread.__getitem__ = lambda self, where: _noted(reads, self.name, "part", part(self, where))
        target = load_target(target_dir, fsdp=init_device_mesh("cpu", (world,)))
        full = {name: p.full_tensor() for name, p in target.named_parameters() if isinstance(p, DTensor)}
        torch.save({"reads": reads, "full": full}, f"{result}.{rank}")
    finally:
        dist.destroy_process_group()
    parallel.leave()


def _noted(reads: list, name: str, how: str, tensor: torch.Tensor) -> torch.Tensor:
    reads.append((name, tensor.numel() * tensor.element_size(), how))
    return tensor


@pytest.mark.slow
@pytest.mark.parametrize("spec", [dict(num_experts=4), dict(target_type="qwen3_5", num_experts=4)],
                         ids=["experts-one-by-one", "experts-packed-with-a-shared-one"])
def test_fsdp_ranks_read_each_layer_tensor_once_between_them(make_pair, no_tokenizer, spec, tmp_path):
    pair = make_pair(**spec, **no_tokenizer)  # q/k/v, gate/up and experts stored apart, stacked on loading
    mp.start_processes(_fsdp_reading_rank, args=(2, str(tmp_path / "init"), pair.target, str(tmp_path / "r")),
                       nprocs=2, start_method="spawn")
    got = [torch.load(tmp_path / f"r.{rank}", weights_only=True) for rank in range(2)]
    whole = load_target(pair.target)
    for name, tensor in got[0]["full"].items():  # the ranks' rows make up the whole target's parameters
        assert torch.equal(tensor, whole.get_parameter(name)), name
    stored = weights.Checkpoint(pair.target)
    layer_bytes = sum(math.prod(stored.shape(n)) * stored.get(n).element_size() for n in stored.files
                      if ".layers." in n)
    layer_reads = [(how, size) for g in got for name, size, how in g["reads"] if ".layers." in name]
    assert {how for how, _ in layer_reads} == {"part"}  # no rank read a layer tensor whole
    assert sum(size for _, size in layer_reads) == layer_bytes  # and between them, every byte once
