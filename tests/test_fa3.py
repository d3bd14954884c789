"""FlashAttention-3 as the optional attention backend (dflash_trt/fa3.py): which shapes it
runs, and that where it runs it computes what our block attention does. The GPU tests need
the fa3-fwd wheel on a Hopper GPU and skip without it."""

from __future__ import annotations

import pytest
import torch

from dflash_trt import fa3
from dflash_trt.graphs import DecodePasses
from dflash_trt.loading import load_pair
from dflash_trt.ops import paged_block_attention, paged_block_attention_reference
from dflash_trt.sampling import SamplingParams
from dflash_trt.sequence import Sequence

needs_fa3 = pytest.mark.skipif(not fa3.installed(), reason="needs the fa3-fwd wheel on a Hopper GPU")


def shape(rows, tokens):
    return fa3.Shape(rows, tokens, 32, 8, 128)


def test_fa3_runs_exactly_the_shapes_it_timed_faster_on():
    times = {shape(1, 1): (0.010, 0.012), shape(1, 16): (0.027, 0.016), shape(8, 16): (0.087, 0.061),
             shape(32, 1): (0.050, 0.050)}  # a tie stays ours
    assert fa3.choose(times) == {shape(1, 16), shape(8, 16)}


def cache_case(rows, tokens, hq=32, hkv=8, d=128, capacity=700, seed=0):
    """q and a cache whose rows sit in shuffled slots at different lengths, the block last."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    num_slots = rows + 3
    k_cache, v_cache = (torch.randn(num_slots, capacity, hkv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
                        for _ in range(2))
    q = torch.randn(rows, tokens, hq, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    slots = torch.randperm(num_slots, device="cuda", generator=gen)[:rows].int()
    start = torch.randint(0, capacity - tokens, (rows,), device="cuda", generator=gen).int()
    return q, k_cache, v_cache, slots, start + tokens, start


def close_to_exact(out, q, k_cache, v_cache, slots, ctx_len, q_start, k_blk, v_blk, causal, scale):
    """Within a few bf16 steps of the fp32 reference (both backends round a softmax of fp32
    scores to bf16)."""
    exact = paged_block_attention_reference(q.float(), k_cache.float(), v_cache.float(), slots, ctx_len, q_start,
                                            None if k_blk is None else k_blk.float(),
                                            None if v_blk is None else v_blk.float(), causal, None, scale)
    return (out.float() - exact).abs().max().item() < 2e-2


@pytest.mark.cuda
@needs_fa3
@pytest.mark.parametrize("rows, tokens", [(1, 1), (1, 16), (5, 8), (4, 16)])
@pytest.mark.parametrize("heads", [(32, 8, 128), (16, 4, 256)], ids=["qwen3-8b", "qwen3.5"])
def test_fa3_computes_the_targets_causal_attention_of_full_rows_as_ours_does(rows, tokens, heads):
    q, k_cache, v_cache, slots, end, start = cache_case(rows, tokens, *heads)
    scale = heads[2] ** -0.5
    ours = paged_block_attention(q, k_cache, v_cache, slots, end, start, causal=True, scale=scale)
    fa3.use({fa3.Shape(rows, tokens, *heads)})
    theirs = paged_block_attention(q, k_cache, v_cache, slots, end, start, causal=True, scale=scale, fa3_ok=True)
    for out in (ours, theirs):
        assert close_to_exact(out, q, k_cache, v_cache, slots, end, start, None, None, True, scale)
    assert not torch.equal(ours, theirs) or rows * tokens == 1  # FA3 did run (its rounding differs)


@pytest.mark.cuda
@needs_fa3
@pytest.mark.parametrize("rows", [1, 6])
def test_fa3_computes_the_drafters_block_attention_and_writes_the_block_after_the_context(rows):
    q, k_cache, v_cache, slots, ctx, _ = cache_case(rows, 16)
    k_blk, v_blk = (torch.randn_like(q[:, :, :8]) for _ in range(2))
    ours = paged_block_attention(q, k_cache, v_cache, slots, ctx, ctx, k_blk, v_blk, scale=0.1)
    fa3.use({fa3.Shape(rows, 16, 32, 8, 128, causal=False)})
    before = k_cache.clone()
    theirs = paged_block_attention(q, k_cache, v_cache, slots, ctx, ctx, k_blk, v_blk, scale=0.1, fa3_ok=True)
    for out in (ours, theirs):
        assert close_to_exact(out, q, before, v_cache, slots, ctx, ctx, k_blk, v_blk, False, 0.1)
    assert not torch.equal(ours, theirs)
    for b, (slot, n) in enumerate(zip(slots.tolist(), ctx.tolist())):
        assert torch.equal(k_cache[slot, n: n + 16], k_blk[b])  # the dead rows after the context
        assert torch.equal(k_cache[slot, :n], before[slot, :n]) and torch.equal(k_cache[slot, n + 16:],
                                                                                before[slot, n + 16:])


@pytest.mark.cuda
@needs_fa3
def test_fa3_runs_only_where_chosen_and_only_the_kinds_it_computes_as_ours():
    q, k_cache, v_cache, slots, end, start = cache_case(2, 8)
    ours = paged_block_attention(q, k_cache, v_cache, slots, end, start, causal=True, scale=0.1)
    fa3.use({shape(2, 8), fa3.Shape(2, 8, 32, 8, 128, causal=False)})
    assert fa3.runs(q, k_cache, causal=True, window=0, block=False)
    assert fa3.runs(q, k_cache, causal=False, window=0, block=True)
    assert not fa3.runs(q, k_cache, causal=True, window=0, block=True)  # a causal block apart from the cache
    assert not fa3.runs(q, k_cache, causal=False, window=0, block=False)
    assert not fa3.runs(q, k_cache, causal=True, window=128, block=False)  # a sliding window
    assert not fa3.runs(q[:1], k_cache, causal=True, window=0, block=False)  # a shape not chosen
    # a chosen shape still runs ours unless the caller allows FA3 (a padded prefill does not)
    assert torch.equal(paged_block_attention(q, k_cache, v_cache, slots, end, start, causal=True, scale=0.1), ours)
    assert not torch.equal(paged_block_attention(q, k_cache, v_cache, slots, end, start, causal=True, scale=0.1,
                                                 fa3_ok=True), ours)


@pytest.mark.cuda
@needs_fa3
def test_fa3_replays_in_a_cuda_graph_with_new_lengths():
    q, k_cache, v_cache, slots, end, start = cache_case(4, 16)
    static_end = end.clone()
    graph = torch.cuda.CUDAGraph()
    fa3.attention(q, k_cache, v_cache, slots, static_end, 0.1)  # first-call work outside the capture
    with torch.cuda.graph(graph):
        out = fa3.attention(q, k_cache, v_cache, slots, static_end, 0.1)
    static_end.copy_(end - 100)
    graph.replay()
    assert torch.equal(out, fa3.attention(q, k_cache, v_cache, slots, end - 100, 0.1))


@pytest.mark.cuda
@needs_fa3
def test_warm_up_chooses_among_the_graphs_shapes_and_a_verify_with_fa3_matches_ours(make_pair):
    pair = make_pair(hidden_size=512, intermediate_size=1024, num_layers=4, num_heads=8, num_kv_heads=2,
                     head_dim=128, block_size=8, tokenizer_tokens=None, vocab_size=4096)
    engine = load_pair(pair.target, pair.drafter, device="cuda", dtype=torch.bfloat16, max_batch_size=4,
                       max_seq_len=512)
    engine.warm_up()
    graphs = {fa3.Shape(b, w, 8, 2, 128) for b in engine.passes.buckets for w in (1, 2, 4, 6, 8)}
    assert fa3.chosen() <= graphs | {fa3.Shape(b, 8, 8, 2, 128, causal=False) for b in engine.passes.buckets}
    # one verify of 4 rows with 100-400 committed rows (whatever the cache holds), eagerly,
    # through the model with FA3 and with ours: the same logits to bf16 noise
    rows = []
    for i in range(4):
        seq = Sequence(i, [1] * (100 + 100 * i), SamplingParams(max_tokens=8), frozenset())
        seq.slot, seq.num_cached, seq.output_ids = i, 100 + 100 * i, [17 + 101 * i]
        rows.append(seq)
    eager = DecodePasses(engine.target, engine.drafter, engine.target_cache, engine.draft_cache, engine.taps,
                         engine.block_size)
    x = eager.inputs(rows)
    block = eager.draft(x)
    logits = {}
    for name, chosen in (("ours", set()), ("fa3", {fa3.Shape(4, 8, 8, 2, 128)})):
        fa3.use(chosen)
        logits[name] = eager.verify(x, block)[0].float()
    assert not torch.equal(logits["ours"], logits["fa3"])  # FA3 did run
    assert (logits["ours"] - logits["fa3"]).abs().max().item() < 0.05 * logits["ours"].abs().max().item()
