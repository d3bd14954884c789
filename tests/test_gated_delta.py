"""The gated delta rule's snapshots, and the CUDA split path's packing (with a CPU stand-in
for fla's chunked kernel: the kernel itself needs a GPU and is tested there)."""

import pytest
import torch

from dflash_trt.models import gated_delta
from dflash_trt.models.gated_delta import l2_normalize
from dflash_trt.ops import gated_delta_rule_reference


def inputs(bs, T, Hk=2, Hv=4, dk=8, dv=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q, k = l2_normalize(r(bs, T, Hk, dk)) * dk**-0.5, l2_normalize(r(bs, T, Hk, dk))
    g = -torch.nn.functional.softplus(r(bs, T, Hv))
    return q, k, r(bs, T, Hv, dv), g, torch.sigmoid(r(bs, T, Hv)), r(bs, Hv, dk, dv)


def test_snapshot_d_back_from_the_end_is_the_state_after_num_tokens_minus_d():
    q, k, v, g, beta, state = inputs(bs=3, T=9)
    num_tokens, S = torch.tensor([9, 5, 2]), 4
    _, snapshots = gated_delta_rule_reference(q, k, v, g, beta, state, num_tokens, S)
    for row, n in enumerate(num_tokens.tolist()):
        for d in range(min(S, n)):
            sl = slice(row, row + 1)
            _, alone = gated_delta_rule_reference(q[sl], k[sl], v[sl], g[sl], beta[sl], state[sl],
                                                  torch.tensor([n - d]), 1)
            torch.testing.assert_close(snapshots[row, S - 1 - d], alone[0, 0], rtol=0, atol=1e-6)


def fake_fla_chunk(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, cu_seqlens_cpu):
    """fla's varlen API (batch 1, packed sequences, one state per sequence), computed by the reference."""
    assert q.shape[0] == 1 and output_final_state and initial_state.shape[0] == len(cu_seqlens) - 1
    assert cu_seqlens_cpu.device.type == "cpu" and torch.equal(cu_seqlens_cpu, cu_seqlens.cpu())
    outs, finals = [], []
    for i, (a, b) in enumerate(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())):
        o, last = gated_delta_rule_reference(q[:, a:b].float() * scale, k[:, a:b], v[:, a:b], g[:, a:b],
                                             beta[:, a:b], initial_state[i:i + 1], torch.tensor([b - a]), 1)
        outs.append(o)
        finals.append(last[:, 0])
    return torch.cat(outs, 1), torch.cat(finals)


def test_long_pass_split_into_chunked_head_and_recurrent_tail_equals_the_reference(monkeypatch):
    monkeypatch.setattr(gated_delta, "_fla_chunk", lambda: fake_fla_chunk)
    q, k, v, g, beta, state = inputs(bs=4, T=20)
    num_tokens, S = torch.tensor([20, 7, 3, 13]), 4  # rows longer and shorter than S
    out, snapshots = gated_delta._chunked_head_then_recurrent_tail(q, k, v, g, beta, state, num_tokens, S)
    again = gated_delta._chunked_head_then_recurrent_tail(q, k, v, g, beta, state, num_tokens, S, (20, 7, 3, 13))
    torch.testing.assert_close(again, (out, snapshots), rtol=0, atol=0)  # host-known lengths: the same pass
    ref_out, ref_snapshots = gated_delta_rule_reference(q, k, v, g, beta, state, num_tokens, S)
    for row, n in enumerate(num_tokens.tolist()):
        torch.testing.assert_close(out[row, :n], ref_out[row, :n], rtol=0, atol=1e-5)
        kept = min(S, n)  # snapshots before a short row's first token are never read
        torch.testing.assert_close(snapshots[row, S - kept:], ref_snapshots[row, S - kept:], rtol=0, atol=1e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fla_chunked_head_on_the_gpu_matches_the_reference(dtype):
    """The real fla kernel (when installed) on Qwen3.5-like head sizes, ragged rows."""
    pytest.importorskip("fla.ops.gated_delta_rule", reason="needs flash-linear-attention (fla-core)")
    assert gated_delta._fla_chunk() is not None
    q, k, v, g, beta, state = (t.cuda() for t in inputs(bs=3, T=300, Hk=2, Hv=4, dk=128, dv=128))
    num_tokens, S = torch.tensor([300, 77, 9], device="cuda"), 16
    out, snapshots = gated_delta._chunked_head_then_recurrent_tail(q, k, v.to(dtype), g, beta, state, num_tokens, S)
    ref_out, ref_snapshots = gated_delta_rule_reference(q, k, v, g, beta, state, num_tokens, S)
    # fla multiplies in the input dtype (tf32 / bf16 tensor cores): bounds relative to the values' scale
    tol = 2e-2 if dtype == torch.float32 else 6e-2
    for row, n in enumerate(num_tokens.tolist()):
        scale = ref_out[row, :n].abs().max()
        assert (out[row, :n] - ref_out[row, :n]).abs().max() <= tol * scale, row
        kept = min(S, n)
        ref = ref_snapshots[row, S - kept:]
        assert (snapshots[row, S - kept:] - ref).abs().max() <= tol * ref.abs().max(), row


@pytest.mark.cuda
@pytest.mark.parametrize("with_fla", [False, True])
def test_a_prefill_on_the_gpu_matches_the_reference(monkeypatch, with_fla):
    """gated_delta_rule for a pass wider than the snapshots: fla's chunked head (when installed)
    and the recurrent kernel for the rest, or the kernel alone."""
    if with_fla:
        pytest.importorskip("fla.ops.gated_delta_rule", reason="needs flash-linear-attention (fla-core)")
    else:
        monkeypatch.setattr(gated_delta, "_fla_chunk", lambda: None)
    gen = torch.Generator().manual_seed(5)
    r = lambda *s: torch.randn(*s, generator=gen).cuda()  # noqa: E731
    bs, T, Hk, Hv, dk, S = 3, 40, 2, 4, 32, 16
    q, k, v = r(bs, T, Hk, dk), r(bs, T, Hk, dk), r(bs, T, Hv, dk)
    g, beta, state = -torch.nn.functional.softplus(r(bs, T, Hv)), torch.sigmoid(r(bs, T, Hv)), r(bs, Hv, dk, dk)
    num_tokens = torch.tensor([40, 23, 5], device="cuda")
    out, snapshots = gated_delta.gated_delta_rule(q, k, v, g, beta, state, num_tokens, S)
    qn, kn = l2_normalize(q) * dk**-0.5, l2_normalize(k)
    ref_out, ref_snapshots = gated_delta_rule_reference(qn, kn, v, g, beta, state, num_tokens, S)
    tol = 2e-2 if with_fla else 1e-5  # fla multiplies in tf32
    for row, n in enumerate(num_tokens.tolist()):
        assert (out[row, :n] - ref_out[row, :n]).abs().max() <= tol * ref_out[row, :n].abs().max(), row
        kept = min(S, n)
        ref = ref_snapshots[row, S - kept:]
        assert (snapshots[row, S - kept:] - ref).abs().max() <= tol * ref.abs().max(), row
