"""Chunked prefill (`prefill_chunk`): prompts enter the caches a chunk per step, between the
running requests' steps, and the output is what a one-pass prefill gives."""

import pytest
import torch
from test_hybrid_lossless import HYBRID
from test_moe import QWEN3_5_MOE

from dflash_trt.benchmark.prefill_stall import run_stall
from dflash_trt.config import resolve_config
from dflash_trt.engine import prefill_groups
from dflash_trt.errors import ConfigError
from dflash_trt.loading import load_pair
from dflash_trt.sampling import SamplingParams

NO_TOKENIZER = dict(tokenizer_tokens=None)
TARGETS = {
    "qwen3": dict(vocab_size=512, **NO_TOKENIZER, block_size=4),
    # hybrid: chunks narrower than the block (the verify-shaped path) and wider (the prefill path)
    "qwen3.5": dict(**HYBRID, target_layer_ids=(1, 3), block_size=8),
    "qwen3.5-moe": dict(**QWEN3_5_MOE, block_size=4),
}
PROMPTS = [list(range(30, 71)), [7], [3, 1, 4], list(range(100, 123))]
PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)


def engine(make_pair, target, device, chunk, **kw):
    pair = make_pair(**TARGETS[target])
    return load_pair(pair.target, pair.drafter, device=device, max_seq_len=96, **kw).sibling(prefill_chunk=chunk)


@pytest.mark.parametrize("target", TARGETS)
def test_chunked_prefill_gives_the_one_pass_output_in_both_modes(make_pair, target):
    """On the CPU in fp32 the split changes float rounding only, never these tokens (on a GPU,
    a one-token chunk runs other kernels than a wide pass: an MoE router's near-tie may flip)."""
    whole = engine(make_pair, target, "cpu", 0)
    expected = [r.token_ids for r in whole.generate(PROMPTS, PARAMS, mode="ar")]
    for chunk in (1, 5, 20):
        chunked = whole.sibling(prefill_chunk=chunk)
        for mode in ("ar", "dflash"):
            got = [r.token_ids for r in chunked.generate(PROMPTS, PARAMS, mode=mode)]
            assert got == expected, (chunk, mode)


@pytest.mark.parametrize("target", TARGETS)
def test_greedy_dflash_equals_ar_with_chunked_prefill(make_pair, device, target):
    for chunk in (1, 5, 20):
        e = engine(make_pair, target, device, chunk)
        ar = [r.token_ids for r in e.generate(PROMPTS, PARAMS, mode="ar")]
        assert [r.token_ids for r in e.generate(PROMPTS, PARAMS, mode="dflash")] == ar, chunk


def test_chunked_prefill_caches_what_one_pass_writes(make_pair):
    whole = engine(make_pair, "qwen3.5", "cpu", 0, max_batch_size=1)
    chunked = whole.sibling(prefill_chunk=6)
    for e in (whole, chunked):
        e.generate([PROMPTS[0]], SamplingParams(max_tokens=1), mode="dflash")
    n, tol = len(PROMPTS[0]), dict(atol=1e-4, rtol=1e-4)  # the split changes float rounding only
    torch.testing.assert_close(chunked.target_cache.k[:, 0, :n], whole.target_cache.k[:, 0, :n], **tol)
    torch.testing.assert_close(chunked.target_cache.state[:, 0], whole.target_cache.state[:, 0], **tol)
    torch.testing.assert_close(chunked.target_cache.conv[:, 0], whole.target_cache.conv[:, 0], **tol)
    torch.testing.assert_close(chunked.draft_cache.k[:, 0, :n], whole.draft_cache.k[:, 0, :n], **tol)


def test_running_requests_advance_every_step_of_a_chunked_prefill(make_pair, device):
    e = engine(make_pair, "qwen3", device, 8, max_batch_size=3)
    e.set_mode("dflash")
    running = [e.add_request(p, SamplingParams(max_tokens=60, ignore_eos=True)) for p in PROMPTS[1:3]]
    while any(not s.output_ids for s in running):
        e.step()
    long = e.add_request(PROMPTS[0], SamplingParams(max_tokens=4, ignore_eos=True))
    steps = 0
    while not long.output_ids:
        events = e.step()
        steps += 1
        assert {ev.seq.request_id for ev in events if ev.new_tokens} >= {s.request_id for s in running}
    assert steps == -(-len(PROMPTS[0]) // 8)  # one chunk of 8 per step
    assert long.num_cached == len(PROMPTS[0])


def test_a_chunk_is_shared_first_come_first_served(make_pair):
    e = engine(make_pair, "qwen3", "cpu", 30, max_batch_size=3)
    first, second = (e.add_request(p, SamplingParams(max_tokens=2)) for p in (PROMPTS[0], PROMPTS[3]))
    e.step()
    assert (first.num_cached, second.num_cached) == (30, 0)
    e.step()  # the first's last 11 tokens, then 19 of the second's
    assert (first.num_cached, second.num_cached) == (41, 19) and first.output_ids and not second.output_ids


def test_aborting_a_request_mid_prefill_frees_its_slot(make_pair):
    e = engine(make_pair, "qwen3", "cpu", 4, max_batch_size=1)
    seq = e.add_request(PROMPTS[0], SamplingParams(max_tokens=2))
    e.step()
    assert e.prefilling == [seq] and not e.free_slots
    e.abort(seq)
    assert not e.has_work() and e.free_slots == [0] and seq.finish_reason == "abort"
    assert e.generate([PROMPTS[2]], SamplingParams(max_tokens=3))[0].finish_reason == "length"


def test_a_seeded_sample_is_the_same_chunked_or_not(make_pair):
    whole = engine(make_pair, "qwen3", "cpu", 0)
    params = SamplingParams(max_tokens=10, temperature=0.9, seed=5, ignore_eos=True)
    expected = whole.generate([PROMPTS[0]], params, mode="dflash")[0].token_ids
    assert whole.sibling(prefill_chunk=7).generate([PROMPTS[0]], params, mode="dflash")[0].token_ids == expected


def test_a_negative_prefill_chunk_is_refused_by_name(make_pair):
    with pytest.raises(ConfigError, match="prefill_chunk_size = -1"):
        engine(make_pair, "qwen3", "cpu", -1)
    with pytest.raises(ConfigError, match="prefill_chunk_size must be 0"):
        resolve_config(prefill_chunk_size=-3)


def test_the_stall_test_counts_the_decoding_requests_gaps_during_the_long_prefill(make_pair):
    """Structure only (timings are the GPU bench's): chunked, each decoding request gets a
    delivery per chunk step while the long prompt prefills; in one pass it gets none."""
    base = engine(make_pair, "qwen3", "cpu", 0)
    prompts = [[5 + i, 6 + i, 7 + i] for i in range(4)]
    rows = run_stall(base, prompts, long_tokens=40, concurrency=2, chunks=(0, 8), max_tokens=60)
    one_pass, chunked = rows
    assert (one_pass.prefill_chunk, chunked.prefill_chunk) == (0, 8)
    assert one_pass.deliveries == 2  # one gap per request, spanning the whole prefill
    assert chunked.deliveries == 2 * (40 // 8)  # the gap ending at each of the 5 chunk steps
    assert all(r.long_ttft_s > 0 and r.gap_max_s >= r.gap_p99_s >= r.gap_p50_s > 0 for r in rows)
    with pytest.raises(ConfigError, match="raise --max-tokens"):
        run_stall(base, prompts, long_tokens=40, concurrency=2, chunks=(1,), max_tokens=20)


def test_prompts_admitted_together_prefill_in_passes_of_like_lengths():
    assert prefill_groups([100] * 8) == [list(range(8))]  # alike: one pass
    # six short prompts and two long ones: padding the short to 600 costs far more than a pass
    lengths = [600, 3, 4, 3, 610, 2, 3, 3]
    assert prefill_groups(lengths) == [[5, 1, 3, 6, 7, 2], [0, 4]]
    assert prefill_groups(lengths, pass_tokens=10**6) == [[5, 1, 3, 6, 7, 2, 0, 4]]  # passes too dear
    assert prefill_groups([5, 1, 5], pass_tokens=0) == [[1], [0, 2]]  # free passes: no padding at all
    assert prefill_groups([]) == []


def test_a_burst_of_short_and_long_prompts_gives_each_prompt_its_own_output(make_pair, monkeypatch):
    """Several prefill passes in one step (as grouped above): each prompt's output is what it
    gets alone, in both modes (CPU, fp32)."""
    pair = make_pair(**TARGETS["qwen3"])
    e = load_pair(pair.target, pair.drafter, device="cpu", max_seq_len=700, max_batch_size=8)
    prompts = [[i % 500 for i in range(1, 600)], [7, 8], [3, 1, 4], [i % 500 for i in range(50, 640)], [9], [5, 6, 7]]
    passes = []
    prefill = e.passes.prefill
    monkeypatch.setattr(e.passes, "prefill", lambda slots, *a: passes.append(len(slots)) or prefill(slots, *a))
    alone = [e.generate([p], PARAMS, mode="ar")[0].token_ids for p in prompts]
    for mode in ("ar", "dflash"):
        passes.clear()
        assert [r.token_ids for r in e.generate(prompts, PARAMS, mode=mode)] == alone, mode
        assert sorted(passes) == [2, 4], passes  # the two long prompts, then the four short ones
