"""A ragged prefill (prompts of several lengths in one pass) runs its token-wise work, norms
and MLPs, on its real tokens only, packed into one row; attention still sees each prompt as
a row. What each prompt gets must not change."""

import pytest
import torch

from dflash_trt.kv_cache import Batch, Packing
from dflash_trt.loading import load_target

HYBRID = dict(target_type="qwen3_5", tokenizer_tokens=None, vocab_size=512, head_dim=32, rope_theta=1e7,
              draft_rope_theta=1e7, target_layer_ids=(1, 3))
TARGETS = {"qwen3": dict(target_layer_ids=(0, 1)), "qwen3.5 hybrid": HYBRID}
LENGTHS = [5, 1, 9]  # ragged: 15 real tokens in rows of 9


def test_packing_keeps_the_real_tokens_in_row_order_and_unpacks_padding_as_zeros():
    batch = Batch.make([4, 0, 2], [0, 3, 0], LENGTHS, max(LENGTHS), "cpu")
    packing = batch.packing()
    x = torch.arange(3 * 9 * 2, dtype=torch.float32).view(3, 9, 2) + 1
    packed = packing.pack(x)
    assert packed.shape == (1, 15, 2)
    want = torch.cat([x[i, :n] for i, n in enumerate(LENGTHS)])
    torch.testing.assert_close(packed[0], want, rtol=0, atol=0)
    back = packing.unpack(packed)
    for i, n in enumerate(LENGTHS):
        torch.testing.assert_close(back[i, :n], x[i, :n], rtol=0, atol=0)
        assert (back[i, n:] == 0).all()


def test_only_a_pass_with_padding_known_on_the_host_is_packed():
    slots, start = torch.tensor([0, 1]), torch.tensor([0, 0])
    assert isinstance(Batch.make([0, 1], [0, 0], [3, 2], 3, "cpu").packing(), Packing)
    assert Batch.make([0, 1], [0, 0], [3, 3], 3, "cpu").packing() is None  # no padding
    assert Batch.full(slots, start, 4, 8).packing() is None  # decode passes
    # a graphed prefill: its lengths live on the device and change from replay to replay
    assert Batch.padded(slots, start, torch.tensor([3, 2]), 3, 8).packing() is None


@pytest.mark.parametrize("kind", TARGETS)
def test_a_ragged_prefill_gives_each_prompt_what_it_gets_alone(make_pair, kind):
    target = load_target(make_pair(**TARGETS[kind]).target)
    taps = target.config.dims.num_hidden_layers // 2, 0
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 500, (n,), generator=gen) for n in LENGTHS]
    ids = torch.zeros(len(LENGTHS), max(LENGTHS), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = p
    # the MLP of a packed pass sees its 15 real tokens as one row; attention sees the rows
    seen = {}
    layer = target.model.layers[0]
    mixer = getattr(layer, "linear_attn", None) or layer.self_attn
    hooks = [layer.mlp.register_forward_pre_hook(lambda m, a: seen.setdefault("mlp", a[0].shape) and None),
             mixer.register_forward_pre_hook(lambda m, a: seen.setdefault("mixer", a[0].shape) and None)]
    with torch.no_grad():
        batch = Batch.make([2, 0, 1], [0, 0, 0], LENGTHS, max(LENGTHS), "cpu")
        hidden, tapped = target(ids, batch, target.new_cache(3, 16), taps)
        for hook in hooks:
            hook.remove()
        H = target.config.dims.hidden_size
        assert seen == {"mlp": (1, sum(LENGTHS), H), "mixer": (3, max(LENGTHS), H)}
        assert hidden.shape == (3, max(LENGTHS), H) and tapped.shape == (3, max(LENGTHS), 2 * H)
        for i, p in enumerate(prompts):
            alone, alone_taps = target(p[None], Batch.make([0], [0], [len(p)], len(p), "cpu"),
                                       target.new_cache(1, 16), taps)
            torch.testing.assert_close(hidden[i, : len(p)], alone[0], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(tapped[i, : len(p)], alone_taps[0], rtol=1e-5, atol=1e-5)
