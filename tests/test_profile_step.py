"""bench/profile_step.py --ablate: each ablation really leaves its part out of the AR step. A
patch of a name the models no longer look up would leave the step unchanged and report a cost
of zero for that part; here every ablation must change a tiny model's AR output (CPU, fp32)."""

import importlib.util
from contextlib import ExitStack
from pathlib import Path
from unittest import mock

import pytest
import torch

from dflash_trt import ops
from dflash_trt.benchmark import random_weights as rw
from dflash_trt.graphs import DecodePasses
from dflash_trt.models.moe import SparseMoeBlock

spec = importlib.util.spec_from_file_location("profile_step", Path(__file__).parents[1] / "bench" / "profile_step.py")
profile_step = importlib.util.module_from_spec(spec)
spec.loader.exec_module(profile_step)

TINY = {
    "moe hybrid": (rw._qwen3_5_moe((1, 2), hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4,
                                   linear_heads=(2, 4), num_experts=8, experts_per_tok=2, moe_intermediate_size=32,
                                   shared_expert_size=32),
                   {"routed experts", "MoE blocks", "gated attention layers", "linear attention layers",
                    "attention kernels", "delta rule kernels", "causal convs", "residual norms"}),
    "qwen3": (rw.TinyPairSpec(hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
                              head_dim=16, target_layer_ids=(1, 2)),
              {"dense MLPs", "attention layers", "attention kernels", "residual norms"}),
}


def repeatable_ar_step(engine):
    """One eager AR step at batch 1 over 16 rows of noise -> (logits, token), each call from the
    same caches: a step writes them in place (a hybrid's state and conv window move on)."""
    passes = DecodePasses(engine.target, engine.drafter, engine.target_cache, engine.draft_cache, engine.taps,
                          engine.block_size)
    x = passes.inputs(profile_step.fake_running(engine, 1, 16))
    cache = engine.target_cache
    saved = {k: v.clone() for k, v in vars(cache).items() if isinstance(v, torch.Tensor)}

    def ar_step() -> tuple[torch.Tensor, torch.Tensor]:
        for k, v in saved.items():
            getattr(cache, k).copy_(v)
        logits, token = passes.ar(x)
        return logits.clone(), token.clone()

    return ar_step


def experts_and_norm_as_one_kernel(x, gate_up, down, logits, top_k, renormalize, shared, residual, norm_weight, eps,
                                   zero_centered=False, ticket=None):
    """ops.moe_experts_add_rms_norm as the GPU runs it: one launch pair that calls no other op,
    so an ablation that patches only moe_experts or add_rms_norm leaves it whole (on the CPU the
    op falls back to the three ops)."""
    weights, ids = ops.moe_route_reference(logits, top_k, renormalize, shared)
    out = ops.moe_experts_reference(x, gate_up, down, weights, ids, x.dtype).reshape(residual.shape)
    return ops.add_rms_norm_reference(residual, out, norm_weight, eps, zero_centered)


@pytest.mark.parametrize("name, experts_norm", [(name, False) for name in TINY] + [("moe hybrid", True)],
                         ids=[*TINY, "moe hybrid, the norm after the experts in their kernel"])
def test_every_ablation_changes_the_ar_step(monkeypatch, name, experts_norm):
    spec, parts = TINY[name]
    monkeypatch.setitem(rw.PRESETS, "tiny", spec)
    monkeypatch.setattr(SparseMoeBlock, "output_norm_in_experts", experts_norm)
    if experts_norm:
        monkeypatch.setattr(ops, "moe_experts_add_rms_norm", experts_and_norm_as_one_kernel)
    engine = rw.random_engine("tiny", device="cpu", dtype=torch.float32, max_batch_size=1, max_seq_len=128).engine
    step = repeatable_ar_step(engine)

    def ar_step() -> torch.Tensor:
        return step()[0]

    full = ar_step()
    assert torch.equal(ar_step(), full)  # the restore is whole
    ablations = profile_step.ablations(engine.target)
    assert set(ablations) == parts
    for label, patches in ablations.items():
        with ExitStack() as stack:
            for patch in patches:
                stack.enter_context(mock.patch.object(*patch))
            assert not torch.equal(ar_step(), full), label
        assert torch.equal(ar_step(), full), f"{label}: the patch outlived its ablation"


@pytest.mark.parametrize("name, short", [
    ("void dflash::(anonymous namespace)::gemv_kernel<__nv_bfloat16, 2, 2, false>(dflash::GemvParams)",
     "gemv_kernel<__nv_bfloat16, 2, 2, false>"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::ArgMaxOps<float>, unsigned int, "
     "long, 4> >(at::native::ReduceOp<float, at::native::ArgMaxOps<float>, unsigned int, long, 4>)",
     "reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::ArgMaxOps<float>, unsigned int, long, 4> >"),
    ("Memcpy DtoD (Device -> Device)", "Memcpy DtoD"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64",) * 2,
])
def test_a_traced_kernel_is_named_by_its_function_and_template_arguments(name, short):
    """--trace groups kernels by these names: two tile shapes of one kernel stay apart, and a
    parameter list (or the anonymous namespace's parentheses) never cuts the name short."""
    assert profile_step.kernel_name(name) == short


def test_a_replays_timeline_adds_up_to_its_span_and_leaves_the_gaps_between_replays_out():
    """Three replays of [a, b, c] where b starts (as a programmatic dependent) before a ends,
    with host gaps between the replays: each kernel holds the stream from its start to the
    next one's, c to its own end; by ends, each from the end before it to its own. The first replay, whose b the profiler's start-up delays
    here, does not count."""
    replay = [("void ns::a<1>(P)", 0.0, 10.0), ("void ns::b(P)", 4.0, 20.0), ("void ns::c(P)", 20.0, 23.0)]
    first = [replay[0]] + [(name, start + 1000.0, end + 1000.0) for name, start, end in replay[1:]]
    kernels = first + [(name, start + offset, end + offset)
                       for offset in (1100.0, 1200.0) for name, start, end in replay]
    timeline = profile_step.replay_timeline(kernels, steps=3)
    rows = {k["kernel"]: k for k in timeline["by_kernel"]}
    assert timeline["kernels_per_step"] == 3 and timeline["gpu_span_ms_per_step"] == pytest.approx(0.023)
    assert {name: rows[name]["ms"] * 1e3 for name in rows} == pytest.approx({"a<1>": 4.0, "b": 16.0, "c": 3.0})
    assert sum(k["ms"] for k in timeline["by_kernel"]) == pytest.approx(timeline["gpu_span_ms_per_step"])
    # by their ends: a to its end, b from a's end to its own, c likewise
    assert {name: rows[name]["end_ms"] * 1e3 for name in rows} == pytest.approx({"a<1>": 10.0, "b": 10.0, "c": 3.0})
    assert rows["b"]["mean_us"] == pytest.approx(16.0) and rows["a<1>"]["calls"] == 1
