"""Tensor parallelism on the CPU (gloo, one process per rank): a sharded pair's logits and
tapped hidden states equal the unsharded pair's, and its greedy DFlash output equals the
unsharded output token for token."""

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from ports import free_ports

from dflash_trt import parallel, weights
from dflash_trt.engine import Engine
from dflash_trt.errors import ConfigError
from dflash_trt.kv_cache import Batch
from dflash_trt.loading import load_drafter, load_target
from dflash_trt.models.layers import LMHead
from dflash_trt.parallel import Group, _plan_lm_head, check_supported, leave, share_cpu_threads
from dflash_trt.sampling import SamplingParams

pytestmark = pytest.mark.slow
PROMPTS = [[7], [3, 1, 4], list(range(100, 112)), list(range(200, 220))]
PARAMS = SamplingParams(max_tokens=23, ignore_eos=True)
# sampled with the same seeds, a sharded pair draws what the whole one draws: top-k from the
# ranks' slices, top-p from gathered logits
SAMPLED = {"top-k": [SamplingParams(max_tokens=23, ignore_eos=True, temperature=0.9, top_k=40, seed=i)
                     for i in range(len(PROMPTS))],
           "top-p": [SamplingParams(max_tokens=23, ignore_eos=True, temperature=1.1, top_p=0.8, seed=i)
                     for i in range(len(PROMPTS))]}


def run_pair(pair, world: int = 1) -> dict:
    """Logits and taps of one ragged prefill, and AR and DFlash outputs of PROMPTS, greedy and
    sampled."""
    group = Group.current() if world > 1 else None  # the shard read tensor by tensor, as an engine loads it
    target = load_target(pair.target, group=group)
    drafter = load_drafter(pair.drafter, target, group=group)
    engine = Engine(target, drafter, max_batch_size=2, max_seq_len=128)
    lengths = [len(p) for p in PROMPTS]
    ids = torch.zeros(len(PROMPTS), max(lengths), dtype=torch.long)
    for i, p in enumerate(PROMPTS):
        ids[i, :len(p)] = torch.tensor(p)
    batch = Batch.make(list(range(len(PROMPTS))), [0] * len(PROMPTS), lengths, max(lengths), "cpu")
    cache = target.new_cache(len(PROMPTS), 64)
    with torch.inference_mode():
        hidden, taps = target(ids, batch, cache, drafter.config.target_layer_ids)
        logits = target.logits(hidden)
    return {"logits": logits, "taps": taps, "ar": [r.token_ids for r in engine.generate(PROMPTS, PARAMS, mode="ar")],
            "dflash": [r.token_ids for r in engine.generate(PROMPTS, PARAMS, mode="dflash")],
            **{name: [r.token_ids for r in engine.generate(PROMPTS, params, mode="dflash")]
               for name, params in SAMPLED.items()},
            **{f"{name} ar": [r.token_ids for r in engine.generate(PROMPTS, params, mode="ar")]
               for name, params in SAMPLED.items()},
            "kv_heads": target.config.dims.num_key_value_heads}


def _rank(rank: int, world: int, init: str, out: str, compute, *args) -> None:
    """One gloo rank: compute(*args); rank 0 saves every rank's result to `out`. A rank that
    got this far leaves without the interpreter's teardown (parallel.leave)."""
    share_cpu_threads(world)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        result = compute(*args)
        gathered = [None] * world
        dist.all_gather_object(gathered, result)
        if rank == 0:
            torch.save(gathered, out)
    finally:
        dist.destroy_process_group()
    leave()


def test_a_cpu_rank_takes_its_share_of_the_cores_unless_omp_num_threads_says(monkeypatch):
    before = torch.get_num_threads()
    cores = len(os.sched_getaffinity(0))
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        torch.set_num_threads(cores)
        share_cpu_threads(2)
        assert torch.get_num_threads() == max(1, cores // 2)
        share_cpu_threads(4 * cores)  # more ranks than cores: one thread each, not none
        assert torch.get_num_threads() == 1
        torch.set_num_threads(cores)
        monkeypatch.setenv("OMP_NUM_THREADS", str(cores))
        share_cpu_threads(2)
        assert torch.get_num_threads() == cores
    finally:
        torch.set_num_threads(before)


HYBRID = dict(target_type="qwen3_5", head_dim=16, rope_theta=1e7, draft_rope_theta=1e7, linear_heads=(2, 4),
              target_layer_ids=(1, 3))


@pytest.mark.parametrize("world, heads, spec", [
    (2, (8, 4), {}),
    (4, (4, 2), {}),  # each KV head replicated on two ranks
    (2, (4, 2), HYBRID),  # Qwen3.5: Gated DeltaNet and gated attention layers
    (2, (4, 2), dict(num_experts=4, mlp_only_layers=(1,))),  # Qwen3 MoE, one dense layer
    (2, (4, 2), dict(HYBRID, num_experts=4)),  # Qwen3.5 MoE, its shared expert packed as one more
    (2, (4, 2), dict(HYBRID, num_experts=4, shared_expert_size=64)),  # ... a shared expert of its own width
], ids=["qwen3-tp2", "qwen3-tp4", "qwen3.5-tp2", "qwen3-moe-tp2", "qwen3.5-moe-tp2", "qwen3.5-moe-wide-shared-tp2"])
def test_a_sharded_pair_computes_what_the_whole_pair_does(make_pair, no_tokenizer, tmp_path, world, heads, spec):
    num_heads, num_kv_heads = heads
    pair = make_pair(num_heads=num_heads, num_kv_heads=num_kv_heads, block_size=4, **{"head_dim": 16, **spec},
                     **no_tokenizer)
    whole = run_pair(pair)
    out = tmp_path / "ranks.pt"
    mp.start_processes(_rank, args=(world, str(tmp_path / "init"), str(out), run_pair, pair, world), nprocs=world,
                       start_method="spawn")
    ranks = torch.load(out, weights_only=False)
    for rank in ranks:
        # fp32, summed in another order (partial sums over ranks): equal to rounding, relative
        # to the values' scale (a shard that reads the wrong heads is off by the scale itself)
        for name in ("logits", "taps"):
            scale = whole[name].abs().max()
            assert (rank[name] - whole[name]).abs().max() <= 5e-5 * scale, name
        assert rank["ar"] == whole["ar"] and rank["dflash"] == whole["dflash"]
        assert all(rank[name] == whole[name] for name in ("top-k", "top-p", "top-k ar", "top-p ar"))
        assert rank["kv_heads"] == max(num_kv_heads // world, 1)
    assert whole["dflash"] == whole["ar"]
    assert whole["top-k"] != whole["dflash"] and whole["top-p"] != whole["dflash"]  # the draws are not greedy


def head_and_rows(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An LM head whose best logit is tied between a row on each half of the vocabulary for
    the first hidden row, and random for the others."""
    gen = torch.Generator().manual_seed(0)
    weight, hidden = torch.randn(vocab, 8, generator=gen), torch.randn(5, 8, generator=gen)
    hidden[0] = torch.eye(8)[0]
    weight[:, 0] = torch.linspace(-1, 1, vocab)
    weight[2, 0] = weight[vocab - 2, 0] = 9.0  # the tie: rows on the first and on the last rank
    return weight, hidden


def sharded_head_choices(vocab: int) -> dict:
    weight, hidden = head_and_rows(vocab)
    head = LMHead(8, vocab, bias=False)
    head.weight = torch.nn.Parameter(_plan_lm_head(head, Group.current())(weight))
    with torch.inference_mode():
        return {"argmax": head.argmax(hidden), "logits": head(hidden), "rows": head.weight.shape[0]}


@pytest.mark.parametrize("world, vocab", [(2, 10), (3, 10)], ids=["even-split", "uneven-split"])
def test_the_vocabulary_parallel_greedy_choice_is_the_whole_heads_argmax_ties_included(tmp_path, world, vocab):
    weight, hidden = head_and_rows(vocab)
    whole = hidden @ weight.T
    out = tmp_path / "ranks.pt"
    mp.start_processes(_rank, args=(world, str(tmp_path / "init"), str(out), sharded_head_choices, vocab),
                       nprocs=world, start_method="spawn")
    ranks = torch.load(out, weights_only=False)
    assert [r["rows"] for r in ranks] == ([5, 5] if world == 2 else [4, 4, 2])  # each rank holds its slice only
    for rank in ranks:
        assert rank["argmax"].tolist() == whole.argmax(dim=-1).tolist()
        assert rank["argmax"][0] == 2  # the tie goes to the lowest index, as one device's argmax
        torch.testing.assert_close(rank["logits"], whole)  # sampling still sees every logit


@pytest.mark.parametrize("changes, message", [
    (dict(intermediate_size=130), "intermediate_size = 130 does not split over 4 ranks"),
    (dict(num_attention_heads=6), "num_attention_heads = 6 does not split over 4 ranks"),
    (dict(num_key_value_heads=3), "num_key_value_heads = 3 neither splits over nor replicates onto 4 ranks"),
])
def test_what_cannot_be_sharded_is_refused_by_name(make_pair, no_tokenizer, changes, message):
    config = load_target(make_pair(num_heads=8, num_kv_heads=2, **no_tokenizer).target).config
    config = dataclasses.replace(config, dims=dataclasses.replace(config.dims, **changes))
    with pytest.raises(ConfigError, match=message):
        check_supported(config, 4)


def dflash_trt(*args, **kwargs) -> subprocess.CompletedProcess:
    """The CLI in a process of its own: a tensor-parallel run joins a process group, which
    must not outlive it."""
    return subprocess.run([sys.executable, "-m", "dflash_trt", *map(str, args)], capture_output=True, text=True,
                          timeout=300, **kwargs)


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    """The demo pair built whole and for two ranks (block 16, 4 query / 2 KV heads)."""
    root = tmp_path_factory.mktemp("tp")
    for name, extra in (("whole", []), ("tp2", ["--tensor-parallel", 2])):
        result = dflash_trt("build", "--preset", "tiny", "-o", root / name, *extra)
        assert result.returncode == 0, result.stderr
    return root


def test_run_on_a_two_rank_engine_prints_what_the_whole_engine_prints(builds, tmp_path):
    args = ["Write a quicksort in Python.", "--max-tokens", 24, "--stats"]
    env = {**os.environ, "TMPDIR": str(tmp_path)}  # where the ranks' rendezvous folder goes
    whole, tp2 = dflash_trt("run", builds / "whole", *args), dflash_trt("run", builds / "tp2", *args, env=env)
    assert list(tmp_path.glob("dflash-trt-tp-*")) == []  # removed when the leader exits
    assert whole.returncode == 0 and tp2.returncode == 0, tp2.stderr
    assert tp2.stdout == whole.stdout and tp2.stdout.strip()
    # the build's rank count is a default: the directory holds whole weights
    overridden = dflash_trt("run", builds / "whole", *args, "--tensor-parallel", 2)
    assert overridden.returncode == 0 and overridden.stdout == whole.stdout, overridden.stderr
    refused = dflash_trt("run", builds / "whole", *args, "--tensor-parallel", 3)
    assert refused.returncode == 1 and "num_attention_heads = 4 does not split over 3 ranks" in refused.stderr
    assert json.loads((builds / "tp2" / "engine" / "engine.json").read_text())["build_config"]["tensor_parallel"] == 2


def test_a_rank_reads_only_its_part_of_each_split_tensor(builds, monkeypatch):
    read = []

    def counted(tensor):
        read.append(tensor.numel() * tensor.element_size())
        return tensor

    get, index = weights.Checkpoint.get, weights.Unread.__getitem__
    monkeypatch.setattr(weights.Checkpoint, "get", lambda self, name: counted(get(self, name)))
    monkeypatch.setattr(weights.Unread, "__getitem__", lambda self, where: counted(index(self, where)))
    target = builds / "whole" / "engine" / "target"  # fused tensors, as an engine stores them
    whole = load_target(target)
    whole_bytes, read[:] = sum(read), []
    part = load_target(target, group=Group(0, 2))  # rank 0 of 2, loaded alone: no collective runs
    assert sum(read) < 0.55 * whole_bytes  # its half of every split tensor, the norms whole
    down = part.get_parameter("model.layers.0.mlp.down_proj.weight")  # rank 0: the first half of its columns
    assert torch.equal(down, whole.get_parameter("model.layers.0.mlp.down_proj.weight")[:, :down.shape[1]])


def _leaving_rank(rank: int, world: int, init: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))  # a follower never released fails the test, not CI
    if rank == 0:
        parallel._end_group([])
        with open(out, "w") as f:
            f.write(f"group alive after: {dist.is_initialized()}")
    else:
        parallel.follow(engine=None)  # the leader's first word must be "stop": this engine is never used
        dist.destroy_process_group()
    leave()


def test_a_leader_at_exit_releases_its_followers_and_ends_the_group_with_them(tmp_path):
    mp.start_processes(_leaving_rank, args=(2, str(tmp_path / "init"), str(tmp_path / "out")), nprocs=2,
                       start_method="spawn")
    assert (tmp_path / "out").read_text() == "group alive after: False"


def test_a_leader_whose_call_failed_kills_its_followers_at_exit(monkeypatch):
    monkeypatch.setattr(parallel, "_ending", threading.Event())  # the module's own stays clear for other tests
    monkeypatch.setattr(parallel, "_broken", True)
    follower = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    parallel._end_group([follower])
    assert follower.wait(timeout=10) == -signal.SIGKILL


def test_a_rank_that_dies_ends_the_leader_with_a_clear_line_not_a_hang(builds):
    script = ("import os, sys, time; from dflash_trt.loading import load_engine; "
              f"load_engine({str(builds / 'tp2' / 'engine')!r}); print('loaded', flush=True); time.sleep(120)")
    leader = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert leader.stdout.readline().strip() == "loaded"
    followers = subprocess.run(["pgrep", "-P", str(leader.pid)], capture_output=True, text=True).stdout.split()
    assert len(followers) == 1
    start = time.monotonic()
    os.kill(int(followers[0]), signal.SIGKILL)
    _, err = leader.communicate(timeout=30)
    assert leader.returncode == 1 and time.monotonic() - start < 10
    assert "tensor-parallel rank 1" in err and "exited with code -9" in err


def test_a_two_rank_build_of_a_pair_that_cannot_be_sharded_fails_by_name(make_pair, no_tokenizer, tmp_path):
    pair = make_pair(num_heads=4, num_kv_heads=2, **no_tokenizer)
    result = dflash_trt("build", "--target", pair.target, "--drafter", pair.drafter, "--tensor-parallel", 3,
                        "-o", tmp_path / "out")
    assert result.returncode == 1 and "num_attention_heads = 4 does not split over 3 ranks" in result.stderr
    assert not (tmp_path / "out").exists()


def test_serve_runs_a_two_rank_engine_under_tritonserver_and_sigterm_stops_every_rank(builds):
    """serve's --tensor-parallel on a whole build (the override reaches the dflash model)."""
    http, grpc, metrics, openai = free_ports(4)
    serve = subprocess.Popen([sys.executable, "-m", "dflash_trt", "serve", str(builds / "whole"), "--http-port",
                              str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics), "--openai-port",
                              str(openai), "--tensor-parallel", "2"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert serve.stdout.readline().startswith("HTTP"), serve.stderr.read() if serve.poll() is not None else ""
        ranks = followers_of(builds / "whole")
        assert len(ranks) == 1
        args = ["Write a quicksort in Python.", "--max-tokens", 24]
        served = dflash_trt("generate", *args, "--url", f"127.0.0.1:{grpc}")
        assert served.returncode == 0, served.stderr
        assert served.stdout == dflash_trt("run", builds / "whole", *args).stdout
    finally:
        serve.send_signal(signal.SIGTERM)
        serve.communicate(timeout=60)
    assert serve.returncode == 0
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and followers_of(builds / "whole"):
        time.sleep(0.2)
    assert not followers_of(builds / "whole")


def followers_of(out) -> list[str]:
    return subprocess.run(["pgrep", "-f", f"dflash_trt.parallel {out / 'engine'}"], capture_output=True,
                          text=True).stdout.split()


@pytest.mark.parametrize("oracle", [[], ["--oracle-tau", 3], ["--prefill-chunk-size", 5]],
                         ids=["real", "oracle", "chunked-prefill"])
def test_bench_of_a_two_rank_engine_measures_what_the_whole_engine_does(builds, tmp_path, oracle):
    """Per concurrency bench makes an engine of its own and may set an oracle or a prefill
    chunk: the other rank must follow them, or the collectives (and the drafts) part."""
    args = ["--dataset", "mt_bench", "--num-prompts", 3, "--max-tokens", 12, "--concurrency", "1,2", *oracle]
    rows = {}
    for name in ("whole", "tp2"):
        result = dflash_trt("bench", builds / name, *args, "--json", tmp_path / f"{name}.json")
        assert result.returncode == 0, result.stderr
        rows[name] = json.loads((tmp_path / f"{name}.json").read_text())["rows"]
    for whole, tp2 in zip(rows["whole"], rows["tp2"], strict=True):
        assert (tp2["tau_steps"], tp2["identical_share"]) == (whole["tau_steps"], whole["identical_share"])
    if "--oracle-tau" not in oracle:
        assert all(r["identical_share"] == 1.0 for r in rows["tp2"])  # DFlash == AR through both ranks
