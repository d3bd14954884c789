"""Where a decode step's time goes, and how close AR at batch 1 is to the bandwidth roofline.

    python bench/profile_step.py --preset qwen3-8b --json out.json

Random weights of a real shape (dflash_trt.benchmark.random_weights), greedy, on the GPU:
1. the device-to-device copy bandwidth (bytes read + written per second, best of 20 copies
   of 1 GiB), and the roofline: weight bytes / copy bandwidth per AR token at batch 1;
2. the steady-state time of one AR step, one draft pass and one verify pass (CUDA events
   around many replays) at batch sizes 1 and 32; the wall time per AR step as the engine runs
   them (Engine.step: inputs, replay, token readback, emitting), with step n+1 queued before
   step n is read (the default) and serially: beyond the step's GPU time, the host gap; for
   a Qwen3.5 hybrid, the rollback (commit) after a verify pass;
3. a torch.profiler trace of a few AR and DFlash steps at batch 1, summed per kernel family;
4. with --ablate, the AR step at batch 1 again with each kind of layer part left out (the
   routed experts, the MoE blocks, the dense MLPs, the attention or linear-attention mixers,
   the attention, delta-rule and conv kernels alone, the residual norms):
   what each costs inside the step. The trace's per-kernel times do not add up to that: a
   kernel launched to overlap the one before it (plugins/pdl.h) counts the wait as its own;
5. with --trace FILE, a Chrome trace of graphed AR steps (every kernel's start and end) and,
   per kernel, the time from its start to the next kernel's start, which does add up;
   with --warm-up, Engine.warm_up first, as serving does (FA3 where installed).

The roofline counts the bytes a step really reads: every weight once, except the embedding
table (one row per token) and, for a mixture of experts, the routed experts: only the
distinct experts the pass's tokens picked (counted per layer from an eager run of the same
pass; random routers pick uniformly, the most distinct experts). `--layers` runs a
reduced-depth copy of a preset too large for one GPU (its per-layer times scale).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from contextlib import ExitStack

import torch

from dflash_trt import fa3, ops
from dflash_trt.benchmark.bench import encode_prompts
from dflash_trt.benchmark.datasets import load_prompts
from dflash_trt.benchmark.random_weights import random_engine
from dflash_trt.engine import cache_bytes
from dflash_trt.graphs import DecodePasses, GraphedPasses, random_block
from dflash_trt.models import qwen3_5
from dflash_trt.models.moe import SparseMoeBlock
from dflash_trt.sampling import SamplingParams
from dflash_trt.sequence import Sequence
from dflash_trt.verify_width import candidate_widths


def copy_bandwidth(device="cuda", nbytes=1 << 30, reps=20) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return 2 * nbytes / best


def weight_bytes(module: torch.nn.Module) -> int:
    seen, total = set(), 0
    for p in module.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def step_bytes(engine, run_pass, num_tokens: int) -> tuple[int, float]:
    """(bytes one pass of `num_tokens` tokens really reads, mean distinct experts per MoE
    layer) of `run_pass`, an eager pass of the engine's target: the roofline's numerator."""
    target = engine.target
    total = weight_bytes(target)
    embed = target.model.embed_tokens.weight
    if embed.data_ptr() != target.lm_head.weight.data_ptr():  # a tied table is read whole as the LM head
        total -= (embed.shape[0] - num_tokens) * embed.shape[1] * embed.element_size()
    blocks = [m for m in target.modules() if isinstance(m, SparseMoeBlock)]
    touched: list[int] = []

    def count(module, args):
        x = args[0].flatten(0, 1)
        logits = module.router(x) if module.packed_shared else module.gate(x)
        _, ids = ops.moe_route(logits, module.moe.top_k, module.moe.norm_topk_prob, shared=module.packed_shared)
        touched.append(ids.unique().numel() - module.packed_shared)  # routed experts (the shared one always runs)

    hooks = [m.register_forward_pre_hook(count) for m in blocks]
    try:
        run_pass()
    finally:
        for h in hooks:
            h.remove()
    for m, n in zip(blocks, touched):
        expert = (m.experts.gate_up_proj[0].numel() + m.experts.down_proj[0].numel()) * m.experts.down_proj.element_size()
        total -= (m.experts.num_experts - n) * expert
    return total, (sum(touched) / len(touched) if touched else 0.0)


def fake_running(engine, n: int, context: int) -> list[Sequence]:
    """n sequences with `context` committed rows of noise in the caches: timing only. Each row's
    last token differs (spread over the vocabulary), so an MoE's rows route differently, as
    real rows do; with one token for all, every row would pick the same experts."""
    seqs = []
    vocab = engine.target.config.vocab_size
    for i in range(n):
        seq = Sequence(i, [1] * context, SamplingParams(max_tokens=1 << 20, ignore_eos=True), frozenset())
        seq.slot, seq.num_cached, seq.output_ids = i, context, [(1 + 7919 * i) % vocab]
        seqs.append(seq)
    return seqs


def time_ms(fn, reps=50) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


FAMILIES = (("gated delta", ("gated_delta",)), ("attention", ("block_attention",)),
            ("gemm", ("gemm", "gemv", "cutlass", "sm90", "xmma", "cublas", "nvjet")),
            ("norm+rope", ("rms", "norm_rope", "rope")), ("silu*mul", ("silu",)), ("argmax/reduce", ("argmax", "reduce")),
            ("copy/index", ("copy", "index", "scatter", "gather", "fill")))


def family(name: str) -> str:
    low = name.lower()
    for fam, keys in FAMILIES:
        if any(k in low for k in keys):
            return fam
    return "other elementwise"


def step_wall_ms(engine, seqs, mode: str, overlap: bool, reps: int = 30) -> float:
    """Wall ms per step of Engine.step over these running sequences (AR, or DFlash verifying
    the whole block), overlapped or not. Steady state: every call waits for what it reads,
    so no sync brackets the timing (a few steps run first)."""
    saved = engine.mode, engine.verify_width, engine.overlap
    engine.mode, engine.verify_width, engine.overlap, engine.running = mode, "full", overlap, list(seqs)
    for _ in range(3):
        engine.step()
    start = time.perf_counter()
    for _ in range(reps):
        engine.step()
    ms = (time.perf_counter() - start) * 1e3 / reps
    torch.cuda.synchronize()  # what is still queued is done; nothing reads it
    (engine.mode, engine.verify_width, engine.overlap), engine.running = saved, []
    engine.queued = engine.queued_draft = None
    return ms


def wall_ms(fn, reps=50) -> float:
    """Host wall time per call of fn, which ends in a host sync (a token readback)."""
    for _ in range(3):
        fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) * 1e3 / reps


def _zeros_like_input(self, x, *args, **kwargs):
    return torch.zeros_like(x)


def _no_experts(x, gate_up, down, weights, ids, out_dtype=torch.float32, shared_last=False):
    return torch.zeros(x.shape, dtype=out_dtype, device=x.device)


def _no_experts_before_norm(x, gate_up, down, logits, top_k, renormalize, shared, residual, norm_weight, eps,
                            zero_centered=False, ticket=None):
    # moe_experts_add_rms_norm with the routing and experts left out, the add + norm after them kept
    zeros = torch.zeros(residual.shape, dtype=x.dtype, device=x.device)
    return ops.add_rms_norm(residual, zeros, norm_weight, eps, zero_centered)


def _no_norm_after_experts(x, gate_up, down, logits, top_k, renormalize, shared, residual, *args, **kwargs):
    # moe_experts_add_rms_norm with the routing and experts kept, the add + norm after them left out
    out = ops.moe_experts(x, gate_up, down, *ops.moe_route(logits, top_k, renormalize, shared), x.dtype, shared)
    return residual, out.reshape(residual.shape)


def _no_attention(q, *args, **kwargs):
    return torch.zeros_like(q)


def _no_delta_rule(q, k, v, *args, out_dtype=torch.float32, **kwargs):
    return torch.zeros(v.shape, dtype=out_dtype, device=v.device)


def _no_delta_step(qkv, a, b, z, *args, **kwargs):
    return torch.zeros_like(z)


def _no_conv(x, *args, **kwargs):
    return x


def _no_add_norm(x, delta, *args, **kwargs):
    return x, delta  # the stream as it was, the delta as the normed input: no kernel


def _no_linear_add_norm(x, weight, bias, residual, *args, **kwargs):
    return residual, ops.linear(x, weight, bias)  # the projection kept, its add + norm left out


def _no_norm(x, weight, *args, **kwargs):
    return x.to(weight.dtype)  # the first layer's fp32 input: one cast kernel


def ablations(target) -> dict[str, list[tuple[object, str, object]]]:
    """The parts of the target's layers an ablation can leave out: label -> the (owner,
    attribute, replacement) patches that leave it out. A left-out module or op returns zeros of
    its output's shape (one memset kernel); a left-out conv returns its input, a left-out
    residual norm its delta (and the stream unchanged)."""
    from dflash_trt.models import qwen3
    from dflash_trt.models.layers import MLP

    kinds = {type(m) for m in target.modules()}
    # every layer's two residual norms (their adds) and the final one; not q/k or gated norms
    parts = {"residual norms": [(ops, "add_rms_norm", _no_add_norm), (ops, "rms_norm", _no_norm),
                                (ops, "linear_add_rms_norm", _no_linear_add_norm)]}
    if SparseMoeBlock in kinds:
        # with SparseMoeBlock.output_norm_in_experts one token's routing, experts and the norm after them
        # are one op (two kernels)
        parts["residual norms"].append((ops, "moe_experts_add_rms_norm", _no_norm_after_experts))
        parts["routed experts"] = [(ops, "moe_experts", _no_experts),
                                   (ops, "moe_experts_add_rms_norm", _no_experts_before_norm)]
    for label, cls in (("MoE blocks", SparseMoeBlock), ("dense MLPs", MLP), ("attention layers", qwen3.Qwen3Attention),
                       ("gated attention layers", qwen3_5.GatedAttention),
                       ("linear attention layers", qwen3_5.GatedDeltaNet)):
        if cls in kinds:
            parts[label] = [(cls, "forward", _zeros_like_input)]
    if kinds & {qwen3.Qwen3Attention, qwen3_5.GatedAttention}:
        parts["attention kernels"] = [(qwen3, "paged_block_attention", _no_attention),
                                      (qwen3_5, "paged_block_attention", _no_attention)]
    if qwen3_5.GatedDeltaNet in kinds:
        # an AR step's delta rule runs in ops.gated_delta_step with its inputs and gated norm
        parts["delta rule kernels"] = [(qwen3_5, "gated_delta_recurrent", _no_delta_rule),
                                       (ops, "gated_delta_step", _no_delta_step)]
        parts["causal convs"] = [(ops, "causal_conv", _no_conv)]
    return parts


def ablate_ar(engine, context: int, reps: int = 100) -> dict[str, float]:
    """AR step ms at batch 1 (a graph replay) in full and with each part of ablations() left
    out, each in a graph captured for it."""
    from unittest import mock

    def ar_ms() -> float:  # its graphs and their pool go when it returns
        passes = GraphedPasses(engine.target, engine.drafter, engine.target_cache, engine.draft_cache, engine.taps,
                               engine.block_size, max_batch_size=1)
        x = passes.inputs(fake_running(engine, 1, context))
        return time_ms(lambda: passes.ar(x), reps)

    times = {"full": ar_ms()}
    for label, patches in ablations(engine.target).items():
        with ExitStack() as stack:
            for patch in patches:
                stack.enter_context(mock.patch.object(*patch))
            times[label] = ar_ms()
        torch.cuda.empty_cache()
    return times


def profiled(fn, steps: int):
    """torch.profiler's record of `steps` calls of fn on the GPU, after one call outside it."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    fn()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    return prof


def profile(fn, steps=5, top=0) -> dict:
    """GPU ms per step by kernel family; with top > 0 also the `top` costliest kernels by
    name, with their calls per step (which GEMM shapes cost what)."""
    prof = profiled(fn, steps)
    per, kernels = defaultdict(float), []
    for event in prof.key_averages():
        if event.device_time_total > 0 and event.device_type.name == "CUDA":
            ms = event.device_time_total / steps / 1e3  # per step
            per[family(event.key)] += ms
            kernels.append(dict(kernel=event.key[:120], ms=ms, calls=event.count / steps))
    out = dict(sorted(per.items(), key=lambda kv: -kv[1]))
    if top:
        out["top_kernels"] = sorted(kernels, key=lambda k: -k["ms"])[:top]
    return out


def kernel_name(name: str) -> str:
    """A kernel's name without its namespace and parameters; its template arguments stay, so two
    tile shapes of one kernel (`gemv_kernel<bf16, 2, 2, false>`, `<bf16, 1, 4, false>`) are two."""
    name = name.removeprefix("void ").replace("(anonymous namespace)::", "")
    depth = 0
    for i, c in enumerate(name):  # the parameters start at the first "(" outside the template arguments
        depth += {"<": 1, ">": -1}.get(c, 0)
        if c == "(" and depth == 0:
            name = name[:i]
            break
    base, _, args = name.strip().partition("<")
    return base.split("::")[-1] + (f"<{args}" if args else "")


def replay_timeline(kernels: list[tuple[str, float, float]], steps: int) -> dict:
    """kernels: (name, start us, end us) of `steps` replays of one graph, in start order ->
    the GPU span per replay (its first start to its last end, averaged over all replays but the
    first) and, per kernel name,
    calls and ms per replay from its start to the next kernel's start in the same replay (a
    replay's last kernel: to its own end, so the host's gap before the next replay counts for
    nobody), and `end_ms`: from the latest end before its end (the replay's first start for
    the first) to its own, the time by which it pushed the replay's end out. With programmatic
    dependents a kernel's duration includes its wait for the one before, so durations add up
    to more than the replay, while both of these add up to its span; a kernel that starts
    early and waits shows in end_ms by what it adds after its wait."""
    per_replay = len(kernels) // steps if steps and len(kernels) % steps == 0 else len(kernels)
    replays = [kernels[i:i + per_replay] for i in range(0, len(kernels), per_replay)] if kernels else []
    # under torch.profiler the first replay's first kernel waits ~1 ms for the next (the profiler
    # starting up): the first replay does not count where there are others
    replays = replays[1:] if len(replays) > 1 else replays
    per = defaultdict(lambda: [0, 0.0, 0.0, 0.0])  # calls, start-to-next-start us, duration us, end us
    for replay in replays:
        latest = replay[0][1]
        for (name, start, end), after in zip(replay, replay[1:] + [None]):
            row = per[kernel_name(name)]
            row[0] += 1
            row[1] += (after[1] if after else end) - start
            row[2] += end - start
            row[3] += max(end - latest, 0.0)
            latest = max(latest, end)
    n = max(len(replays), 1)
    span_us = sum(max(end for _, _, end in r) - r[0][1] for r in replays) / n
    return {"kernels_per_step": per_replay, "gpu_span_ms_per_step": span_us / 1e3,
            "by_kernel": [dict(kernel=name, calls=calls / n, ms=until_next / n / 1e3, end_ms=ends / n / 1e3,
                               mean_us=duration / calls)
                          for name, (calls, until_next, duration, ends) in sorted(per.items(), key=lambda kv: -kv[1][1])]}


def trace_graph_replays(fn, path: str, steps: int = 5) -> dict:
    """A Chrome trace (Perfetto, chrome://tracing) of `steps` calls of fn, a graph replay: each
    kernel's start and end on the GPU, so that what overlaps (programmatic dependents start
    early and wait) and the gaps between kernels can be seen, which per-kernel sums cannot
    show; summed by replay_timeline."""
    prof = profiled(fn, steps)
    prof.export_chrome_trace(path)
    kernels = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
               if e.device_type.name == "CUDA" and e.device_time_total > 0]
    return {"trace": path, **replay_timeline(sorted(kernels, key=lambda k: k[1]), steps)}


def prefill_profile(engine, num_tokens: int, steps: int = 5) -> dict:
    """One request's prefill step of num_tokens at batch 1 (engine.step, first token
    included): wall ms as the engine runs it (a padded graph where one is wide enough) and
    eagerly; for the eager pass, GPU kernel ms and launches, and the host ops that cost the most."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    prompt = [int(t) for t in torch.randint(0, engine.target.config.vocab_size, (num_tokens,))]

    def prefill():
        engine.add_request(prompt, SamplingParams(max_tokens=1, ignore_eos=True))
        engine.step()

    wall = wall_ms(prefill, reps=10)
    graphed = getattr(engine.passes, "prefill_widths", None)
    if graphed is not None:
        engine.passes.prefill_widths = []  # every prefill eager
    try:
        eager_wall = wall_ms(prefill, reps=10)
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                prefill()
            torch.cuda.synchronize()
        by_family = profile(prefill, steps=2)
    finally:
        if graphed is not None:
            engine.passes.prefill_widths = graphed
    events = prof.key_averages()
    kernels = [e for e in events if e.device_type.name == "CUDA" and e.device_time_total > 0]
    host = sorted((e for e in events if e.device_type.name == "CPU"), key=lambda e: -e.self_cpu_time_total)
    return {"wall_ms": wall, "eager_wall_ms": eager_wall, "graphed": bool(graphed) and num_tokens <= max(graphed),
            "gpu_kernel_ms": sum(e.device_time_total for e in kernels) / steps / 1e3,
            "kernel_launches": sum(e.count for e in kernels) / steps, "gpu_ms_by_family": by_family,
            "top_host_ops": [dict(op=e.key[:100], self_ms=e.self_cpu_time_total / steps / 1e3, calls=e.count / steps)
                             for e in host[:15]]}


def burst_profile(engine, prompt_ids: list[list[int]], steps: int = 3) -> dict:
    """The step that admits all these prompts at once (the bench's first step at its
    concurrency): wall ms as the engine runs it (passes of like lengths, engine.prefill_groups),
    and per prefill pass; GPU kernel ms by family, launches, the host ops that cost the most."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from dflash_trt.engine import prefill_groups

    lengths = [len(p) for p in prompt_ids]
    groups = prefill_groups(lengths)
    params = SamplingParams(max_tokens=1, ignore_eos=True)

    def burst(ids=prompt_ids):
        for p in ids:
            engine.add_request(p, params)
        engine.step()

    wall = wall_ms(burst, reps=5)
    passes = []
    for g in groups:
        ids = [prompt_ids[i] for i in g]
        passes.append(dict(prompts=len(g), width=max(lengths[i] for i in g), tokens=sum(lengths[i] for i in g),
                           wall_ms=wall_ms(lambda ids=ids: burst(ids), reps=5)))
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            burst()
        torch.cuda.synchronize()
    events = prof.key_averages()
    kernels = [e for e in events if e.device_type.name == "CUDA" and e.device_time_total > 0]
    host = sorted((e for e in events if e.device_type.name == "CPU"), key=lambda e: -e.self_cpu_time_total)
    return {"prompts": len(prompt_ids), "tokens": sum(lengths), "wall_ms": wall, "passes": passes,
            "gpu_kernel_ms": sum(e.device_time_total for e in kernels) / steps / 1e3,
            "kernel_launches": sum(e.count for e in kernels) / steps,
            "gpu_ms_by_family": profile(burst, steps=2, top=15),
            "top_host_ops": [dict(op=e.key[:100], self_ms=e.self_cpu_time_total / steps / 1e3, calls=e.count / steps)
                             for e in host[:15]]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-8b")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--max-seq-len", type=int,
                    help="the engine's (default: the context or longest prefill + 512); a served engine's is larger, "
                         "and attention's split count in a graph follows the cache's capacity")
    ap.add_argument("--batch", default="1,32")
    ap.add_argument("--json")
    ap.add_argument("--layers", type=int, help="a reduced-depth copy of the preset (one too large for the GPU)")
    ap.add_argument("--draft-window-size", type=int, default=0, help="the drafter sees the last N rows only")
    ap.add_argument("--draft-vocab-size", type=int, default=0,
                    help="the drafter proposes from K tokens only (their choice does not change the time)")
    ap.add_argument("--prefill", default="", help="also profile one prefill of each of these prompt lengths")
    ap.add_argument("--prefill-burst", default="", metavar="DATASET:N",
                    help="also profile the step that admits the first N prompts of DATASET at once (chat template)")
    ap.add_argument("--recurrent-prefill-tokens", type=int,
                    help="hybrids: the widest prefill that runs the recurrent kernel (default: the model's)")
    ap.add_argument("--top-kernels", type=int, default=12, help="how many of each pass's costliest kernels to list")
    ap.add_argument("--profile-batch", type=int, default=1, help="the batch of the per-kernel profiles")
    ap.add_argument("--verify-width", type=int, default=0,
                    help="draft, verify and commit at this width (default: the block; the step walls verify the block)")
    ap.add_argument("--ablate", action="store_true",
                    help="also time the AR step at batch 1 with each kind of layer part left out")
    ap.add_argument("--warm-up", action="store_true",
                    help="run Engine.warm_up first, as serving does: where fa3-fwd is installed, every attention "
                         "shape of the graphs takes the faster backend (without it: our kernel always)")
    ap.add_argument("--trace", metavar="FILE",
                    help="also write a Chrome trace of AR steps at --profile-batch as the graphs replay them")
    ap.add_argument("--blas", choices=("cublas", "cublaslt"),
                    help="the BLAS library torch uses for the GEMMs (default: torch's choice)")
    args = ap.parse_args(argv)
    if args.blas:
        torch.backends.cuda.preferred_blas_library(args.blas)
    batches = [int(b) for b in args.batch.split(",")]
    if args.recurrent_prefill_tokens is not None:
        qwen3_5.RECURRENT_PREFILL_TOKENS = args.recurrent_prefill_tokens
    prefills = [int(t) for t in args.prefill.split(",") if t]
    burst_dataset, _, burst_n = args.prefill_burst.partition(":")
    burst_n = int(burst_n or 32) if burst_dataset else 0
    loaded = random_engine(args.preset, max_batch_size=max(*batches, burst_n),
                           max_seq_len=args.max_seq_len or max([args.context, *prefills]) + 512,
                           num_layers=args.layers, draft_window=args.draft_window_size)
    engine, passes = loaded.engine, loaded.engine.passes
    if args.draft_vocab_size:  # before the first pass: graphs are captured on first use
        engine.drafter.prune_vocab(torch.arange(args.draft_vocab_size))
    if args.warm_up:
        engine.warm_up()
    eager = DecodePasses(engine.target, engine.drafter, engine.target_cache, engine.draft_cache, engine.taps,
                         engine.block_size)
    result = {"gpu": torch.cuda.get_device_name(), "preset": args.preset,
              "fa3_shapes": sorted([s.rows, s.tokens, s.causal] for s in fa3.chosen()),
              "recurrent_prefill_tokens": qwen3_5.RECURRENT_PREFILL_TOKENS, "layers": args.layers, "context": args.context,
              "max_seq_len": engine.max_seq_len,
              "passes": type(passes).__name__, "blas": str(torch.backends.cuda.preferred_blas_library()),
              "draft_window": engine.draft_window, "draft_vocab_size": args.draft_vocab_size,
              "draft_cache_gb": cache_bytes(engine.draft_cache) / 1e9, "target_cache_gb": cache_bytes(engine.target_cache) / 1e9}
    bw = copy_bandwidth()
    wb = weight_bytes(engine.target)
    result.update(copy_bandwidth_gb_s=bw / 1e9, target_weight_gb=wb / 1e9,
                  drafter_weight_gb=weight_bytes(engine.drafter) / 1e9)
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s; target weights {wb / 1e9:.2f} GB", file=sys.stderr)
    width = args.verify_width or engine.block_size
    result["verify_width"] = width
    with torch.inference_mode():
        for n in batches:
            x = passes.inputs(fake_running(engine, n, args.context))
            ar = time_ms(lambda: passes.ar(x))
            dr = time_ms(lambda: passes.draft(x, width))
            # a draft proposes for its step's verify width only (its LM head's rows)
            draft_by_width = {w: time_ms(lambda w=w: passes.draft(x, w)) for w in candidate_widths(engine.block_size)}
            block = random_block(passes.draft(x, width), engine.target.config.vocab_size)
            ve = time_ms(lambda: passes.verify(x, block, width))
            ar_wall, ar_serial = (step_wall_ms(engine, fake_running(engine, n, args.context), "ar", overlap)
                                  for overlap in (True, False))
            row = {"ar_step_ms": ar, "draft_ms": dr, "verify_ms": ve, "ar_tok_s": n * 1e3 / ar,
                   "draft_ms_by_width": draft_by_width, "dflash_step_over_ar": (dr + ve) / ar, "ar_step_wall_ms": ar_wall,
                   "ar_step_wall_serial_ms": ar_serial, "ar_host_gap_ms": ar_wall - ar,
                   "ar_host_gap_serial_ms": ar_serial - ar}
            # counted on eager passes of their own inputs (python hooks do not run in graph replays)
            xe = eager.inputs(fake_running(engine, n, args.context))
            ar_bytes, ar_experts = step_bytes(engine, lambda: eager.ar(xe), n)
            eager_block = random_block(eager.draft(xe, width), engine.target.config.vocab_size)  # the graphs' is padded
            verify_bytes, verify_experts = step_bytes(engine, lambda: eager.verify(xe, eager_block, width), n * width)
            row.update(ar_bytes_gb=ar_bytes / 1e9, ar_roofline_share=ar_bytes / bw / (ar / 1e3),
                       verify_bytes_gb=verify_bytes / 1e9, verify_roofline_share=verify_bytes / bw / (ve / 1e3))
            if engine.target.config.moe is not None:
                row.update(ar_distinct_experts=ar_experts, verify_distinct_experts=verify_experts)
            if engine.target.stateful:  # the rollback after a verify that kept half its tokens
                half = [width // 2] * n
                row["commit_ms"] = time_ms(lambda: passes.commit(x, width, half))
            # A whole DFlash step as the engine runs it (draft, verify, the readback, emitting,
            # commit), with the next draft launched before the readback and serially: what it
            # costs beyond its passes' GPU time is the host gap. The walls verify the whole
            # block, so at another --verify-width the passes timed above are not theirs: no gap.
            for key, overlap in (("", True), ("_serial", False)):
                wall = step_wall_ms(engine, fake_running(engine, n, args.context), "dflash", overlap)
                row[f"dflash_step_wall{key}_ms"] = wall
                row[f"dflash_host_gap{key}_ms"] = (wall - dr - ve - row.get("commit_ms", 0.0)
                                                   if width == engine.block_size else None)
            result[f"batch{n}"] = row
            print(f"batch {n}: AR step {ar:.3f} ms ({n * 1e3 / ar:.1f} tok/s; {ar_wall:.3f} ms with the host work "
                  f"overlapped, {ar_serial:.3f} serially), "
                  f"draft {dr:.3f} ms (for verify widths "
                  + ", ".join(f"{w}: {ms:.3f}" for w, ms in draft_by_width.items())
                  + f"), verify {ve:.3f} ms, (draft+verify)/AR {(dr + ve) / ar:.2f}; "
                  f"roofline share AR {row['ar_roofline_share']:.1%}, verify {row['verify_roofline_share']:.1%}"
                  + (f"; distinct experts per layer AR {ar_experts:.1f}, verify {verify_experts:.1f}"
                     if "ar_distinct_experts" in row else "")
                  + (f", commit {row['commit_ms']:.3f} ms" if "commit_ms" in row else "")
                  + f"; DFlash step {row['dflash_step_wall_ms']:.3f} ms wall (the whole block)"
                  + (f", host gap {row['dflash_host_gap_ms']:.3f} ms ({row['dflash_host_gap_serial_ms']:.3f} serially)"
                     if row["dflash_host_gap_ms"] is not None else ""),
                  file=sys.stderr)
        # Kernel time per family from the eager passes (the same kernels the graphs replay;
        # the graphs remove the launch gaps between them).
        x = passes.inputs(fake_running(engine, args.profile_batch, args.context))
        result["profile_batch"] = args.profile_batch
        result["profile_ar_ms"] = profile(lambda: DecodePasses.ar(passes, x), top=args.top_kernels)
        block = random_block(DecodePasses.draft(passes, x, width), engine.target.config.vocab_size)
        result["profile_draft_ms"] = profile(lambda: DecodePasses.draft(passes, x, width), top=args.top_kernels)
        result["profile_verify_ms"] = profile(lambda: DecodePasses.verify(passes, x, block, width), top=args.top_kernels)
        if engine.target.stateful:  # the rollback keeping half the verified tokens, as commit_ms times it
            half = [width // 2] * args.profile_batch
            result["profile_commit_ms"] = profile(lambda: DecodePasses.commit(passes, x, width, half),
                                                  top=args.top_kernels)
        if args.trace:
            result["trace_ar"] = row = trace_graph_replays(lambda: passes.ar(x), args.trace)
            print(f"trace of the AR step: {args.trace} ({row['kernels_per_step']:.0f} kernels, "
                  f"{row['gpu_span_ms_per_step']:.3f} ms a step from first start to last end); ms a step from a "
                  "kernel's start to the next one's, calls, mean duration in us:", file=sys.stderr)
            for k in row["by_kernel"][:args.top_kernels or 12]:
                print(f"  {k['ms']:7.3f} {k['calls']:5.0f} {k['mean_us']:7.2f}  {k['kernel'][:90]}", file=sys.stderr)
        if args.ablate:
            result["ablate_ar_batch1_ms"] = times = ablate_ar(engine, args.context)
            print("AR step at batch 1: " + ", ".join(
                f"{label} {ms:.3f} ms" if label == "full"
                else f"without the {label} {ms:.3f} ms ({times['full'] - ms:.3f} less)"
                for label, ms in times.items()), file=sys.stderr)
        for n in prefills:
            result[f"prefill{n}"] = row = prefill_profile(engine, n)
            print(f"prefill of {n} tokens: {row['wall_ms']:.2f} ms wall ({'graphed' if row['graphed'] else 'eager'}), "
                  f"eagerly {row['eager_wall_ms']:.2f} ms wall, {row['gpu_kernel_ms']:.2f} ms of kernels "
                  f"({row['kernel_launches']:.0f} launches)", file=sys.stderr)
        if burst_dataset:
            ids = encode_prompts(loaded.tokenizer, load_prompts(burst_dataset, burst_n))
            result["prefill_burst"] = row = burst_profile(engine, ids)
            print(f"burst of {row['prompts']} {burst_dataset} prompts ({row['tokens']} tokens): "
                  f"{row['wall_ms']:.2f} ms wall, passes {row['passes']}, {row['gpu_kernel_ms']:.2f} ms of kernels "
                  f"({row['kernel_launches']:.0f} launches)", file=sys.stderr)
    if 1 in batches:  # AR at batch 1: the bytes one token's step really reads, at copy bandwidth
        result["roofline_tok_s"] = bw / (result["batch1"]["ar_bytes_gb"] * 1e9)
        result["batch1_roofline_share"] = result["batch1"]["ar_roofline_share"]
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
