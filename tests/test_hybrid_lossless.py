"""Qwen3.5 hybrid targets: greedy DFlash equals greedy AR token for token, and rolling the
linear-attention state back to an accepted prefix equals never having run the rest."""

import random

import pytest
import torch

from dflash_trt.kv_cache import Batch
from dflash_trt.loading import load_pair, load_target
from dflash_trt.sampling import SamplingParams
from dflash_trt.speculate import OracleDrafts

# Qwen3.5-family drafter settings: Qwen3 layers, RoPE theta 1e7, explicit taps.
HYBRID = dict(target_type="qwen3_5", tokenizer_tokens=None, vocab_size=512, head_dim=32, rope_theta=1e7,
              draft_rope_theta=1e7)
PAIRS = {
    # 3 linear + 1 full target layers, 2 full drafter layers, taps on a linear and a full layer
    "qwen3.5-like": dict(target_layer_ids=(1, 3)),
    # Qwen3.6-27B-like drafter: sliding + full layers with a window; taps over 6 target layers
    "qwen3.6-like-sliding": dict(num_layers=6, target_layer_ids=(1, 3, 4),
                                 draft_layer_types=("sliding_attention", "full_attention"), sliding_window=4,
                                 linear_heads=(1, 2), multimodal=False),
}
PROMPTS = [[7], [3, 1, 4], [10, 20, 30, 40, 50, 60, 70], list(range(100, 119))]
PARAMS = SamplingParams(max_tokens=19, ignore_eos=True)
ORACLES = {
    "full-acceptance": lambda rng: 99,  # every block accepted whole
    "bonus-only": lambda rng: 0,  # every draft rejected: only the bonus token is kept
    "random-acceptance": lambda rng: rng.randint(0, 16),
}


def engine_for(make_pair, pair_name, block_size, device, max_batch_size=8):
    pair = make_pair(**PAIRS[pair_name], **HYBRID, block_size=block_size)
    return load_pair(pair.target, pair.drafter, device=device, max_seq_len=96, max_batch_size=max_batch_size)


@pytest.fixture(scope="module")
def ar_engine(make_pair, device):
    """(engine, its greedy AR results for PROMPTS), one per pair layout and block size."""
    made = {}

    def get(pair_name, block_size):
        if (pair_name, block_size) not in made:
            engine = engine_for(make_pair, pair_name, block_size, device)
            made[pair_name, block_size] = engine, engine.generate(PROMPTS, PARAMS, mode="ar")
        return made[pair_name, block_size]

    return get


def dflash_with_oracle(engine, prompts, params, refs, oracle, seed=0):
    rng = random.Random(seed)
    engine.oracle = OracleDrafts({tuple(p): r.token_ids for p, r in zip(prompts, refs)}, lambda seq: oracle(rng))
    try:
        return engine.generate(prompts, params, mode="dflash")
    finally:
        engine.oracle = None


@pytest.mark.parametrize("oracle", ORACLES)
@pytest.mark.parametrize("pair_name, block_size", [
    ("qwen3.5-like", 4),
    ("qwen3.5-like", 16),  # B = the cache's 16 snapshots: cuts of 0..15 tokens
    ("qwen3.6-like-sliding", 8),
])
def test_greedy_dflash_equals_ar_on_a_hybrid_target(ar_engine, pair_name, block_size, oracle):
    engine, ar = ar_engine(pair_name, block_size)
    dflash = dflash_with_oracle(engine, PROMPTS, PARAMS, ar, ORACLES[oracle])
    assert [d.token_ids for d in dflash] == [a.token_ids for a in ar]
    lengths = [n for d in dflash for n in d.stats.acceptance_lengths[:-1]]  # the last may be cut by max_tokens
    if oracle == "full-acceptance":
        assert set(lengths) == {block_size}
    if oracle == "bonus-only":
        assert set(lengths) == {1}


@pytest.mark.parametrize("oracle", ["bonus-only", "random-acceptance"])
def test_blocks_wider_than_sixteen_can_be_cut_after_any_token(make_pair, device, oracle):
    # A cut of up to 23 tokens: the engine sizes the replay window and the conv snapshots by its block.
    engine = engine_for(make_pair, "qwen3.5-like", 24, device)
    assert engine.target_cache.num_snapshots == 24
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    ar = engine.generate(PROMPTS, params, mode="ar")
    dflash = dflash_with_oracle(engine, PROMPTS, params, ar, ORACLES[oracle])
    assert [d.token_ids for d in dflash] == [a.token_ids for a in ar]


def test_requests_join_and_leave_and_reused_slots_start_from_zero_state(make_pair, device, ar_engine):
    """Two slots for four requests of mixed lengths: slots are reused while others run.
    The reference is an engine with a slot per request, so state leaking from a slot's
    previous occupant shows up even though AR and DFlash would leak alike."""
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (5, 19, 2, 11)]
    _, wide = ar_engine("qwen3.5-like", 4)
    reference = [r.token_ids[:p.max_tokens] for r, p in zip(wide, params)]
    narrow = engine_for(make_pair, "qwen3.5-like", 4, device, max_batch_size=2)
    ar = narrow.generate(PROMPTS, params, mode="ar")
    dflash = dflash_with_oracle(narrow, PROMPTS, params, wide, ORACLES["random-acceptance"])
    assert [a.token_ids for a in ar] == reference
    assert [d.token_ids for d in dflash] == reference
    assert [len(t) for t in reference] == [5, 19, 2, 11]


@pytest.mark.parametrize("block", [1, 4, 16])
def test_commit_k_equals_running_only_the_first_k_tokens(make_pair, block):
    """After a pass of `block` tokens, commit(k) per row leaves exactly the state (and the
    next logits) of a cache that only ever saw the first k of them."""
    pair = make_pair(**PAIRS["qwen3.5-like"], **HYBRID, block_size=4)
    target = load_target(pair.target)
    gen = torch.Generator().manual_seed(block)
    prefixes = [7, 2, 11]  # committed lengths before the pass, ragged
    keep = [block, 1, max(1, block // 2)]  # tokens committed per row: all, the bonus only, half
    tokens = torch.randint(0, 500, (3, max(prefixes) + block), generator=gen)
    slots = [2, 0, 1]

    def prefill(cache, lengths):
        batch = Batch.make(slots, [0, 0, 0], lengths, max(lengths), "cpu")
        target(tokens[:, : max(lengths)], batch, cache)
        target.commit(cache, batch, batch.num_tokens)

    with torch.no_grad():
        spec = target.new_cache(3, 64)
        prefill(spec, prefixes)
        verify = Batch.make(slots, prefixes, [block] * 3, block, "cpu")
        ids = torch.stack([tokens[i, p: p + block] for i, p in enumerate(prefixes)])
        target(ids, verify, spec)
        target.commit(spec, verify, torch.tensor(keep))

        plain = target.new_cache(3, 64)
        prefill(plain, prefixes)
        # rows as wide as the verify's, not packed (Batch.packing): the same matmul shapes, so
        # that the conv windows can be compared bit for bit
        only = Batch.padded(torch.tensor(slots), torch.tensor(prefixes), torch.tensor(keep), max(keep),
                            max(p + k for p, k in zip(prefixes, keep)))
        target(torch.stack([tokens[i, p: p + max(keep)] for i, p in enumerate(prefixes)]), only, plain)
        target.commit(plain, only, only.num_tokens)

        torch.testing.assert_close(spec.state[:, slots], plain.state[:, slots], rtol=0, atol=1e-6)
        torch.testing.assert_close(spec.conv[:, slots], plain.conv[:, slots], rtol=0, atol=0)
        # and the next token sees the same history through both caches
        nxt = Batch.make(slots, [p + k for p, k in zip(prefixes, keep)], [1] * 3, 1, "cpu")
        a, _ = target(torch.tensor([[5], [6], [7]]), nxt, spec)
        b, _ = target(torch.tensor([[5], [6], [7]]), nxt, plain)
        torch.testing.assert_close(target.logits(a), target.logits(b), rtol=0, atol=1e-5)


def test_a_prefill_wider_than_the_replay_window_cannot_be_cut_back(make_pair):
    pair = make_pair(**PAIRS["qwen3.5-like"], **HYBRID, block_size=4)
    target = load_target(pair.target)
    cache = target.new_cache(1, 32, num_snapshots=4)
    batch = Batch.make([0], [0], [6], 6, "cpu")
    with torch.no_grad():
        target(torch.arange(6)[None], batch, cache)
    with pytest.raises(AssertionError, match="a pass wider than 4 tokens .a prefill. commits all its tokens"):
        target.commit(cache, batch, torch.tensor([2]))


@pytest.mark.parametrize("rows", [[40], [40, 23]])  # full rows (the conv kernel), ragged (the gathered form)
def test_a_wide_prefill_through_the_recurrent_kernel_equals_the_chunked_form(make_pair, device, monkeypatch, rows):
    """Prefills up to RECURRENT_PREFILL_TOKENS run decode's kernel in place; longer ones the
    chunked form (fla on CUDA): both give the same outputs, states and conv windows."""
    from dflash_trt.models import qwen3_5

    pair = make_pair(**PAIRS["qwen3.5-like"], **HYBRID, block_size=4)
    target = load_target(pair.target, device)
    ids = torch.randint(0, 500, (len(rows), max(rows)), generator=torch.Generator().manual_seed(3)).to(device)
    results = []
    for limit in (qwen3_5.RECURRENT_PREFILL_TOKENS, 0):
        assert max(rows) <= qwen3_5.RECURRENT_PREFILL_TOKENS
        monkeypatch.setattr(qwen3_5, "RECURRENT_PREFILL_TOKENS", limit)
        cache = target.new_cache(len(rows) + 1, 64, num_snapshots=4)
        batch = Batch.make(list(range(1, len(rows) + 1)), [0] * len(rows), rows, max(rows), device)
        with torch.no_grad():
            hidden, _ = target(ids, batch, cache)
        real = torch.arange(max(rows), device=device)[None] < torch.tensor(rows, device=device)[:, None]
        results.append((hidden[real], cache.state[:, 1:], cache.conv[:, 1:]))
    from dflash_trt.models import gated_delta

    # bounds relative to the values' scale: fla (the chunked form on CUDA) multiplies in tf32
    tol = 2e-2 if torch.device(device).type == "cuda" and gated_delta._fla_chunk() is not None else 2e-4
    for recurrent, chunked in zip(*results):
        assert (recurrent - chunked).abs().max() <= tol * chunked.abs().max()
