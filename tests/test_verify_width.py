"""Adaptive verify width: the policy's choice, and losslessness at any width."""

import itertools
import logging
import random

import pytest
import torch
from test_hybrid_lossless import HYBRID
from test_moe import QWEN3_5_MOE
from test_sampling import P_MIN, _fields, chi_square_p, exact_next_token_marginals

from dflash_trt import ops
from dflash_trt.benchmark.bench import OracleNumCorrect
from dflash_trt.config import resolve_config
from dflash_trt.errors import ConfigError
from dflash_trt.graphs import DecodePasses
from dflash_trt.loading import load_pair
from dflash_trt.models import qwen3_5
from dflash_trt.sampling import SamplingParams
from dflash_trt.sequence import Sequence
from dflash_trt.speculate import OracleDrafts
from dflash_trt.verify_width import EXPLORE, VerifyWidth, candidate_widths

# a verify costs more the wider it is, as under load
TIMES = {1: {w: 10.0 + w for w in candidate_widths(16)}, 8: {w: 10.0 + 4 * w for w in candidate_widths(16)}}


def trained(accepted: int, width: int = 16, steps: int = 200) -> VerifyWidth:
    policy = VerifyWidth(16, TIMES)
    for _ in range(steps):
        policy.update([accepted] * 4, width)
    return policy


def test_candidates_are_the_block_and_its_quarters():
    assert candidate_widths(16) == (4, 8, 12, 16) and candidate_widths(3) == (2, 3)


def test_a_narrow_verify_wins_when_later_drafts_are_never_accepted():
    policy = trained(accepted=3)
    assert policy.expected_tokens(4) == pytest.approx(4.0, abs=0.05)
    assert policy.choose(1) == 4 and policy.choose(8) == 4


def test_the_whole_block_wins_when_every_draft_is_accepted():
    policy = trained(accepted=15)
    assert policy.choose(1) == 16 and policy.choose(5) == 16  # 5 rows: timed as the bucket of 8


def test_every_explore_th_step_verifies_the_whole_block():
    policy = trained(accepted=3)
    assert [policy.choose(1) for _ in range(EXPLORE)].count(16) == 1


def test_a_narrow_verify_informs_only_the_positions_it_shows():
    policy = VerifyWidth(16, TIMES)
    policy.update([7, 1], width=4)  # all 3 verified drafts accepted; draft 2 rejected
    assert policy.at_risk[1:5] == [2, 2, 1, 0] and policy.reached[1:5] == [2, 1, 1, 0]


class CycledWidths:
    """A policy stand-in: the widths in turn, whatever the statistics say."""

    def __init__(self, widths):
        self.widths = itertools.cycle(widths)

    def choose(self, num_rows):
        return next(self.widths)

    def update(self, accepted, width):
        pass


TARGETS = {
    "qwen3": dict(vocab_size=512, tokenizer_tokens=None, block_size=8),
    "qwen3.5": dict(**HYBRID, target_layer_ids=(1, 3), block_size=8),
    "qwen3.5-moe": dict(**QWEN3_5_MOE, block_size=8),
}
PROMPTS = [[7], [3, 1, 4], [10, 20, 30, 40, 50, 60, 70], list(range(100, 119))]


@pytest.mark.parametrize("oracle", ["real-drafter", "random-acceptance"])
@pytest.mark.parametrize("target", TARGETS)
def test_greedy_dflash_equals_ar_at_any_verify_width(make_pair, device, target, oracle):
    pair = make_pair(**TARGETS[target])
    engine = load_pair(pair.target, pair.drafter, device=device, max_seq_len=96)
    params = SamplingParams(max_tokens=29, ignore_eos=True)
    ar = engine.generate(PROMPTS, params, mode="ar")
    if oracle == "random-acceptance":
        rng = random.Random(0)
        engine.oracle = OracleDrafts({tuple(p): r.token_ids for p, r in zip(PROMPTS, ar)}, lambda s: rng.randint(0, 8))
    engine.width_policy = CycledWidths([2, 8, 5, 3, 8])
    dflash = engine.generate(PROMPTS, params, mode="dflash")
    assert [d.token_ids for d in dflash] == [a.token_ids for a in ar]
    widths = {d.stats.mean_verify_width for d in dflash}
    assert all(2 <= w < 8 for w in widths), widths  # the stats count what was verified
    if oracle == "random-acceptance":  # the oracle's k is cut to the width: never more than width - 1
        assert max(a for d in dflash for a in d.stats.acceptance_lengths) <= 8


def test_a_narrow_hybrid_verify_runs_its_causal_conv_as_the_op_with_a_kernel(make_pair, device, monkeypatch):
    # below the block's width the layer once ran its conv as torch ops of its own (~8 a layer,
    # a tenth of a 35B-A3B verify at 32 x 8), past ops.causal_conv and its CUDA kernel
    pair = make_pair(**TARGETS["qwen3.5"])
    engine = load_pair(pair.target, pair.drafter, device=device, max_seq_len=96)
    engine.width_policy = CycledWidths([2, 5, 3, 8])
    layer_torch_convs = []
    torch_conv = qwen3_5.causal_conv1d
    monkeypatch.setattr(qwen3_5, "causal_conv1d", lambda *a, **kw: layer_torch_convs.append(1) or torch_conv(*a, **kw))
    engine.generate(PROMPTS, SamplingParams(max_tokens=29, ignore_eos=True), mode="dflash")
    assert layer_torch_convs == []


@pytest.mark.cuda
def test_a_narrow_hybrid_verify_runs_no_pytorch_reference_that_the_whole_block_does_not(make_pair, caplog):
    # a reference on CUDA says so once and is slow (the tiny test shapes leave some kernels
    # out at any width)
    pair = make_pair(**TARGETS["qwen3.5"])
    engine = load_pair(pair.target, pair.drafter, device="cuda", dtype=torch.bfloat16, max_seq_len=96)

    def references(widths):
        engine.width_policy = CycledWidths(widths)
        ops._warn_once.cache_clear()
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger=ops.log.name):
            engine.generate(PROMPTS, SamplingParams(max_tokens=29, ignore_eos=True), mode="dflash")
        return {r.getMessage().split(" on CUDA")[0] for r in caplog.records if "PyTorch reference" in r.getMessage()}

    assert references([2, 5, 3]) <= references([8])


def test_a_draft_for_a_narrow_verify_proposes_only_the_drafts_it_verifies(make_pair, device):
    pair = make_pair(**TARGETS["qwen3"])
    engine = load_pair(pair.target, pair.drafter, device=device, max_seq_len=96)
    rows = []
    for i, prompt in enumerate(PROMPTS[1:]):
        seq = Sequence(i, prompt, SamplingParams(max_tokens=8), frozenset())
        seq.slot, seq.num_cached, seq.output_ids = i, len(prompt), [5 + i]
        rows.append(seq)
    passes = DecodePasses(engine.target, engine.drafter, engine.target_cache, engine.draft_cache, engine.taps,
                          engine.block_size)
    x = passes.inputs(rows)
    whole = passes.draft(x)
    mask = engine.drafter.config.mask_token_id
    for width in (2, 5, 8):
        block = passes.draft(x, width)
        assert torch.equal(block[:, :width], whole[:, :width])  # the same proposals where it makes them
        assert (block[:, width:] == mask).all()  # none past the width: their LM head rows never ran
    assert (whole[:, 1:] != mask).any()


def test_sampled_dflash_at_a_narrow_width_matches_the_target_distribution(make_pair, device):
    pair = make_pair(tokenizer_tokens=None, vocab_size=12, block_size=3, init_scale=0.7)
    engine = load_pair(pair.target, pair.drafter, device=device, max_batch_size=64, max_seq_len=16)
    engine.width_policy = CycledWidths([2])
    params = SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True)
    prompt, n = [3, 1, 4], 3000
    expected = exact_next_token_marginals(engine.target, prompt, params, depth=3)
    results = engine.generate([prompt] * n, [SamplingParams(**{**_fields(params), "seed": i}) for i in range(n)],
                              mode="dflash")
    for position in range(3):
        counts = torch.bincount(torch.tensor([r.token_ids[position] for r in results]), minlength=12).cpu()
        assert chi_square_p(counts, expected[position]) > P_MIN, position
    assert {r.stats.mean_verify_width for r in results} == {2.0}


def test_adaptive_width_needs_graphs_and_one_rank_and_says_so(make_pair):
    pair = make_pair(tokenizer_tokens=None, vocab_size=512)
    engine = load_pair(pair.target, pair.drafter, max_seq_len=32)
    with pytest.raises(ConfigError, match="verify_width = 'adaptive' needs CUDA graphs"):
        engine.sibling(verify_width="adaptive")
    with pytest.raises(ConfigError, match="verify_width must be one of full, adaptive, auto, got 'wide'"):
        engine.sibling(verify_width="wide")
    assert engine.sibling(verify_width="auto").verify_width == "full"  # auto: adaptive only on graphs
    with pytest.raises(ConfigError, match="verify_width = adaptive with tensor_parallel > 1 is not supported yet"):
        resolve_config(verify_width="adaptive", tensor_parallel=2)


@pytest.mark.parametrize("tau", [2.5, 6.5, 12.0])
def test_the_geometric_oracle_has_the_asked_mean_and_a_long_tail(tau):
    draw = OracleNumCorrect(tau, 16, seed=1, dist="geometric")
    ks = [draw(None) for _ in range(20000)]
    assert sum(ks) / len(ks) == pytest.approx(tau - 1, abs=0.08)
    assert max(ks) >= min(15, round(tau) + 4)  # unlike the two-point draw, far past the mean
    two_point = OracleNumCorrect(tau, 16, seed=1)
    assert max(two_point(None) for _ in range(1000)) <= int(tau)


def test_a_tensor_parallel_bench_refuses_an_adaptive_width(make_pair):
    from dflash_trt.benchmark.bench import run_bench
    from dflash_trt.config import BuildConfig
    from dflash_trt.engine import Engine
    from dflash_trt.loading import LoadedEngine, load_drafter, load_target
    from dflash_trt.parallel import Group
    from dflash_trt.tokenizer import Tokenizer

    pair = make_pair()
    shard = Group(0, 2)  # rank 0's shard of a two-rank pair, loaded (nothing runs, so no group is joined)
    target = load_target(pair.target, group=shard)
    engine = Engine(target, load_drafter(pair.drafter, target, group=shard), max_seq_len=300, verify_width="auto")
    assert engine.verify_width == "full"  # auto: one width for every rank
    loaded = LoadedEngine(engine, Tokenizer.from_dir(pair.target), BuildConfig(tensor_parallel=2))
    with pytest.raises(ConfigError, match="verify_width = adaptive with tensor parallelism is not supported yet"):
        run_bench(loaded, ["a prompt"], verify_width="adaptive")
