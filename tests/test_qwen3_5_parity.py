"""The Qwen3.5 hybrid target matches transformers' Qwen3_5ForCausalLM (fp32, tiny random configs)."""

import pytest
import torch

from dflash_trt.build import _save_model
from dflash_trt.kv_cache import Batch
from dflash_trt.loading import load_target

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("transformers_torch_paths")

HYBRID = dict(target_type="qwen3_5", tokenizer_tokens=None, vocab_size=512)
CONFIGS = {
    # the released layout (text_config, model.language_model.*, vision + mtp tensors to skip)
    "multimodal-3lin1full-gqa2-rope25": dict(
        hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=32, num_layers=4, partial_rotary_factor=0.25,
        linear_heads=(2, 4), linear_head_dims=(16, 16), rope_theta=1e7),
    # text-only export; full layers first and last, MHA, dk != dv, kernel 3, tied, sharded
    "text-full-first-mha-rope50-tied": dict(
        hidden_size=96, num_heads=3, num_kv_heads=3, head_dim=32, num_layers=5, partial_rotary_factor=0.5,
        layer_types=("full_attention", "linear_attention", "linear_attention", "full_attention",
                     "linear_attention"),
        linear_heads=(3, 3), linear_head_dims=(32, 16), conv_kernel_size=3, tie_word_embeddings=True,
        num_shards=2, multimodal=False),
}
ATOL = 1e-4


def hf_model(path):
    return transformers.Qwen3_5ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def forward(target, cache, slot, ids, start, taps=()):
    """One pass of `ids` at `start` in `slot`, committed in full."""
    batch = Batch.make([slot], [start], [len(ids)], len(ids), "cpu")
    with torch.no_grad():
        hidden, tapped = target(torch.tensor([ids]), batch, cache, taps)
        target.commit(cache, batch, batch.num_tokens)
        return target.logits(hidden)[0], tapped


@pytest.mark.parametrize("name", CONFIGS)
def test_prefill_and_cached_decode_match_transformers(make_pair, name):
    pair = make_pair(**CONFIGS[name], **HYBRID)
    target = load_target(pair.target)
    ids = torch.randint(0, 500, (20,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        expected = hf_model(pair.target)(torch.tensor([ids])).logits[0]

    cache = target.new_cache(num_slots=2, capacity=32)
    prefill, _ = forward(target, cache, slot=1, ids=ids[:12], start=0)
    assert (prefill - expected[:12]).abs().max() <= ATOL
    for pos in range(12, 16):  # one token at a time through the KV cache and the recurrent state
        step, _ = forward(target, cache, slot=1, ids=[ids[pos]], start=pos)
        assert (step[0] - expected[pos]).abs().max() <= ATOL, pos
    block, _ = forward(target, cache, slot=1, ids=ids[16:], start=16)  # a verify-sized pass
    assert (block - expected[16:]).abs().max() <= ATOL


def test_taps_are_layer_outputs_of_either_kind_in_config_order(make_pair):
    pair = make_pair(**CONFIGS["text-full-first-mha-rope50-tied"], **HYBRID)
    target = load_target(pair.target)
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    taps = (2, 0, 3, 1)  # linear, full, full, linear; unsorted on purpose
    with torch.no_grad():
        states = hf_model(pair.target)(torch.tensor([ids]), output_hidden_states=True).hidden_states
    _, tapped = forward(target, target.new_cache(1, 8), 0, ids, 0, taps)
    for k, layer in enumerate(taps):  # layer i's output is HF hidden_states[i + 1]
        assert (tapped[0, :, k * 96:(k + 1) * 96] - states[layer + 1][0]).abs().max() <= ATOL


def test_ragged_batched_prefill_then_decode_matches_one_by_one(make_pair):
    """Padding after a short row must not advance its recurrent state."""
    pair = make_pair(**CONFIGS["multimodal-3lin1full-gqa2-rope25"], **HYBRID)
    target = load_target(pair.target)
    prompts = [[5, 6, 7], list(range(20, 31)), [9]]
    nxt = [40, 41, 42]
    cache = target.new_cache(num_slots=3, capacity=16)
    width = max(map(len, prompts))
    ids = torch.tensor([p + [0] * (width - len(p)) for p in prompts])
    batch = Batch.make([2, 0, 1], [0, 0, 0], [len(p) for p in prompts], width, "cpu")
    with torch.no_grad():
        hidden, _ = target(ids, batch, cache)
        target.commit(cache, batch, batch.num_tokens)
        batched = target.logits(hidden)
        step = Batch.make([2, 0, 1], [len(p) for p in prompts], [1, 1, 1], 1, "cpu")
        hidden, _ = target(torch.tensor([[t] for t in nxt]), step, cache)
        decoded = target.logits(hidden)[:, 0]
    for row, p in enumerate(prompts):
        alone_cache = target.new_cache(1, 16)
        alone, _ = forward(target, alone_cache, 0, p, 0)
        assert (batched[row, : len(p)] - alone).abs().max() <= ATOL
        after, _ = forward(target, alone_cache, 0, [nxt[row]], len(p))
        assert (decoded[row] - after[0]).abs().max() <= ATOL


def test_packed_engine_weights_load_back(make_pair, tmp_path):
    """`build` stores fused runtime names next to the multimodal config.json; they load back."""
    pair = make_pair(**CONFIGS["multimodal-3lin1full-gqa2-rope25"], **HYBRID)
    target = load_target(pair.target)
    _save_model(target, tmp_path / "target", pair.target)
    packed = load_target(tmp_path / "target")
    ids = [1, 2, 3, 4, 5]
    a, _ = forward(target, target.new_cache(1, 8), 0, ids, 0)
    b, _ = forward(packed, packed.new_cache(1, 8), 0, ids, 0)
    assert torch.equal(a, b)
