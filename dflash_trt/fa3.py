"""FlashAttention-3 as an optional backend of the cache attention.

Where the `fa3-fwd` wheel (FA3's forward, Hopper, bf16) is installed, Engine.warm_up times
FA3's flash_attn_with_kvcache against our block attention (ops.paged_block_attention) for
every shape its CUDA graphs run, at one context, and FA3 then runs the shapes where it was
faster (BENCHMARKS.md, "Block attention kernel": ours is behind FA3 on most verify shapes).
Both compute the same attention, so the choice changes rounding, never which keys a query
sees. FA3 takes two kinds of call, where the caller allows it (paged_block_attention's
`fa3_ok`): the target's causal pass over its cache when every row is full (a decode step or a
verify; FA3 aligns each row's causal mask to the end of its keys, wrong for a padded
prefill row), and the drafter's non-causal block after its context (FA3 appends the block's
K/V to the cache rows right after the context, which are dead: the next verify rewrites
them before any pass reads them). No sliding window or draft window; bf16; head sizes
64/128/256. Without the wheel nothing changes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

# The context the choice is timed at: half the engine's longest sequence (a typical row's),
# at most this. The winner of a shape mostly holds across contexts, but not everywhere: at
# batch 1 ours leads on short contexts and FA3 on long ones (BENCHMARKS.md).
CHOICE_CONTEXT = 4096
HEAD_DIMS = (64, 128, 256)


@dataclass(frozen=True)
class Shape:
    """An attention call's shape: rows (batch), tokens per row, query/KV heads, head size, and
    its kind: causal (the target's, block in the cache) or not (the drafter's, block apart)."""

    rows: int
    tokens: int
    q_heads: int
    kv_heads: int
    head_dim: int
    causal: bool = True


_chosen: set[Shape] = set()  # the shapes FA3 runs, in this process


def installed() -> bool:
    """Whether the fa3-fwd wheel imports and a Hopper GPU (sm_90, what it is built for) is here."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        return False
    try:
        import fa3_fwd_interface  # noqa: F401
    except ImportError:
        return False
    return True


def runs(q: torch.Tensor, k_cache: torch.Tensor, causal: bool, window: int | None, block: bool) -> bool:
    """Whether a cache attention call the caller allows FA3 for goes to it: chosen for its
    shape at warm-up, and of a kind FA3 computes as ours does (`block`: the block's K/V come
    apart from the cache, as the drafter's do; a causal call has its block in the cache)."""
    if not _chosen or window or causal == block or not (q.is_cuda and q.dtype == torch.bfloat16):
        return False
    bs, T, Hq, d = q.shape
    return Shape(bs, T, Hq, k_cache.shape[2], d, causal) in _chosen


def attention(q, k_cache, v_cache, slots, ctx_len, scale: float, k_blk=None, v_blk=None) -> torch.Tensor:
    """ops.paged_block_attention on FA3, for q [bs, T, Hq, d] and caches [num_slots, capacity,
    Hkv, d] (row b in slot slots[b]). Without k_blk: causal, each row's keys at [0, ctx_len) of
    its slot with the block's T last (query t at ctx_len - T + t). With k_blk, v_blk [bs, T,
    Hkv, d]: non-causal over the context [0, ctx_len) and the block, which FA3 writes into the
    cache at [ctx_len, ctx_len + T) first."""
    from fa3_fwd_interface import flash_attn_with_kvcache

    return flash_attn_with_kvcache(q, k_cache, v_cache, k=k_blk, v=v_blk, cache_seqlens=ctx_len, cache_batch_idx=slots,
                                   causal=k_blk is None, softmax_scale=scale)


def choose(times_ms: dict[Shape, tuple[float, float]]) -> set[Shape]:
    """The shapes FA3 should run: those it timed faster. times_ms: shape -> (ours, FA3)."""
    return {shape for shape, (ours, fa3) in times_ms.items() if fa3 < ours}


def time_shapes(shapes: list[Shape], context: int = CHOICE_CONTEXT, reps: int = 20) -> dict[Shape, tuple[float, float]]:
    """Per shape, (ours, FA3) in ms per call: CUDA-graph replays of each backend on a cache of
    random keys, every row at `context` keys (its own slot, so nothing hits L2 for another)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    return {s: _time_shape(s, context, reps, gen) for s in shapes}


def _time_shape(s: Shape, context: int, reps: int, gen: torch.Generator) -> tuple[float, float]:
    from dflash_trt.ops import paged_block_attention

    k_cache, v_cache = (torch.randn(s.rows, context + s.tokens, s.kv_heads, s.head_dim, device="cuda",
                                    dtype=torch.bfloat16, generator=gen) for _ in range(2))
    q = torch.randn(s.rows, s.tokens, s.q_heads, s.head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    slots = torch.arange(s.rows, dtype=torch.int32, device="cuda")
    scale = s.head_dim ** -0.5
    if s.causal:  # the target's: the block last in the cache
        end = torch.full((s.rows,), context + s.tokens, dtype=torch.int32, device="cuda")
        args, block = (slots, end, end - s.tokens), (None, None)
    else:  # the drafter's: the block apart, after `context` cached keys
        ctx = torch.full((s.rows,), context, dtype=torch.int32, device="cuda")
        args, block = (slots, ctx, ctx), tuple(torch.randn_like(q[:, :, :s.kv_heads]) for _ in range(2))
    ours = _replay_ms(lambda: paged_block_attention(q, k_cache, v_cache, *args, *block, causal=s.causal,
                                                    scale=scale), reps)
    return ours, _replay_ms(lambda: attention(q, k_cache, v_cache, args[0], args[1], scale, *block), reps)


def _replay_ms(call, reps: int) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()  # first-call work (workspace allocation) outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            call()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def use(shapes: set[Shape]) -> None:
    """FA3 runs these shapes from now on (passes captured before keep what they captured)."""
    _chosen.clear()
    _chosen.update(shapes)


def chosen() -> set[Shape]:
    return set(_chosen)


def choose_for(target, buckets: list[int], widths: list[int], max_seq_len: int, drafter=None,
               block_size: int = 0) -> set[Shape]:
    """At warm-up: time the attention shapes of the graphs (the target's at every bucket x pass
    width; the drafter's, when given, at every bucket x block_size) on both backends at context
    min(max_seq_len / 2, CHOICE_CONTEXT), and let FA3 run where it was faster. No-op (empty)
    without the wheel, or for models whose attention FA3 does not take."""
    if not installed():
        return set()
    shapes = []
    for model, tokens, causal in ((target, widths, True), (drafter, [block_size], False)):
        if model is None or model.lm_head.weight.dtype != torch.bfloat16:
            continue
        dims = model.config.dims
        if dims.head_dim in HEAD_DIMS:
            shapes += [Shape(b, w, dims.num_attention_heads, dims.num_key_value_heads, dims.head_dim, causal)
                       for b in buckets for w in tokens]
    if not shapes:
        return set()
    picked = choose(time_shapes(shapes, max(1, min(max_seq_len // 2, CHOICE_CONTEXT))))
    use(picked | (chosen() - set(shapes)))  # another engine's shapes stay as they were chosen
    log.info("attention: FA3 runs %d of %d shapes (rows x tokens, causal): %s", len(picked), len(shapes),
             sorted((s.rows, s.tokens, s.causal) for s in picked))
    return picked
