"""Greedy DFlash output equals greedy AR output of the same engine, token for token."""

import random

import pytest

from dflash_trt.errors import ConfigError
from dflash_trt.loading import load_pair
from dflash_trt.sampling import SamplingParams
from dflash_trt.speculate import OracleDrafts

PROMPTS = [[7], [3, 1, 4], [10, 20, 30, 40, 50, 60, 70], list(range(100, 112)), list(range(200, 220, 1))]
MAX_TOKENS = 37  # not a multiple of any block size below


def run_both(engine, prompts, params, oracle_k=None, seed=0, refs=None):
    """AR then DFlash on the same engine; an oracle may force acceptance of the AR tokens
    (or of `refs`, a longer known continuation)."""
    ar = engine.generate(prompts, params, mode="ar")
    if oracle_k is not None:
        rng = random.Random(seed)
        refs = refs or {tuple(p): r.token_ids for p, r in zip(prompts, ar)}
        engine.oracle = OracleDrafts(refs, lambda seq: oracle_k(rng))
    try:
        dflash = engine.generate(prompts, params, mode="dflash")
    finally:
        engine.oracle = None
    return ar, dflash


ORACLES = {
    "real-drafter": None,
    "random-acceptance": lambda rng: rng.randint(0, 16),
    "full-acceptance": lambda rng: 99,
}


@pytest.mark.parametrize("oracle", ORACLES)
@pytest.mark.parametrize("block_size", [2, 4, 8, 16])
def test_greedy_dflash_equals_ar_for_a_ragged_batch(make_pair, no_tokenizer, device, block_size, oracle):
    pair = make_pair(block_size=block_size, **no_tokenizer)
    engine = load_pair(pair.target, pair.drafter, device=device, max_seq_len=128)
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    ar, dflash = run_both(engine, PROMPTS, params, ORACLES[oracle])
    for a, d in zip(ar, dflash):
        assert d.token_ids == a.token_ids
        assert len(d.token_ids) == MAX_TOKENS and d.finish_reason == "length"
    if oracle == "full-acceptance":
        # every verify step but the last accepts the whole block
        for d in dflash:
            assert d.stats.acceptance_lengths[:-1] == [block_size] * (len(d.stats.acceptance_lengths) - 1)


PAIRS = {
    "sliding-drafter": dict(draft_layers=2, draft_layer_types=("sliding_attention", "full_attention"),
                            sliding_window=4, block_size=8),
    "tied-sharded-gqa4": dict(tie_word_embeddings=True, num_shards=2, num_heads=8, num_kv_heads=2, head_dim=8),
    "default-taps-5-layers": dict(num_layers=6, draft_layers=3, target_layer_ids=None, block_size=4),
}


@pytest.mark.parametrize("name", PAIRS)
def test_greedy_dflash_equals_ar_across_pair_layouts(make_pair, no_tokenizer, device, name):
    pair = make_pair(**PAIRS[name], **no_tokenizer)
    engine = load_pair(pair.target, pair.drafter, device=device, max_seq_len=128)
    ar, dflash = run_both(engine, PROMPTS, SamplingParams(max_tokens=29, ignore_eos=True),
                          ORACLES["random-acceptance"])
    assert [d.token_ids for d in dflash] == [a.token_ids for a in ar]


@pytest.mark.parametrize("oracle", ["real-drafter", "random-acceptance"])
@pytest.mark.parametrize("pair_name", ["full-drafter", "sliding-drafter"])
def test_greedy_dflash_equals_ar_with_a_draft_window(make_pair, no_tokenizer, device, pair_name, oracle):
    """A window shorter than most prompts and outputs (and a prompt longer than its ring)."""
    spec = PAIRS["sliding-drafter"] if pair_name == "sliding-drafter" else dict(block_size=4)
    pair = make_pair(**spec, **no_tokenizer)
    engine = load_pair(pair.target, pair.drafter, device=device, max_seq_len=128, draft_window=spec["block_size"] + 1)
    assert engine.draft_cache.k.shape[2] < 128
    ar, dflash = run_both(engine, PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True), ORACLES[oracle])
    assert [d.token_ids for d in dflash] == [a.token_ids for a in ar]


def test_a_draft_window_shorter_than_a_block_is_refused(make_pair, no_tokenizer):
    pair = make_pair(block_size=8, **no_tokenizer)
    with pytest.raises(ConfigError, match="draft_window_size = 7 must be 0 .* at least the block size \\(8\\)"):
        load_pair(pair.target, pair.drafter, draft_window=7)


def test_requests_join_and_leave_between_steps(make_pair, device, no_tokenizer):
    pair = make_pair(block_size=4, **no_tokenizer)
    engine = load_pair(pair.target, pair.drafter, device=device, max_batch_size=2, max_seq_len=128)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (5, 31, 2, 17, 9)]
    ar, dflash = run_both(engine, PROMPTS, params, ORACLES["random-acceptance"])
    assert [d.token_ids for d in dflash] == [a.token_ids for a in ar]
    assert [len(d.token_ids) for d in dflash] == [5, 31, 2, 17, 9]


def test_stop_token_inside_an_accepted_block_ends_generation_there(make_pair, device, no_tokenizer):
    pair = make_pair(block_size=8, **no_tokenizer)
    engine = load_pair(pair.target, pair.drafter, device=device, max_seq_len=128)
    free = engine.generate([PROMPTS[2]], SamplingParams(max_tokens=30, ignore_eos=True), mode="ar")[0].token_ids
    # a stop token that first appears at output index >= 3: inside the first verify block
    index = next(i for i in range(3, 8) if free[i] not in free[:i])
    params = SamplingParams(max_tokens=30, ignore_eos=True, stop_token_ids=(free[index],))
    ar, dflash = run_both(engine, [PROMPTS[2]], params, ORACLES["full-acceptance"], refs={tuple(PROMPTS[2]): free})
    assert dflash[0].token_ids == ar[0].token_ids == free[: index + 1]
    assert dflash[0].finish_reason == "stop"
    assert dflash[0].stats.verify_steps == 1 and dflash[0].stats.acceptance_lengths == [8]


def test_eos_from_the_target_config_stops_generation(make_pair, device, no_tokenizer):
    pair = make_pair(block_size=4, **no_tokenizer)
    engine = load_pair(pair.target, pair.drafter, device=device, max_seq_len=128)
    free = engine.generate([PROMPTS[1]], SamplingParams(max_tokens=20, ignore_eos=True), mode="ar")[0].token_ids
    engine.eos_token_ids = frozenset({free[4]})
    ar, dflash = run_both(engine, [PROMPTS[1]], SamplingParams(max_tokens=20), ORACLES["full-acceptance"],
                          refs={tuple(PROMPTS[1]): free})
    assert dflash[0].token_ids == ar[0].token_ids == free[: free.index(free[4]) + 1]


def test_acceptance_statistics_add_up(make_pair, device, no_tokenizer):
    pair = make_pair(block_size=4, **no_tokenizer)
    engine = load_pair(pair.target, pair.drafter, device=device, max_seq_len=128)
    _, dflash = run_both(engine, PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
                         ORACLES["random-acceptance"])
    for d in dflash:
        s = d.stats
        assert s.verify_steps == len(s.acceptance_lengths) == sum(s.acceptance_histogram(4))
        # the first token comes from prefill; each verify step yields its acceptance length
        # except the last one, which max_tokens may cut
        assert 1 + sum(s.acceptance_lengths[:-1]) < MAX_TOKENS <= 1 + sum(s.acceptance_lengths)
        assert s.mean_acceptance_length == pytest.approx(sum(s.acceptance_lengths) / s.verify_steps)
