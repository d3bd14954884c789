"""CUDA-graph passes equal the eager passes (GPU only).

At a batch size that is a bucket, and a prompt as long as a prefill width, the graph replays
the very kernels the eager passes launch (same shapes, same attention bound), so results are
bit-identical; with padding (rows, or prompt tokens) the GEMM shapes differ and bf16 rounding
may differ slightly, so those outputs are compared in fp32, and the requests' own rows must
not feel the padding at all.
"""

import random

import pytest
import torch

from dflash_trt import graphs
from dflash_trt.engine import Engine
from dflash_trt.graphs import PREFILL_WIDTHS, DecodePasses, GraphedPasses
from dflash_trt.loading import load_pair
from dflash_trt.sampling import SamplingParams

pytestmark = pytest.mark.cuda

SMALL = dict(hidden_size=512, intermediate_size=1024, num_layers=4, num_heads=8, num_kv_heads=2, head_dim=64,
             draft_layers=2, target_layer_ids=(0, 2), block_size=8, tokenizer_tokens=None, vocab_size=4096)


@pytest.fixture(scope="module")
def loaded(make_pair):
    pair = make_pair(**SMALL)
    return load_pair(pair.target, pair.drafter, device="cuda", dtype=torch.bfloat16, max_batch_size=4,
                     max_seq_len=256)


def _prompts(n, seed=0, lengths=None):
    """n random prompts of 3 to 60 tokens, or of lengths drawn from `lengths`."""
    gen = random.Random(seed)
    sizes = [gen.choice(lengths) if lengths else gen.randint(3, 60) for _ in range(n)]
    return [[gen.randrange(4000) for _ in range(size)] for size in sizes]


WIDE = PREFILL_WIDTHS[:2]  # prompt lengths whose prefill graph has no padding: the eager shapes


def run_joining(engine, prompts, sp):
    """Output ids of `prompts`, each prefilled alone (so prefill shapes do not depend on the
    batch) and then decoded together."""
    seqs = []
    for p in prompts:
        seqs.append(engine.add_request(p, sp))
        engine.step()
    while engine.has_work():
        engine.step()
    return [s.output_ids for s in seqs]


def test_engine_uses_graphs_on_cuda(loaded):
    assert isinstance(loaded.passes, GraphedPasses)


@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("mode", ["ar", "dflash"])
def test_graphed_engine_outputs_equal_eager_engine_at_bucket_sizes(loaded, n, mode):
    prompts = _prompts(n, seed=n, lengths=WIDE)
    sp = SamplingParams(max_tokens=40, ignore_eos=True)
    graphed = Engine(loaded.target, loaded.drafter, max_batch_size=n, max_seq_len=256)
    eager = Engine(loaded.target, loaded.drafter, max_batch_size=n, max_seq_len=256, cuda_graphs=False)
    assert isinstance(graphed.passes, GraphedPasses) and type(eager.passes) is DecodePasses
    a = [r.token_ids for r in graphed.generate(prompts, sp, mode=mode)]
    b = [r.token_ids for r in eager.generate(prompts, sp, mode=mode)]
    assert a == b


@pytest.mark.parametrize("mode", ["ar", "dflash"])
def test_padding_rows_do_not_change_real_rows(loaded, mode):
    """3 requests run in the 4-row bucket: their outputs are those they get when the 4th
    row is a real request (same graph, same shapes), so the padding row leaks nothing."""
    prompts = _prompts(4, seed=7)
    sp = SamplingParams(max_tokens=48, ignore_eos=True)
    engine = Engine(loaded.target, loaded.drafter, max_batch_size=4, max_seq_len=256, mode=mode)
    padded, full = run_joining(engine, prompts[:3], sp), run_joining(engine, prompts, sp)
    assert padded == full[:3]


def test_sampling_requests_run_through_graphs(loaded):
    engine = Engine(loaded.target, loaded.drafter, max_batch_size=2, max_seq_len=256)
    sp = SamplingParams(max_tokens=30, temperature=1.0, seed=5, ignore_eos=True)
    first = [r.token_ids for r in engine.generate(_prompts(2), sp, mode="dflash")]
    again = [r.token_ids for r in engine.generate(_prompts(2), sp, mode="dflash")]
    assert first == again and all(len(t) == 30 for t in first)


def test_warm_up_captures_every_bucket_and_leaves_outputs_unchanged(loaded):
    cold = Engine(loaded.target, loaded.drafter, max_batch_size=3, max_seq_len=256)
    cold.warm_up()  # first: where FA3 is installed, both engines then capture the backends it chose
    engine = Engine(loaded.target, loaded.drafter, max_batch_size=3, max_seq_len=256)
    prompts = _prompts(3, seed=11)
    sp = SamplingParams(max_tokens=20, ignore_eos=True)
    before = [r.token_ids for r in engine.generate(prompts, sp, mode="dflash")]
    # draft and verify graphs are per verify width, the whole block here; one context bucket,
    # the cache's capacity (256 + the block: below the first bucket)
    width = {"ar": 0, "draft": cold.block_size, "verify": cold.block_size}
    assert cold.passes.context_buckets == [256 + cold.block_size]
    decode = [(name, b, width[name], 256 + cold.block_size) for name in width for b in (1, 2, 3)]
    # one prompt at a time, padded to a width the cache holds
    prefill = [(name, 1, w, w) for name in ("prefill", "prefill+context") for w in (32, 64, 128, 256)]
    assert sorted(cold.passes._graphs) == sorted(decode + prefill)
    assert [r.token_ids for r in cold.generate(prompts, sp, mode="dflash")] == before


@pytest.mark.parametrize("mode", ["ar", "dflash"])
def test_rows_growing_past_a_context_bucket_replay_the_next_buckets_graphs(loaded, monkeypatch, mode):
    """The attention's split plan follows a bound on the keys that a graph fixes at capture, so
    each context bucket has graphs of its own: rows growing out of one replay the next one's,
    and generate what the eager engine (the same buckets, so the same kernels) does, bit for bit."""
    monkeypatch.setattr(graphs, "CONTEXT_BUCKET_MIN", 64)
    prompts = _prompts(2, seed=17, lengths=[32])  # from the first bucket (32 + the block) to the last
    sp = SamplingParams(max_tokens=100, ignore_eos=True)
    graphed = Engine(loaded.target, loaded.drafter, max_batch_size=2, max_seq_len=256, mode=mode)
    eager = Engine(loaded.target, loaded.drafter, max_batch_size=2, max_seq_len=256, mode=mode, cuda_graphs=False)
    assert graphed.passes.context_buckets == [64, 128, 256 + graphed.block_size]
    assert [r.token_ids for r in graphed.generate(prompts, sp)] == [r.token_ids for r in eager.generate(prompts, sp)]
    decode = "ar" if mode == "ar" else "verify"
    assert {key[3] for key in graphed.passes._graphs if key[0] == decode} == set(graphed.passes.context_buckets)


def test_verify_widths_are_timed_on_blocks_of_distinct_tokens(loaded):
    # A MoE verify costs what its tokens' distinct experts cost: the identical blocks that
    # padding rows draft would route every token to the same few, a wide verify timed as cheap.
    engine = Engine(loaded.target, loaded.drafter, max_batch_size=3, max_seq_len=256, verify_width="adaptive")
    engine.warm_up()
    assert engine.width_policy is not None
    key = ("draft", 3, engine.block_size, engine.passes.context_buckets[0])
    block = engine.passes._graphs[key][2]  # the buffer the timed verifies read
    assert len({tuple(row) for row in block.tolist()}) == 3


HYBRID = dict(target_type="qwen3_5", hidden_size=256, intermediate_size=512, num_layers=4, num_heads=4,
              num_kv_heads=2, head_dim=64, linear_heads=(2, 4), linear_head_dims=(32, 32), draft_layers=2,
              target_layer_ids=(1, 3), block_size=8, tokenizer_tokens=None, vocab_size=4096, rope_theta=1e7,
              draft_rope_theta=1e7)


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def hybrid(make_pair, request):
    pair = make_pair(**HYBRID)
    return load_pair(pair.target, pair.drafter, device="cuda", dtype=request.param, max_batch_size=4, max_seq_len=256)


@pytest.mark.parametrize("mode", ["ar", "dflash"])
def test_a_hybrid_target_runs_through_graphs_like_the_eager_passes(hybrid, mode):
    """Gated DeltaNet layers in the graphs: the in-place state snapshots and the commit copy
    run without a host sync. At a bucket size the graphs replay the eager kernels exactly."""
    prompts, sp = _prompts(4, seed=3, lengths=WIDE), SamplingParams(max_tokens=40, ignore_eos=True)
    eager = Engine(hybrid.target, hybrid.drafter, max_batch_size=4, max_seq_len=256, cuda_graphs=False)
    assert isinstance(hybrid.passes, GraphedPasses)
    a = [r.token_ids for r in hybrid.generate(prompts, sp, mode=mode)]
    assert a == [r.token_ids for r in eager.generate(prompts, sp, mode=mode)]


@pytest.mark.parametrize("mode", ["ar", "dflash"])
def test_hybrid_padding_rows_on_the_scratch_slot_do_not_change_real_rows(hybrid, mode):
    """3 requests in the 4-row bucket: the padding row's state and snapshots live in the
    scratch slot, so the real rows equal those of a full bucket."""
    prompts, sp = _prompts(4, seed=9), SamplingParams(max_tokens=40, ignore_eos=True)
    engine = Engine(hybrid.target, hybrid.drafter, max_batch_size=4, max_seq_len=256, mode=mode)
    padded, full = run_joining(engine, prompts[:3], sp), run_joining(engine, prompts, sp)
    assert padded == full[:3]


def test_hybrid_rows_growing_past_context_buckets_generate_what_the_eager_engine_does(hybrid, monkeypatch):
    """A hybrid's verify and commit graphs per context bucket: rows growing out of one replay
    the next one's and generate what the eager engine does, in fp32 and bf16."""
    monkeypatch.setattr(graphs, "CONTEXT_BUCKET_MIN", 64)
    prompts, sp = _prompts(2, seed=21, lengths=[32]), SamplingParams(max_tokens=100, ignore_eos=True)
    graphed = Engine(hybrid.target, hybrid.drafter, max_batch_size=2, max_seq_len=256, mode="dflash")
    eager = Engine(hybrid.target, hybrid.drafter, max_batch_size=2, max_seq_len=256, mode="dflash", cuda_graphs=False)
    assert [r.token_ids for r in graphed.generate(prompts, sp)] == [r.token_ids for r in eager.generate(prompts, sp)]
    assert {key[3] for key in graphed.passes._graphs if key[0] == "commit"} == set(graphed.passes.context_buckets)


# -- prefill graphs --------------------------------------------------------------------------

LENGTHS = [1, 5, 31, 33, 100, 200, 250]  # under, at and over widths, and past the widest (256)


@pytest.fixture(scope="module")
def loaded_fp32(make_pair):
    pair = make_pair(**SMALL)
    return load_pair(pair.target, pair.drafter, device="cuda", dtype=torch.float32, max_batch_size=2,
                     max_seq_len=256)


@pytest.mark.parametrize("mode", ["ar", "dflash"])
@pytest.mark.parametrize("model", ["qwen3", "hybrid"])
def test_prompts_prefilled_through_padded_graphs_generate_what_eager_prefill_does(loaded_fp32, hybrid, model, mode):
    """fp32, one prompt at a time: each prefill replays the graph of the next width up (the
    padding's K/V lies past the prompt, a hybrid's recurrence stops at its last token), so
    the outputs are the eager engine's; a prompt past the widest graph prefills eagerly."""
    loaded = loaded_fp32 if model == "qwen3" else hybrid
    if loaded.target.lm_head.weight.dtype != torch.float32:
        pytest.skip("padding changes the GEMM shapes: bf16 may round apart (fp32 compares outputs)")
    graphed = Engine(loaded.target, loaded.drafter, max_batch_size=1, max_seq_len=320, mode=mode)
    eager = Engine(loaded.target, loaded.drafter, max_batch_size=1, max_seq_len=320, mode=mode, cuda_graphs=False)
    sp = SamplingParams(max_tokens=24, ignore_eos=True)
    gen = random.Random(5)
    prompts = [[gen.randrange(4000) for _ in range(n)] for n in LENGTHS + [290]]
    assert [r.token_ids for r in graphed.generate(prompts, sp)] == [r.token_ids for r in eager.generate(prompts, sp)]
    widths = sorted(key[2] for key in graphed.passes._graphs if key[0].startswith("prefill"))
    assert widths == [32, 64, 128, 256], "290 tokens: past the widest graph that fits 320 + the block"


@pytest.mark.parametrize("model", ["qwen3", "hybrid"])
def test_a_prefill_graphs_padding_leaves_the_prompts_cache_rows_as_an_unpadded_pass_writes_them(loaded, hybrid,
                                                                                                 model):
    """bf16, the 32-token graph: a prompt of 20 tokens (12 of padding) writes the target's and
    the drafter's K/V of its 20 rows bit for bit as the first 20 of a 32-token prompt do (no
    padding): nothing of the padding reaches the prompt's rows."""
    loaded = loaded if model == "qwen3" else hybrid
    engine = Engine(loaded.target, loaded.drafter, max_batch_size=1, max_seq_len=256, mode="dflash")
    prompt = _prompts(1, seed=13, lengths=[32])[0]
    rows = {}
    for n in (32, 20):
        seq = engine.add_request(prompt[:n], SamplingParams(max_tokens=2, ignore_eos=True))
        engine.step()  # the prefill
        caches = (engine.target_cache.k, engine.target_cache.v, engine.draft_cache.k, engine.draft_cache.v)
        rows[n] = [c[:, seq.slot, :20].clone() for c in caches]
        while engine.has_work():
            engine.step()
    assert set(k for k in engine.passes._graphs if k[0].startswith("prefill")) == {("prefill+context", 1, 32, 32)}
    assert all(torch.equal(a, b) for a, b in zip(rows[32], rows[20]))
