"""Qwen3.5 hybrid configs: both checkpoint layouts resolve, bad values name file and key."""

import json
import logging
import shutil

import pytest
from test_checkpoint_errors import edit_json

from dflash_trt.config import HybridTargetConfig, TargetConfig
from dflash_trt.errors import ConfigError
from dflash_trt.loading import load_target
from dflash_trt.models import load_target_config

HYBRID = dict(target_type="qwen3_5", tokenizer_tokens=None, vocab_size=512, head_dim=32)


@pytest.fixture
def target(make_pair, tmp_path):
    """A private, editable copy of a tiny hybrid target in the released multimodal layout."""
    shutil.copytree(make_pair(**HYBRID).target, tmp_path / "target")
    return tmp_path / "target"


def test_multimodal_config_resolves_to_the_text_model(target):
    config = load_target_config(target)
    assert isinstance(config, HybridTargetConfig) and config.model_type == "qwen3_5"
    assert config.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert (config.linear_layers, config.full_layers) == ((0, 1, 2), (3,))
    assert (config.linear.num_key_heads, config.linear.num_value_heads, config.linear.conv_size) == (2, 4, 128)
    assert config.rotary_dim == 8 and config.has_vision
    assert config.eos_token_ids == (510, 509)  # config.json's, then generation_config.json's others


def test_eos_ids_gather_text_config_top_level_and_generation_config(target):
    edit_json(target / "config.json", eos_token_id=7)  # like the released <|im_end|> at the top level
    assert load_target_config(target).eos_token_ids == (510, 7, 509)


def test_qwen3_targets_still_get_the_qwen3_config(make_pair):
    assert type(load_target_config(make_pair(tokenizer_tokens=None, vocab_size=512).target)) is TargetConfig


def test_missing_layer_types_follow_the_full_attention_interval(target):
    edit_json(target / "config.json", **{"text_config.layer_types": ..., "text_config.num_hidden_layers": 6,
                                          "text_config.full_attention_interval": 3})
    kinds = load_target_config(target).layer_types
    assert kinds == ("linear_attention", "linear_attention", "full_attention") * 2


def test_vision_tower_is_skipped_and_said_so(target, caplog):
    with caplog.at_level(logging.WARNING):
        load_target(target)  # the checkpoint holds model.visual.* and mtp.* tensors too
    assert "images and videos are not served" in caplog.text


def test_text_only_layout_loads_without_a_vision_warning(make_pair, caplog):
    pair = make_pair(**HYBRID, multimodal=False)
    assert json.loads((pair.target / "config.json").read_text())["model_type"] == "qwen3_5_text"
    with caplog.at_level(logging.WARNING):
        load_target(pair.target)
    assert not load_target_config(pair.target).has_vision and "not served" not in caplog.text


CONFIG_ERRORS = [
    ({"model_type": "qwen3_6"}, r"key 'model_type' is 'qwen3_6'; supported targets: qwen3, qwen3_moe, qwen3_5"),
    ({"model_type": "qwen3_5_moe"}, r"key 'text_config.model_type' is 'qwen3_5_text'; expected 'qwen3_5_moe_text'"),
    ({"text_config": ...}, r"required key 'text_config' is missing"),
    ({"text_config": [1]}, r"key 'text_config' must be dict, got \[1\]"),
    ({"text_config.model_type": "qwen3"}, r"key 'text_config.model_type' is 'qwen3'; expected 'qwen3_5_text'"),
    ({"text_config.hidden_size": ...}, r"required key 'text_config.hidden_size' is missing"),
    ({"text_config.layer_types": ["linear_attention"] * 3}, r"'text_config.layer_types' must list 4 layer kinds"),
    ({"text_config.layer_types": ["linear_attention"] * 3 + ["mamba"]}, r"has unknown kind 'mamba'; known: linear"),
    ({"text_config.layer_types": "full_attention"}, r"'text_config.layer_types' must list 4 layer kinds"),
    ({"text_config.linear_num_value_heads": 3}, r"'text_config.linear_num_value_heads' = 3 must be a multiple of "
                                                r"linear_num_key_heads = 2"),
    ({"text_config.linear_key_head_dim": 0}, r"'text_config.linear_key_head_dim' must be > 0, got 0"),
    ({"text_config.linear_conv_kernel_dim": 1}, r"'text_config.linear_conv_kernel_dim' must be >= 2, got 1"),
    ({"text_config.rope_parameters.partial_rotary_factor": 1.5},
     r"'text_config.partial_rotary_factor' must be a number in \(0, 1\], got 1.5"),
    ({"text_config.rope_parameters.partial_rotary_factor": 0.1},
     r"partial_rotary_factor' = 0.1 turns 3 of head_dim 32 channels; that must be an even number >= 2"),
    ({"text_config.rope_parameters.rope_type": "linear"},
     r"'text_config.rope_parameters' has rope_type 'linear'; supported: default, yarn"),
    ({"text_config.rope_parameters.rope_type": "yarn", "text_config.rope_parameters.beta_fast": -1},
     r"'text_config.rope_parameters.beta_fast' must be a positive number, got -1"),
    ({"text_config.attn_output_gate": False}, r"'text_config.attn_output_gate' must be true"),
    ({"text_config.hidden_act": "gelu"}, r"'text_config.hidden_act' is 'gelu'"),
    ({"text_config.num_key_value_heads": 3}, r"'text_config.num_key_value_heads' = 3 must divide"),
]


@pytest.mark.parametrize("changes, message", CONFIG_ERRORS)
def test_bad_hybrid_config_values_are_named_in_the_error(target, changes, message):
    edit_json(target / "config.json", **changes)
    with pytest.raises(ConfigError, match=r"target/config.json: .*" + message):
        load_target(target)


def test_text_only_layout_names_keys_without_a_prefix(make_pair, tmp_path):
    shutil.copytree(make_pair(**HYBRID, multimodal=False).target, tmp_path / "target")
    edit_json(tmp_path / "target" / "config.json", layer_types=["linear_attention"])
    with pytest.raises(ConfigError, match=r"target/config.json: key 'layer_types' must list 4 layer kinds"):
        load_target(tmp_path / "target")
