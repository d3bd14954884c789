"""The Qwen3 target matches transformers' Qwen3ForCausalLM (fp32, tiny random configs)."""

import json

import pytest
import torch

from dflash_trt.fixtures.pair import TinyPairSpec, write_tiny_pair
from dflash_trt.kv_cache import Batch
from dflash_trt.loading import load_target

transformers = pytest.importorskip("transformers")

CONFIGS = {
    "gqa2-d16": dict(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, num_layers=3),
    "mha-d32-tied": dict(hidden_size=96, num_heads=3, num_kv_heads=3, head_dim=32, num_layers=2,
                         tie_word_embeddings=True),
    "gqa4-d64-wide-sharded": dict(hidden_size=128, num_heads=8, num_kv_heads=2, head_dim=64, num_layers=4,
                                  intermediate_size=320, num_shards=3, rope_theta=10000.0),
}
ATOL = 1e-4


def hf_logits(path, ids):
    model = transformers.Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def forward(target, cache, slot, ids, start):
    batch = Batch.make([slot], [start], [len(ids)], len(ids), "cpu")
    with torch.no_grad():
        hidden, _ = target(torch.tensor([ids]), batch, cache)
        return target.logits(hidden)[0]


@pytest.mark.parametrize("name", CONFIGS)
def test_prefill_and_cached_decode_match_transformers(make_pair, no_tokenizer, name):
    pair = make_pair(**CONFIGS[name], **no_tokenizer)
    target = load_target(pair.target)
    ids = torch.randint(0, 500, (20,), generator=torch.Generator().manual_seed(1)).tolist()
    expected = hf_logits(pair.target, ids)

    cache = target.new_cache(num_slots=2, capacity=32)
    prefill = forward(target, cache, slot=1, ids=ids[:12], start=0)
    assert (prefill - expected[:12]).abs().max() <= ATOL
    for pos in range(12, 20):  # one token at a time through the KV cache
        step = forward(target, cache, slot=1, ids=[ids[pos]], start=pos)
        assert (step[0] - expected[pos]).abs().max() <= ATOL, pos


def test_a_yarn_scaled_target_matches_transformers(tmp_path, no_tokenizer):
    pair = write_tiny_pair(tmp_path, TinyPairSpec(**CONFIGS["gqa4-d64-wide-sharded"], **no_tokenizer))
    config_file = pair.target / "config.json"
    config = json.loads(config_file.read_text())
    config["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    config_file.write_text(json.dumps(config))
    target = load_target(pair.target)
    assert target.config.dims.rope_yarn is not None
    ids = torch.randint(0, 500, (20,), generator=torch.Generator().manual_seed(2)).tolist()
    expected = hf_logits(pair.target, ids)
    cache = target.new_cache(num_slots=1, capacity=32)
    assert (forward(target, cache, slot=0, ids=ids, start=0) - expected).abs().max() <= ATOL


def test_ragged_batched_prefill_matches_one_by_one(make_pair, no_tokenizer):
    pair = make_pair(**CONFIGS["gqa2-d16"], **no_tokenizer)
    target = load_target(pair.target)
    prompts = [[5, 6, 7], list(range(20, 31)), [9]]
    cache = target.new_cache(num_slots=3, capacity=16)
    width = max(map(len, prompts))
    ids = torch.tensor([p + [0] * (width - len(p)) for p in prompts])
    batch = Batch.make([2, 0, 1], [0, 0, 0], [len(p) for p in prompts], width, "cpu")
    with torch.no_grad():
        hidden, _ = target(ids, batch, cache)
        batched = target.logits(hidden)
    for row, p in enumerate(prompts):
        alone = forward(target, target.new_cache(1, 16), 0, p, 0)
        assert (batched[row, : len(p)] - alone).abs().max() <= ATOL


def test_taps_are_layer_outputs_in_config_order(make_pair, no_tokenizer):
    pair = make_pair(**CONFIGS["gqa4-d64-wide-sharded"], **no_tokenizer)
    target = load_target(pair.target)
    hf = transformers.Qwen3ForCausalLM.from_pretrained(pair.target, dtype=torch.float32).eval()
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    taps = (2, 0, 1)  # unsorted on purpose: the features follow the config's order
    with torch.no_grad():
        states = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
        _, tapped = target(torch.tensor([ids]), Batch.make([0], [0], [8], 8, "cpu"), target.new_cache(1, 8), taps)
    # hidden_states[0] is the embedding output, so layer i's output is hidden_states[i + 1]
    # (the last layer is not tapped here: HF's last entry is taken after the final norm).
    for k, layer in enumerate(taps):
        chunk = tapped[0, :, k * 128:(k + 1) * 128]
        assert (chunk - states[layer + 1][0]).abs().max() <= ATOL
