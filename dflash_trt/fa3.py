"""FlashAttention-3 as an optional backend of the target's cache attention.

Where the `fa3-fwd` wheel (FA3's forward, Hopper, bf16) is installed, Engine.warm_up times
FA3's flash_attn_with_kvcache against our block attention (ops.paged_block_attention) for
every shape its CUDA graphs run, at one context, and FA3 then runs the shapes where it was
faster (BENCHMARKS.md, "Block attention kernel": ours is behind FA3 on most verify shapes).
Both compute the same attention, so the choice changes rounding, never which keys a query
sees. FA3 takes only what it computes the same way: causal passes whose rows are all full
(a decode step or a verify; FA3 aligns each row's causal mask to the end of its keys, which
is wrong for a padded prefill row), no sliding window, bf16, head sizes 64/128/256.
Without the wheel nothing changes.
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
    """An attention call's shape: rows (batch), tokens per row, query/KV heads, head size."""

    rows: int
    tokens: int
    q_heads: int
    kv_heads: int
    head_dim: int


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


def runs(q: torch.Tensor, k_cache: torch.Tensor, causal: bool, window: int | None, full_rows: bool) -> bool:
    """Whether this cache attention call goes to FA3: chosen for its shape at warm-up, and one
    FA3 computes as ours does."""
    if not _chosen or not (full_rows and causal and not window and q.is_cuda and q.dtype == torch.bfloat16):
        return False
    bs, T, Hq, d = q.shape
    return Shape(bs, T, Hq, k_cache.shape[2], d) in _chosen


def attention(q, k_cache, v_cache, slots, end, scale: float) -> torch.Tensor:
    """ops.paged_block_attention's causal pass of full rows on FA3: q [bs, T, Hq, d]; the caches
    [num_slots, capacity, Hkv, d] hold each row's keys at [0, end) of slot slots[b], the
    block's T included (written by qk_norm_rope), so query t sits at end - T + t."""
    from fa3_fwd_interface import flash_attn_with_kvcache

    return flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=end, cache_batch_idx=slots, causal=True,
                                   softmax_scale=scale)


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
    end = torch.full((s.rows,), context + s.tokens, dtype=torch.int32, device="cuda")
    start, scale = end - s.tokens, s.head_dim ** -0.5
    ours = _replay_ms(lambda: paged_block_attention(q, k_cache, v_cache, slots, end, start, causal=True, scale=scale),
                      reps)
    return ours, _replay_ms(lambda: attention(q, k_cache, v_cache, slots, end, scale), reps)


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


def choose_for(target, buckets: list[int], widths: list[int], max_seq_len: int) -> set[Shape]:
    """At warm-up: time the target's attention shapes (every bucket x every pass width) on both
    backends at context min(max_seq_len / 2, CHOICE_CONTEXT) and let FA3 run where it was
    faster. No-op (empty) without the wheel, or for a target whose attention FA3 does not take."""
    dims = target.config.dims
    if not installed() or target.lm_head.weight.dtype != torch.bfloat16 or dims.head_dim not in HEAD_DIMS:
        return set()
    shapes = [Shape(b, w, dims.num_attention_heads, dims.num_key_value_heads, dims.head_dim)
              for b in buckets for w in widths]
    times = time_shapes(shapes, max(1, min(max_seq_len // 2, CHOICE_CONTEXT)))
    picked = choose(times)
    use(picked | (chosen() - set(shapes)))  # another engine's shapes stay as they were chosen
    log.info("attention: FA3 runs %d of %d shapes (rows x tokens): %s", len(picked), len(shapes),
             sorted((s.rows, s.tokens) for s in picked))
    return picked
