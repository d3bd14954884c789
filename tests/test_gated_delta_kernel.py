"""The gated delta rule of decode/verify passes on the cache in place (ops.gated_delta_recurrent,
plugins/gated_delta.cu): the reference equals the unfused gather / reference / scatter path
bit for bit (CPU), the wrapper rejects bad input naming it, and the CUDA kernel agrees with the
reference over a table of shapes, in a CUDA graph too (cuda marker)."""

import pytest
import torch
import torch.nn.functional as F
from host_program import run_host_program

from dflash_trt import ops, plugins
from dflash_trt.models.gated_delta import L2_EPS, gated_delta_rule, l2_normalize
from dflash_trt.ops import (
    gated_delta_kernel_supports,
    gated_delta_prepare,
    gated_delta_prepare_reference,
    gated_delta_recurrent,
    gated_delta_recurrent_reference,
    gated_delta_rule_reference,
)


def make_case(bs, T, Hk, Hv, dk, dv, NS, num_tokens, start, slots=None, num_slots=None, device="cpu", seed=0):
    """Kwargs of gated_delta_recurrent: random normalised q/k, decays from very fast to almost
    none, and caches full of garbage (a fresh row must ignore its slot's state, and the
    snapshots a row does not reach must keep theirs)."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    num_slots = num_slots or bs + 3
    if slots is None:
        slots = torch.randperm(num_slots, generator=gen)[:bs].tolist()
    case = dict(q=l2_normalize(r(bs, T, Hk, dk)) * dk**-0.5, k=l2_normalize(r(bs, T, Hk, dk)), v=r(bs, T, Hv, dv),
                g=-F.softplus(2 * r(bs, T, Hv)), beta=torch.sigmoid(r(bs, T, Hv)),
                state_cache=r(num_slots, Hv, dk, dv), snapshot_cache=r(num_slots, NS, Hv, dk, dv))
    case = {name: t.to(device) for name, t in case.items()}
    for name, values in (("slots", slots), ("start", start), ("num_tokens", num_tokens)):
        case[name] = torch.tensor(values, dtype=torch.int32, device=device)
    return case


def reached(case):
    """[num_slots, NS] bool: the snapshots a pass writes (j = t + NS - num_tokens, t < num_tokens)."""
    NS, T = case["snapshot_cache"].shape[1], case["q"].shape[1]
    mask = torch.zeros(case["snapshot_cache"].shape[:2], dtype=torch.bool, device=case["q"].device)
    for slot, n in zip(case["slots"].tolist(), case["num_tokens"].tolist()):
        for t in range(min(n, T)):
            if t + NS - n >= 0:
                mask[slot, t + NS - n] = True
    return mask


def old_path(case):
    """The unfused path the op replaces: gather, reference, scatter all NS."""
    slots = case["slots"].long()
    fresh = (case["start"] == 0)[:, None, None, None]
    state = case["state_cache"][slots].masked_fill(fresh, 0)
    NS = case["snapshot_cache"].shape[1]
    out, snapshots = gated_delta_rule_reference(case["q"], case["k"], case["v"], case["g"], case["beta"], state,
                                                case["num_tokens"].long(), NS)
    cache = case["snapshot_cache"].clone()
    cache[slots] = snapshots
    return out, cache


# (bs, T, Hk, Hv, dk, dv, NS, num_tokens, start)
CPU_CASES = {
    "decode T=1": (3, 1, 2, 4, 16, 16, 4, [1, 1, 1], [5, 0, 9]),
    "verify ragged, one fresh": (4, 4, 1, 2, 16, 32, 4, [4, 1, 3, 0], [7, 0, 2, 1]),
    "more tokens than snapshots": (3, 9, 2, 2, 32, 16, 4, [9, 5, 2], [0, 3, 3]),
    "one snapshot": (2, 3, 1, 1, 16, 16, 1, [3, 2], [1, 0]),
    "no snapshots (a verify pass)": (2, 3, 1, 2, 16, 16, 0, [3, 2], [1, 0]),
}


@pytest.mark.parametrize("shape", CPU_CASES.values(), ids=CPU_CASES.keys())
def test_reference_equals_the_gather_reference_scatter_path(shape):
    case = make_case(*shape)
    before, state_before = case["snapshot_cache"].clone(), case["state_cache"].clone()
    out_old, cache_old = old_path(case)
    out = gated_delta_recurrent(**case)  # CPU: the reference
    T = case["q"].shape[1]
    real = torch.arange(T) < case["num_tokens"][:, None]  # [bs, T]
    assert out.dtype == torch.float32 and out.shape == case["v"].shape
    assert torch.equal(out[real], out_old[real]) and not out[~real].any()  # padding outputs zeros
    mask = reached(case)
    assert torch.equal(case["snapshot_cache"][mask], cache_old[mask])
    assert torch.equal(case["snapshot_cache"][~mask], before[~mask])  # the rest is left as it was
    assert torch.equal(case["state_cache"], state_before)  # read only


def test_reference_output_in_the_model_dtype_is_the_fp32_output_rounded():
    case = make_case(*CPU_CASES["verify ragged, one fresh"], seed=1)
    fp32 = gated_delta_recurrent_reference(**{**case, "snapshot_cache": case["snapshot_cache"].clone()})
    out = gated_delta_recurrent_reference(**case, out_dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16 and torch.equal(out, fp32.to(torch.bfloat16))


def test_a_fresh_row_ignores_what_its_slot_held():
    shape = (2, 3, 1, 2, 16, 16, 4, [3, 2], [0, 0])
    a, b = make_case(*shape, seed=1), make_case(*shape, seed=1)
    b["state_cache"].normal_()  # another earlier occupant
    torch.testing.assert_close(gated_delta_recurrent(**a), gated_delta_recurrent(**b), rtol=0, atol=0)
    torch.testing.assert_close(a["snapshot_cache"], b["snapshot_cache"], rtol=0, atol=0)


def packed_projection(bs, T, Hk, Hv, dk, dv, dtype=torch.bfloat16, device="cpu", seed=5):
    """What GatedDeltaNet.forward hands gated_delta_prepare: qkv after the conv, and a, b as
    views of the packed projection (rows 2 Hv + 3 elements apart), with weight-like constants."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(bs, T, 2 * Hk * dk + Hv * dv, generator=gen).to(dtype)
    packed = (2 * torch.randn(bs, T, 2 * Hv + 3, generator=gen)).to(dtype)
    neg_a = -torch.empty(Hv).uniform_(0.5, 8.0, generator=gen)
    dt_bias = 1.0 + 0.1 * torch.randn(Hv, generator=gen)
    return dict(qkv=qkv.to(device), a=packed[..., 3: 3 + Hv].to(device), b=packed[..., 3 + Hv:].to(device),
                neg_a=neg_a.to(device), dt_bias=dt_bias.to(device), num_k_heads=Hk, key_dim=dk, value_dim=dv,
                eps=L2_EPS, q_scale=dk**-0.5)


def test_prepare_reference_is_what_the_layer_computed_before_the_kernel():
    case = packed_projection(2, 3, 2, 4, 16, 32)
    Hk, dk = 2, 16
    q, k, v = case["qkv"].split([Hk * dk, Hk * dk, 4 * 32], dim=-1)
    got = gated_delta_prepare(**case)
    expected = ((l2_normalize(q.unflatten(-1, (Hk, dk)).float()) * dk**-0.5),
                l2_normalize(k.unflatten(-1, (Hk, dk)).float()), v.unflatten(-1, (4, 32)).float(),
                case["neg_a"] * F.softplus(case["a"].float() + case["dt_bias"]), case["b"].float().sigmoid())
    for name, x, y in zip("q k v g beta".split(), got, expected):
        assert x.dtype == torch.float32 and x.is_contiguous() and torch.equal(x, y), name


def test_the_model_entry_point_equals_the_gated_delta_rule_on_a_gathered_state():
    """The op on gated_delta_prepare's inputs against gated_delta_rule on raw q/k (the path the
    model takes for prefills): CPU bit for bit."""
    bs, T, Hk, Hv, dk, dv, S = 3, 4, 2, 4, 16, 32, 4
    case = make_case(bs, T, Hk, Hv, dk, dv, S, [4, 2, 1], [3, 0, 8])
    proj = packed_projection(bs, T, Hk, Hv, dk, dv)
    inputs = gated_delta_prepare(**proj)
    q, k, v = proj["qkv"].split([Hk * dk, Hk * dk, Hv * dv], dim=-1)
    q, k, v = q.unflatten(-1, (Hk, dk)), k.unflatten(-1, (Hk, dk)), v.unflatten(-1, (Hv, dv))
    slots = case["slots"].long()
    state = case["state_cache"][slots].masked_fill((case["start"] == 0)[:, None, None, None], 0)
    out_old, snapshots = gated_delta_rule(q, k, v, inputs[3], inputs[4], state, case["num_tokens"].long(), S)
    out = gated_delta_recurrent(*inputs, case["state_cache"], case["snapshot_cache"], case["slots"], case["start"],
                                case["num_tokens"])
    real = torch.arange(T) < case["num_tokens"][:, None]
    assert torch.equal(out.bfloat16()[real], out_old[real])
    for row, n in enumerate(case["num_tokens"].tolist()):
        kept = min(S, n)
        assert torch.equal(case["snapshot_cache"][slots[row], S - kept:], snapshots[row, S - kept:])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_replaying_the_kept_tokens_in_place_gives_the_snapshot_of_that_prefix(device):
    """Commit's replay (models/qwen3_5.py): a pass that writes nothing, then NS = 1 in place
    over the first n tokens, leaves each slot the state a snapshot pass recorded after n
    tokens: bit for bit, since both run the same token loop. (The pass that writes nothing
    may take the outputs-only kernel on CUDA: its outputs agree to rounding.)"""
    bs, T, Hk, Hv, dk, dv = 4, 16, 2, 4, 32, 32
    kept = [16, 1, 7, 3]
    snap = make_case(bs, T, Hk, Hv, dk, dv, T, [T] * bs, [3, 0, 9, 1], device=device)
    state = snap["state_cache"].clone()
    replay = {**snap, "state_cache": state, "snapshot_cache": state.new_zeros((state.shape[0], 0, Hv, dk, dv))}
    out_snap = gated_delta_recurrent(**snap)
    before = state.clone()
    out = gated_delta_recurrent(**replay)
    assert torch.equal(state, before)  # the pass wrote nothing
    check_close(out, out_snap, "outputs")
    gated_delta_recurrent(**{**replay, "snapshot_cache": state.unsqueeze(1),
                             "num_tokens": torch.tensor(kept, dtype=torch.int32, device=device)})
    for row, (slot, n) in enumerate(zip(snap["slots"].tolist(), kept)):
        assert torch.equal(state[slot], snap["snapshot_cache"][slot, T - 1 - (T - n)]), row


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("dk", [32, 128])
def test_a_replay_without_outputs_leaves_the_state_a_replay_with_them_leaves(device, dk):
    """Commit asks for no outputs (models/qwen3_5.py): the kernel then skips q and the
    outputs' arithmetic, and the state is the same bit for bit (the same k-side sums)."""
    kept = [16, 1, 0, 9, 3, 12]
    case = make_case(6, 16, 2, 4, dk, 32, 1, kept, [3, 0, 9, 1, 0, 4], device=device)
    with_out = {**case, "state_cache": case["state_cache"].clone()}
    with_out["snapshot_cache"] = with_out["state_cache"].unsqueeze(1)
    case["snapshot_cache"] = case["state_cache"].unsqueeze(1)
    assert gated_delta_recurrent(**with_out).shape == (6, 16, 4, 32)
    assert gated_delta_recurrent(**case, outputs=False) is None
    assert torch.equal(case["state_cache"], with_out["state_cache"])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_a_row_without_tokens_writes_nothing_even_on_a_slot_another_row_writes(device):
    """Commit's replay over every layer at once gives rows it does not use no tokens; they
    may share a slot with a row that writes it, which must keep that row's write."""
    case = make_case(3, 4, 2, 4, 32, 32, 1, [3, 0, 0], [5, 2, 0], slots=[1, 1, 4], num_slots=5, device=device)
    alone = make_case(1, 4, 2, 4, 32, 32, 1, [3], [5], slots=[1], num_slots=5, device=device)
    for name in ("q", "k", "v", "g", "beta"):
        alone[name] = case[name][:1].contiguous()
    alone["state_cache"], alone["snapshot_cache"] = case["state_cache"].clone(), case["snapshot_cache"].clone()
    untouched = case["snapshot_cache"][[0, 2, 3, 4]].clone()
    gated_delta_recurrent(**case)
    gated_delta_recurrent(**alone)
    assert torch.equal(case["snapshot_cache"], alone["snapshot_cache"])
    assert torch.equal(case["snapshot_cache"][[0, 2, 3, 4]], untouched)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_prepare_into_given_buffers_writes_what_it_returns_otherwise(device):
    """A verify writes its inputs where commit replays them from (a layer's block of
    HybridCache's replay buffers): the same values as fresh outputs, bit for bit, nothing
    written outside the buffers."""
    case = packed_projection(3, 5, 2, 4, 16, 32, device=device)
    fresh = gated_delta_prepare(**case)
    store = [torch.full((2, *x.shape), float("nan"), device=device) for x in fresh]  # two layers' blocks
    got = gated_delta_prepare(**case, out=[t[1] for t in store])
    for name, x, y, t in zip("q k v g beta".split(), fresh, got, store):
        assert y.data_ptr() == t[1].data_ptr() and torch.equal(x, y), name
        assert t[0].isnan().all(), name
    wrong = [t[1] for t in store]
    wrong[2] = wrong[2][:, :4]  # not v's shape
    with pytest.raises(AssertionError, match="out v must be contiguous fp32"):
        gated_delta_prepare(**case, out=wrong)


def test_prepare_rejects_bad_arguments_naming_them():
    ok = packed_projection(2, 3, 2, 4, 16, 32)
    for changes, message in (({"qkv": ok["qkv"][..., 1:]}, "qkv must be"),
                             ({"a": ok["a"].float()}, "a must be"),
                             ({"b": ok["b"][:, :2]}, "b must be"),
                             ({"neg_a": ok["neg_a"][:2]}, "qkv must be"),
                             ({"dt_bias": ok["dt_bias"].double()}, "dt_bias must be")):
        with pytest.raises(AssertionError, match=message):
            gated_delta_prepare(**{**ok, **changes})


# (bs, T, Hk, Hv, dk, dv)
PREPARE_CASES = {"qwen3.5-9b decode": (1, 1, 16, 32, 128, 128), "qwen3.5-9b verify": (8, 16, 16, 32, 128, 128),
                 "tiny": (3, 5, 2, 4, 16, 16), "dk=256, odd": (2, 3, 1, 3, 256, 48), "dk=40": (2, 2, 2, 2, 40, 16)}


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("shape", PREPARE_CASES.values(), ids=PREPARE_CASES.keys())
def test_cuda_prepare_kernel_matches_the_reference(shape, dtype):
    assert plugins.load() is not None
    case = packed_projection(*shape, dtype=dtype, device="cuda")
    got = torch.ops.dflash.gated_delta_prepare(*case.values())
    ref = gated_delta_prepare_reference(**case)
    # v is a conversion (exact); q and k differ only by the order of the sums over dk, and the
    # gates use the same libm calls as torch's kernels: a few fp32 ulps at most
    tolerance = {"q": 4e-7, "k": 4e-7, "v": 0.0, "g": 1e-6, "beta": 1e-6}
    for (name, tol), x, y in zip(tolerance.items(), got, ref):
        assert x.shape == y.shape and x.dtype == torch.float32 and x.is_contiguous(), name
        torch.testing.assert_close(x, y, rtol=tol, atol=tol, msg=name)
    # the wrapper takes the kernel for the model's views of the packed projection
    for x, y in zip(gated_delta_prepare(**case), got):
        assert torch.equal(x, y)


def bad_calls():
    ok = make_case(2, 3, 1, 2, 16, 32, 4, [3, 1], [0, 2])

    def call(**changes):
        return lambda: gated_delta_recurrent(**{**ok, **changes})

    return {
        "q 3-D": ("q must be", call(q=ok["q"][0])),
        "k shape": ("k must be", call(k=ok["k"][:, :2])),
        "Hv not a multiple of Hk": ("v must be", call(q=torch.randn(2, 3, 3, 16), k=torch.randn(2, 3, 3, 16))),
        "v dtype": ("v must be fp32", call(v=ok["v"].bfloat16())),
        "g shape": ("g must be", call(g=ok["g"][..., :1])),
        "beta dtype": ("beta must be fp32", call(beta=ok["beta"].double())),
        "state_cache heads": ("state_cache must be", call(state_cache=ok["state_cache"][:, :1])),
        "state_cache slots": ("state_cache must be", call(state_cache=ok["state_cache"][:2])),
        "snapshot_cache 4-D": ("snapshot_cache must be", call(snapshot_cache=ok["snapshot_cache"][:, 0])),
        "snapshot_cache strided": ("snapshot_cache must be contiguous",
                                   call(snapshot_cache=torch.randn(5, 4, 2, 32, 16).transpose(-1, -2))),
        "q strided": ("q must be contiguous", call(q=torch.randn(2, 3, 1, 32)[..., ::2])),
        "slots int64": ("slots must be", call(slots=ok["slots"].long())),
        "start size": ("start must be", call(start=ok["start"][:1])),
        "num_tokens dtype": ("num_tokens must be", call(num_tokens=ok["num_tokens"].float())),
        "no value heads": ("v must be", call(v=ok["v"][:, :, :0])),
        "no slots": ("the caches must hold slots", call(state_cache=ok["state_cache"][:0],
                                                         snapshot_cache=ok["snapshot_cache"][:0])),
    }


@pytest.mark.parametrize("case", bad_calls().values(), ids=bad_calls().keys())
def test_wrapper_rejects_bad_arguments_naming_them(case):
    message, call = case
    with pytest.raises(AssertionError, match=message):
        call()


SUPPORTS_PROGRAM = r"""
#include <cstdio>
#include "gated_delta.h"
int main() {
  for (int d = 0; d <= 300; ++d) std::printf("%d %d %d\n", d, dflash::gated_delta_supports(d, 16),
                                             dflash::gated_delta_supports(16, d));
}
"""


def test_kernel_supports_matches_the_header(tmp_path):
    """ops.gated_delta_kernel_supports against dflash::gated_delta_supports (host program, no GPU)."""
    out = run_host_program(tmp_path, SUPPORTS_PROGRAM).split("\n")
    for line in filter(None, out):
        d, as_key, as_value = map(int, line.split())
        assert bool(as_key) == gated_delta_kernel_supports(d, 16), d
        assert bool(as_value) == gated_delta_kernel_supports(16, d), d


def test_the_kernel_is_part_of_the_plugin_library():
    # The nvcc compile check (tests/test_ops.py) covers every plugins/*.cu, this one included.
    assert "gated_delta.cu" in plugins.SOURCES and (plugins.plugin_dir() / "gated_delta.cu").is_file()


# ----------------------------------------------------------------------------------------------
# CUDA kernel against the reference, both on CUDA tensors. Both compute in fp32 with the same
# algebra in another order (the kernel sums over dk in 8 strided partials and a butterfly, and
# takes out = a S^T q + delta (k . q) from the old state). A CPU emulation of the kernel's order
# (dk = dv = 128, 33 tokens, decays from fast to almost none) stayed within 2.2e-7 of the
# reference, relative to the largest value; the recurrence does not amplify rounding (decay
# <= 1, and I - beta k k^T with |k| = 1 is a contraction). 1e-5 of the largest value leaves
# about 45x margin, while a wrong index, token or slot errs by the values' own size (order 1).

TOLERANCE = 1e-5

# (bs, T, Hk, Hv, dk, dv, NS, num_tokens, start); every case has fresh rows (start 0) whose
# slots hold garbage, and snapshot caches full of garbage.
CUDA_CASES = {
    "qwen decode T=1 (2-warp CTAs)": (3, 1, 16, 32, 128, 128, 16, [1, 1, 1], [0, 17, 400]),
    "qwen verify T=16 ragged": (4, 16, 16, 32, 128, 128, 16, [16, 1, 7, 0], [3, 0, 90, 5]),
    "qwen verify batch 8 (4-warp CTAs)": (8, 16, 16, 32, 128, 128, 16, [16, 16, 3, 16, 1, 16, 9, 16],
                                          [0, 1, 2, 3, 0, 5, 6, 7]),
    "T=2 NS=1 MHA": (3, 2, 2, 2, 16, 32, 1, [2, 1, 2], [0, 4, 4]),
    "T=2 NS=4 GQA": (3, 2, 1, 2, 32, 16, 4, [2, 1, 0], [1, 0, 3]),
    "T=16 NS=4": (3, 16, 2, 4, 32, 32, 4, [16, 3, 1], [0, 2, 2]),
    "T=33 NS=16 (three chunks)": (3, 33, 1, 2, 32, 16, 16, [33, 17, 5], [2, 0, 1]),
    "T=33 NS=4 dk=128": (2, 33, 2, 2, 128, 16, 4, [33, 20], [6, 0]),
    "dk=16 dv=128": (2, 16, 2, 4, 16, 128, 16, [16, 10], [0, 8]),
    "dk=128 dv=16": (2, 16, 2, 4, 128, 16, 16, [16, 10], [8, 0]),
    "dk=48 dv=80 (partial rows)": (2, 5, 1, 2, 48, 80, 4, [5, 2], [0, 1]),
    "dk=dv=256": (2, 4, 1, 2, 256, 256, 4, [4, 3], [1, 0]),
    "dk=256 dv=64 T=17": (1, 17, 1, 1, 256, 64, 16, [17], [3]),
    # NS = 0 up to 16 tokens runs the outputs-only kernel: on the tensor cores for dk = 128 and
    # dv a multiple of 128, at any batch
    "qwen verify, no snapshots": (4, 16, 16, 32, 128, 128, 0, [16, 1, 7, 0], [3, 0, 90, 5]),
    "no snapshots, batch 8": (8, 16, 16, 32, 128, 128, 0, [16, 16, 3, 16, 1, 16, 9, 16], [0, 1, 2, 3, 0, 5, 6, 7]),
    "no snapshots T=8 dv=256 GQA": (3, 8, 2, 4, 128, 256, 0, [8, 3, 0], [1, 0, 7]),
    # on the CUDA cores for smaller dk and dv a multiple of 32, at small batch
    "no snapshots T=5 dk=48 dv=64 GQA": (3, 5, 1, 4, 48, 64, 0, [5, 2, 4], [0, 3, 1]),
    "no snapshots T=1": (2, 1, 2, 2, 16, 32, 0, [1, 0], [4, 0]),
    # a prefill (NS = 1) past 16 tokens with dk = 128, dv a multiple of 128: the tensor-core form's
    # chunks in turn, the state kept in registers between them
    "prefill in chunks T=40": (3, 40, 2, 4, 128, 128, 1, [40, 17, 0], [0, 5, 2]),
    "prefill in chunks, ragged, dv=256": (3, 33, 1, 2, 128, 256, 1, [33, 16, 1], [1, 0, 4]),
    # and the token loop past those: a prefill whose CTAs (rows x heads) pass one wave
    "prefill past one wave T=20": (5, 20, 4, 32, 128, 128, 1, [20, 7, 0, 20, 13], [0, 3, 1, 0, 2]),
    "no snapshots T=17": (2, 17, 1, 2, 32, 32, 0, [17, 9], [1, 0]),
    "no snapshots dk=256": (2, 4, 1, 2, 256, 64, 0, [4, 3], [1, 0]),
    "no snapshots dv=48": (2, 16, 1, 2, 64, 48, 0, [16, 5], [0, 2]),
}


def run_kernel_and_reference(case):
    """(out, snapshot_cache) from the kernel, and the same from the reference on copies."""
    assert plugins.load() is not None and gated_delta_kernel_supports(case["q"].shape[3], case["v"].shape[3])
    ref_case = {**case, "snapshot_cache": case["snapshot_cache"].clone()}
    state_before = case["state_cache"].clone()
    out = gated_delta_recurrent(**case)
    torch.cuda.synchronize()
    ref_out = gated_delta_recurrent_reference(**ref_case)
    assert torch.equal(case["state_cache"], state_before)  # read only
    return (out, case["snapshot_cache"]), (ref_out, ref_case["snapshot_cache"])


def check_close(got, ref, what):
    assert not got.isnan().any(), f"{what}: NaN"
    scale = max(ref.abs().max().item(), 1e-3) if ref.numel() else 1.0
    err = (got - ref).abs().max().item() if ref.numel() else 0.0
    assert err <= TOLERANCE * scale, f"{what}: max error {err:.3g} > {TOLERANCE} x {scale:.3g}"


def check_against_reference(case, before):
    """Kernel vs reference; the snapshots a pass does not reach keep their garbage bit for bit."""
    (out, cache), (ref_out, ref_cache) = run_kernel_and_reference(case)
    assert out.shape == ref_out.shape and out.dtype == torch.float32
    check_close(out, ref_out, "out")
    padding = torch.arange(out.shape[1], device="cuda") >= case["num_tokens"][:, None]
    assert not out[padding].any(), "padding outputs must be zeros"
    mask = reached(case)
    check_close(cache[mask], ref_cache[mask], "snapshots")
    assert torch.equal(cache[~mask], before[~mask]), "a snapshot the pass does not reach was written"


@pytest.mark.cuda
@pytest.mark.parametrize("shape", CUDA_CASES.values(), ids=CUDA_CASES.keys())
def test_cuda_kernel_matches_the_reference(shape):
    case = make_case(*shape, device="cuda", seed=len(shape[7]))
    check_against_reference(case, case["snapshot_cache"].clone())


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["qwen verify T=16 ragged", "qwen verify, no snapshots"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_cuda_output_in_the_model_dtype_is_the_fp32_output_rounded(dtype, name):
    # what the layer casts the output to, written by the kernel itself
    case = make_case(*CUDA_CASES[name], device="cuda", seed=3)
    fp32 = gated_delta_recurrent(**{**case, "snapshot_cache": case["snapshot_cache"].clone()})
    out = gated_delta_recurrent(**case, out_dtype=dtype)
    assert out.dtype == dtype and torch.equal(out, fp32.to(dtype))


@pytest.mark.cuda
def test_cuda_padding_rows_may_share_a_scratch_slot():
    """CUDA-graph padding rows: same inputs, start 0, all on one scratch slot. Their snapshots
    race, but they are equal, so the slot holds them; the real rows are unaffected."""
    bs, T, Hk, Hv, dk, dv, NS = 5, 8, 2, 4, 32, 32, 8
    case = make_case(bs, T, Hk, Hv, dk, dv, NS, [8, 3, 8, 8, 8], [4, 9, 0, 0, 0], slots=[0, 1, 6, 6, 6],
                     num_slots=7, device="cuda")
    for name in ("q", "k", "v", "g", "beta"):
        case[name][3:] = case[name][2]
    check_against_reference(case, case["snapshot_cache"].clone())


@pytest.mark.cuda
@pytest.mark.parametrize("NS", [16, 0], ids=["snapshots", "outputs only"])
def test_cuda_kernel_replays_in_a_cuda_graph_with_new_inputs(NS):
    """Capture once; change every input in place (tokens, slots, starts, row lengths); replay."""
    shape = (4, 16, 16, 32, 128, 128, NS)
    case = make_case(*shape, [16, 16, 16, 16], [1, 1, 1, 1], slots=[0, 1, 2, 3], num_slots=8, device="cuda")
    gated_delta_recurrent(**case)  # build and first launch outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gated_delta_recurrent(**case)
    new = make_case(*shape, [16, 1, 9, 0], [0, 30, 2, 7], slots=[5, 2, 7, 0], num_slots=8, device="cuda", seed=3)
    for name, t in new.items():
        case[name].copy_(t)
    before = case["snapshot_cache"].clone()
    graph.replay()
    torch.cuda.synchronize()
    ref_case = {**case, "snapshot_cache": before.clone()}
    ref_out = gated_delta_recurrent_reference(**ref_case)
    check_close(out, ref_out, "out")
    mask = reached(case)
    check_close(case["snapshot_cache"][mask], ref_case["snapshot_cache"][mask], "snapshots")
    assert torch.equal(case["snapshot_cache"][~mask], before[~mask])


def in_place_step(case):
    """The same pass with NS = 1 and the snapshot written over the state itself (an AR step):
    returns (out, state_cache after) and (out, the snapshot) of the ordinary two-buffer op."""
    apart = {**case, "snapshot_cache": torch.zeros_like(case["state_cache"]).unsqueeze(1)}
    aliased = {**case, "state_cache": case["state_cache"].clone()}
    aliased["snapshot_cache"] = aliased["state_cache"].unsqueeze(1)
    return ((gated_delta_recurrent(**aliased), aliased["state_cache"]),
            (gated_delta_recurrent(**apart), apart["snapshot_cache"][:, 0]))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("T, d", [(1, 32), (3, 32), (40, 128)], ids=["T=1", "T=3", "T=40 in chunks"])
def test_with_one_snapshot_the_state_can_be_stepped_in_place(device, T, d):
    case = make_case(3, T, 2, 4, d, d, 1, [T, T, max(1, T - 1)], [0, 5, 2], num_slots=5, device=device)
    (out, state), (want_out, snapshot) = in_place_step(case)
    slots = case["slots"].long()
    check_close(out, want_out, "out")
    check_close(state[slots], snapshot[slots], "state stepped in place")
    others = torch.ones(5, dtype=torch.bool, device=device)
    others[slots] = False
    assert torch.equal(state[others], case["state_cache"][others]), "other slots must stay as they were"


@pytest.mark.cuda
def test_cuda_misaligned_inputs_take_the_reference_instead_of_failing_in_the_kernel():
    """The kernel needs q, k, v and the caches 16-byte aligned; a view that is not goes to the
    reference (a check failing inside the op would crash the process on some torch builds)."""
    assert plugins.load() is not None
    case = make_case(2, 4, 1, 2, 16, 32, 0, [4, 3], [1, 0], device="cuda")
    flat = torch.empty(case["q"].numel() + 1, device="cuda")
    q = flat[1:].view_as(case["q"])
    q.copy_(case["q"])
    assert q.data_ptr() % 16 != 0
    assert torch.equal(gated_delta_recurrent(**{**case, "q": q}), gated_delta_recurrent_reference(**case))


# -- the fused decode step (ops.gated_delta_step) ---------------------------------------------


def step_case(bs, Hk, Hv, dtype, seed=0):
    """An AR step's inputs as a Gated DeltaNet layer hands them over: the conv output qkv
    (contiguous), a, b and z views of the packed projection; row 0 a new sequence, the last row
    of several padding (no token)."""
    D = 128
    g = torch.Generator(device="cuda").manual_seed(seed)
    rand = lambda *shape, scale=1.0: (torch.randn(*shape, generator=g, device="cuda") * scale)  # noqa: E731
    C = 2 * Hk * D + Hv * D
    qkv = rand(bs, 1, C).to(dtype)
    proj = rand(bs, 1, C + Hv * D + 2 * Hv + 8).to(dtype)  # in_proj's row: qkv | z | b | a (and a little more)
    z = proj[..., C:C + Hv * D].unflatten(-1, (Hv, D))
    b, a = proj[..., C + Hv * D:C + Hv * D + Hv], proj[..., C + Hv * D + Hv:C + Hv * D + 2 * Hv]
    neg_a, dt_bias = -rand(Hv).exp(), rand(Hv)
    norm_weight = (1 + rand(D, scale=0.1)).to(dtype)
    state = rand(bs + 2, Hv, D, D, scale=0.1)
    slots = torch.randperm(bs + 2, generator=g, device="cuda")[:bs].int()
    start = torch.full((bs,), 7, dtype=torch.int32, device="cuda")
    start[0] = 0
    num_tokens = torch.ones(bs, dtype=torch.int32, device="cuda")
    if bs > 1:
        num_tokens[-1] = 0
    return dict(qkv=qkv, a=a, b=b, z=z, neg_a=neg_a, dt_bias=dt_bias, norm_weight=norm_weight, state=state,
                slots=slots, start=start, num_tokens=num_tokens, Hk=Hk)


@pytest.mark.cuda
@pytest.mark.parametrize("bs, Hk, Hv", [(1, 16, 32), (3, 16, 32), (2, 16, 16), (2, 16, 64)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_cuda_fused_decode_step_is_the_three_ops_to_the_bit(dtype, bs, Hk, Hv):
    assert plugins.load() is not None
    c = step_case(bs, Hk, Hv, dtype, seed=bs + Hv)
    eps, q_scale = 1e-6, 128 ** -0.5
    assert ops._gated_delta_step_fits(c["qkv"], c["a"], c["b"], c["z"], c["norm_weight"], c["state"], 128, 128)
    fused_state, ops_state = c["state"].clone(), c["state"].clone()
    y = ops.gated_delta_step(c["qkv"], c["a"], c["b"], c["z"], c["neg_a"], c["dt_bias"], c["norm_weight"], eps,
                             L2_EPS, q_scale, fused_state, c["slots"], c["start"], c["num_tokens"], Hk)
    inputs = ops.gated_delta_prepare(c["qkv"], c["a"], c["b"], c["neg_a"], c["dt_bias"], Hk, 128, 128, L2_EPS, q_scale)
    out = ops.gated_delta_recurrent(*inputs, ops_state, ops_state.unsqueeze(1), c["slots"], c["start"],
                                    c["num_tokens"], dtype)
    expected = ops.gated_rms_norm(out, c["z"], c["norm_weight"], eps)
    assert y.shape == expected.shape == (bs, 1, Hv, 128) and y.dtype == dtype
    assert torch.equal(y, expected)
    assert torch.equal(fused_state, ops_state)
    if bs > 1:  # the padding row: zeros, its state kept
        assert not y[-1].any() and torch.equal(fused_state[c["slots"][-1]], c["state"][c["slots"][-1]])
