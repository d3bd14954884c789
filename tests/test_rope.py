"""YaRN RoPE scaling (Qwen3.6 drafters, long-context Qwen3): frequencies and the cos/sin
scale equal transformers' for the parameter sets checkpoints use; drafters pick it up."""

import json

import pytest
import torch

from dflash_trt.config import DraftConfig, TargetConfig
from dflash_trt.loading import load_pair
from dflash_trt.models.layers import rope_inv_freq
from dflash_trt.sampling import SamplingParams

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

YARN = {
    "long-context qwen3": dict(head_dim=128, theta=1e6, max_pos=131072,
                               params={"factor": 4.0, "original_max_position_embeddings": 32768}),
    "factor from the context ratio": dict(head_dim=128, theta=1e7, max_pos=262144,
                                          params={"factor": None, "original_max_position_embeddings": 32768}),
    "mscale pair, no truncation": dict(head_dim=64, theta=1e4, max_pos=16384,
                                       params={"factor": 8.0, "original_max_position_embeddings": 2048,
                                               "mscale": 0.707, "mscale_all_dim": 1.0, "truncate": False,
                                               "beta_fast": 16, "beta_slow": 2}),
    "original context defaults to max_position_embeddings": dict(head_dim=128, theta=1e6, max_pos=32768,
                                                                  params={"factor": 4.0}),
    "explicit zero betas mean the defaults": dict(head_dim=128, theta=1e6, max_pos=131072,
                                                  params={"factor": 4.0, "original_max_position_embeddings": 32768,
                                                          "beta_fast": 0, "beta_slow": 0}),
    "explicit attention factor": dict(head_dim=128, theta=1e6, max_pos=40960,
                                      params={"factor": 2.0, "original_max_position_embeddings": 20480,
                                              "attention_factor": 1.25}),
}


def config_json(case):
    return {"hidden_size": 2 * case["head_dim"], "intermediate_size": 64, "num_hidden_layers": 1,
            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": case["head_dim"],
            "max_position_embeddings": case["max_pos"], "rope_theta": case["theta"],
            "rope_scaling": {"rope_type": "yarn", **case["params"]}}


@pytest.mark.parametrize("name", YARN)
def test_yarn_frequencies_and_scale_equal_transformers(tmp_path, name):
    data = config_json(YARN[name])
    hf = transformers.Qwen3Config(**{k: v for k, v in data.items() if k not in ("rope_theta", "rope_scaling")},
                                  rope_parameters={"rope_theta": data["rope_theta"], **data["rope_scaling"]})
    want_freq, want_scale = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3", "vocab_size": 64, **data}))
    dims = TargetConfig.from_dir(tmp_path).dims
    freq, scale = rope_inv_freq(dims.head_dim, dims.rope_theta, dims.rope_yarn)
    torch.testing.assert_close(freq, want_freq, rtol=1e-6, atol=0)
    assert scale == pytest.approx(want_scale, rel=1e-12) and scale != 1.0


def test_plain_rope_is_unscaled():
    freq, scale = rope_inv_freq(8, 1e4)
    assert scale == 1.0 and torch.equal(freq, 1.0 / 1e4 ** (torch.arange(0, 8, 2).float() / 8))


def test_a_yarn_drafter_uses_its_scaling_and_dflash_stays_lossless(make_pair, no_tokenizer):
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}
    pair = make_pair(**no_tokenizer, draft_rope_theta=1e7, extra_draft_config={"rope_scaling": yarn})
    engine = load_pair(pair.target, pair.drafter, max_seq_len=96)
    dims = DraftConfig.from_dir(pair.drafter).dims
    assert dims.rope_yarn is not None and engine.target.config.dims.rope_yarn is None
    freq, scale = rope_inv_freq(dims.head_dim, 1e7, dims.rope_yarn)
    assert torch.equal(engine.drafter.rotary.inv_freq, freq) and engine.drafter.rotary.scale == scale > 1
    prompts, params = [[1, 2, 3], list(range(5, 30))], SamplingParams(max_tokens=24, ignore_eos=True)
    ar = engine.generate(prompts, params, mode="ar")
    assert [r.token_ids for r in engine.generate(prompts, params, mode="dflash")] == [r.token_ids for r in ar]


def test_the_transformers_baseline_of_a_yarn_target_has_the_same_logits(make_pair, no_tokenizer, tmp_path):
    from dflash_trt.benchmark.transformers_baseline import to_transformers
    from dflash_trt.kv_cache import Batch
    from dflash_trt.loading import load_target

    pair = make_pair(**no_tokenizer, rope_theta=1e4)
    config = json.loads((pair.target / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32}
    target_dir = tmp_path / "target"
    target_dir.mkdir()
    for f in pair.target.iterdir():
        (target_dir / f.name).write_bytes(f.read_bytes())
    (target_dir / "config.json").write_text(json.dumps(config))
    target = load_target(target_dir)
    ids = list(range(3, 40))
    with torch.no_grad():
        hidden, _ = target(torch.tensor([ids]), Batch.make([0], [0], [len(ids)], len(ids), "cpu"),
                           target.new_cache(1, 64))
        theirs = to_transformers(target)(torch.tensor([ids])).logits
    torch.testing.assert_close(target.logits(hidden), theirs.float(), rtol=0, atol=1e-4)
