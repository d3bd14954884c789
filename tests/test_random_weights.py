"""Random-weights presets have the released models' shapes and give a working engine."""

import pytest
import torch

from dflash_trt.benchmark import random_weights as rw
from dflash_trt.config import DraftConfig, TargetConfig
from dflash_trt.engine import Engine
from dflash_trt.errors import ConfigError
from dflash_trt.fixtures.pair import TinyPairSpec, write_tiny_pair
from dflash_trt.models import load_target_config, target_class
from dflash_trt.models.dflash import DFlashDrafter
from dflash_trt.models.qwen3 import Qwen3ForCausalLM
from dflash_trt.sampling import SamplingParams

# Parameter counts of Qwen/Qwen3-8B and Qwen/Qwen3-4B (safetensors totals) and of Qwen3-1.7B
# with its tied embedding counted once; the Qwen3-8B drafter is about 1.05 B parameters.
PUBLISHED = {"qwen3-8b": 8_190_735_360, "qwen3-4b": 4_022_468_096, "qwen3-1.7b": 1_720_574_976}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_qwen3_presets_have_the_released_shapes(tmp_path, name):
    sources = rw.write_configs(tmp_path, name)
    target_config = TargetConfig.from_dir(sources.target)
    draft_config = DraftConfig.from_dir(sources.drafter, target_config.dims.num_hidden_layers)
    with torch.device("meta"):
        target, drafter = Qwen3ForCausalLM(target_config), DFlashDrafter(draft_config)
    target.tie_weights()
    assert sum(p.numel() for p in target.parameters()) == PUBLISHED[name]
    assert draft_config.block_size == 16 and draft_config.mask_token_id == 151669
    assert len(drafter.layers) == 5 and target_config.vocab_size == 151936
    if name == "qwen3-8b":
        assert draft_config.target_layer_ids == (1, 9, 17, 25, 33)
        assert sum(p.numel() for p in drafter.parameters()) == pytest.approx(1.05e9, rel=0.01)
    assert not list(sources.target.glob("*.safetensors")), "configs only: weights are made on the device"


def test_qwen3_5_9b_preset_is_the_hybrid_text_model_with_a_z_lab_drafter(tmp_path):
    sources = rw.write_configs(tmp_path, "qwen3.5-9b")
    target_config = load_target_config(sources.target)
    draft_config = DraftConfig.from_dir(sources.drafter, target_config.dims.num_hidden_layers)
    assert target_config.model_type == "qwen3_5" and target_config.vocab_size == 248320
    assert target_config.layer_types.count("full_attention") == 8 and target_config.dims.head_dim == 256
    assert (target_config.linear.num_value_heads, target_config.linear.key_head_dim) == (32, 128)
    assert draft_config.target_layer_ids == (1, 8, 15, 22, 29) and draft_config.mask_token_id == 248070
    assert (draft_config.dims.num_attention_heads, draft_config.dims.head_dim, draft_config.block_size) == (32, 128, 16)
    with torch.device("meta"):
        target = target_class(target_config.model_type)(target_config)
    # the text model of Qwen3.5-9B: about 9 B parameters without the vision tower
    assert sum(p.numel() for p in target.parameters()) == pytest.approx(8.95e9, rel=0.01)


# (total parameters of the text model, active per token with one embedding row): the names'
# 35B / A3B and 397B / A17B (the released totals also count the vision tower and MTP head)
MOE_PRESETS = {"qwen3.6-35b-a3b": (34.66e9, 2.95e9), "qwen3.5-397b-a17b": (396.3e9, 16.3e9)}


@pytest.mark.parametrize("name", sorted(MOE_PRESETS))
def test_moe_presets_have_the_released_sizes(tmp_path, name):
    from dflash_trt.models.moe import Experts

    sources = rw.write_configs(tmp_path, name)
    config = load_target_config(sources.target)
    draft_config = DraftConfig.from_dir(sources.drafter, config.dims.num_hidden_layers)
    assert config.model_type == "qwen3_5_moe" and config.moe.sparse_layers == tuple(range(len(config.layer_types)))
    assert draft_config.mask_token_id == 248070 and draft_config.block_size == 16
    with torch.device("meta"):
        target = target_class(config.model_type)(config)
    total = sum(p.numel() for p in target.parameters())
    packs = [m for m in target.modules() if isinstance(m, Experts)]
    assert all(m.shared for m in packs)  # the shared expert runs as one expert more, always picked
    experts = sum(p.numel() for m in packs for p in m.parameters())
    picked = experts * (config.moe.top_k + 1) // (config.moe.num_experts + 1)
    active = total - experts + picked - config.vocab_size * config.dims.hidden_size + config.dims.hidden_size
    assert (total, active) == pytest.approx(MOE_PRESETS[name], rel=0.005)


def test_a_reduced_depth_preset_keeps_its_layer_shapes_and_taps_in_range(tmp_path):
    sources = rw.write_configs(tmp_path, "qwen3.5-397b-a17b", num_layers=4)
    config = load_target_config(sources.target)
    draft_config = DraftConfig.from_dir(sources.drafter, config.dims.num_hidden_layers)
    assert len(config.layer_types) == 4 and config.layer_types[3] == "full_attention"
    assert (config.moe.num_experts, config.moe.top_k, config.linear.num_value_heads) == (512, 10, 64)
    assert draft_config.target_layer_ids == (1, 3)
    with pytest.raises(ConfigError, match="num_layers = 61: preset 'qwen3.5-397b-a17b' has 1 to 60 layers"):
        rw.preset_spec("qwen3.5-397b-a17b", 61)


def test_a_reduced_depth_copy_of_a_preset_with_default_taps_clamps_the_full_models_taps(tmp_path):
    sources = rw.write_configs(tmp_path, "qwen3-8b", num_layers=4)  # taps by the formula: 1, 9, 17, 25, 33
    config = load_target_config(sources.target)
    assert DraftConfig.from_dir(sources.drafter, config.dims.num_hidden_layers).target_layer_ids == (1, 3)


def test_unknown_preset_is_named():
    with pytest.raises(ConfigError, match="'qwen3-9b'.*qwen3-8b"):
        rw.preset_spec("qwen3-9b")


def test_random_pair_runs_greedy_dflash_like_ar(tmp_path):
    spec = TinyPairSpec(tokenizer_tokens=None, vocab_size=96)
    sources = write_tiny_pair(tmp_path, spec, weights=False)
    target, drafter = rw.random_pair(sources, "cpu", torch.float32, seed=3)
    params = [p for p in target.parameters()]
    assert all(torch.isfinite(p).all() for p in params) and params[0].std() > 0.5
    engine = Engine(target, drafter, max_batch_size=2, max_seq_len=64)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    sp = SamplingParams(max_tokens=20, ignore_eos=True)
    ar = [r.token_ids for r in engine.generate(prompts, sp, mode="ar")]
    df = [r.token_ids for r in engine.generate(prompts, sp, mode="dflash")]
    assert ar == df and all(len(t) == 20 for t in ar)
    again = rw.random_pair(sources, "cpu", torch.float32, seed=3)[0]
    assert torch.equal(again.lm_head.weight, target.lm_head.weight), "a seed gives the same weights"


@pytest.mark.cuda
def test_a_model_larger_than_the_gpu_is_refused_before_allocating(tmp_path):
    sources = rw.write_configs(tmp_path, "qwen3.5-397b-a17b")
    before = torch.cuda.memory_allocated()
    with pytest.raises(ConfigError, match=r"weights take 7[0-9][0-9]\.[0-9] GiB .*\(build --tensor-parallel N\)"):
        rw.random_pair(sources, "cuda", torch.bfloat16)
    assert torch.cuda.memory_allocated() == before
