"""Bad checkpoints and mismatched pairs fail with errors naming the file, key and value."""

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from dflash_trt.config import DraftConfig, default_target_layer_ids
from dflash_trt.errors import CheckpointError, ConfigError, PairError
from dflash_trt.loading import load_pair


@pytest.fixture
def pair(make_pair, no_tokenizer, tmp_path):
    """A private, editable copy of a tiny pair."""
    src = make_pair(num_shards=2, **no_tokenizer)
    shutil.copytree(src.target, tmp_path / "target")
    shutil.copytree(src.drafter, tmp_path / "drafter")
    return tmp_path / "target", tmp_path / "drafter"


def edit_json(path, **changes):
    data = json.loads(path.read_text())
    for key, value in changes.items():
        *parents, leaf = key.split(".")
        node = data
        for p in parents:
            node = node[p]
        if value is ...:
            node.pop(leaf, None)
        else:
            node[leaf] = value
    path.write_text(json.dumps(data))


def edit_tensors(path, fn):
    tensors = load_file(path)
    fn(tensors)
    save_file(tensors, path)


CONFIG_ERRORS = [
    ("target", {"model_type": "llama"}, ConfigError, r"target/config.json: key 'model_type' is 'llama'; supported"),
    ("target", {"hidden_size": ...}, ConfigError, r"target/config.json: required key 'hidden_size' is missing"),
    ("target", {"num_key_value_heads": 3}, ConfigError, r"'num_key_value_heads' = 3 must divide"),
    ("target", {"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}, ConfigError,
     r"'rope_scaling' has rope_type 'dynamic'; supported: default, yarn"),
    ("target", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4e3}},
     ConfigError, r"'rope_scaling.original_max_position_embeddings' must be an int, got 4000.0"),
    ("drafter", {"rope_scaling": {"rope_type": "yarn", "factor": -2, "original_max_position_embeddings": 4096}},
     ConfigError, r"drafter/config.json: key 'rope_scaling.factor' must be a positive number, got -2"),
    ("drafter", {"hidden_size": 32, "head_dim": 8}, PairError,
     r"drafter/config.json: hidden_size = 32 differs from the target's hidden_size = 64"),
    ("drafter", {"dflash_config.target_layer_ids": [0, 4]}, PairError,
     r"target_layer_ids has 4, but the target has only 4 layers"),
    ("drafter", {"dflash_config.mask_token_id": 512}, PairError,
     r"mask_token_id = 512 is outside the target's embedding table \(vocab_size = 512\)"),
    ("drafter", {"dflash_config.mask_token_id": ...}, ConfigError, r"'dflash_config.mask_token_id' is missing"),
    ("drafter", {"dflash_config.block_size": 4}, ConfigError, r"block_size' = 8 disagrees with dflash_config"),
    ("drafter", {"layer_types": ["full_attention", "sliding"]}, ConfigError, r"unknown kind 'sliding'"),
    ("drafter", {"layer_types": ["full_attention", "sliding_attention"], "sliding_window": None}, ConfigError,
     r"'sliding_window' is required"),
]


@pytest.mark.parametrize("which, changes, error, message", CONFIG_ERRORS)
def test_bad_config_values_are_named_in_the_error(pair, which, changes, error, message):
    edit_json(dict(zip(("target", "drafter"), pair))[which] / "config.json", **changes)
    with pytest.raises(error, match=message):
        load_pair(*pair)


def test_config_that_is_not_json_names_the_file(pair):
    (pair[0] / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"target/config.json: not valid JSON"):
        load_pair(*pair)


def test_fc_width_must_be_taps_times_hidden(pair):
    edit_json(pair[1] / "config.json", **{"dflash_config.target_layer_ids": [0, 1, 2]})
    with pytest.raises(PairError, match=r"model.safetensors: 'fc.weight' has input width 128, but 3 taps x "
                                        r"hidden_size 64 = 192"):
        load_pair(*pair)


def test_missing_tensor_is_named(pair):
    edit_tensors(pair[1] / "model.safetensors", lambda t: t.pop("layers.1.self_attn.k_norm.weight"))
    with pytest.raises(CheckpointError, match=r"drafter: tensor 'layers.1.self_attn.k_norm.weight' is missing"):
        load_pair(*pair)


def test_missing_lm_head_of_an_untied_target_is_named(pair):
    index = json.loads((pair[0] / "model.safetensors.index.json").read_text())
    shard = pair[0] / index["weight_map"]["lm_head.weight"]
    edit_tensors(shard, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(CheckpointError, match=r"cannot read tensor 'lm_head.weight'|'lm_head.weight' is missing"):
        load_pair(*pair)


def test_tensor_of_the_wrong_shape_is_named(pair):
    edit_tensors(pair[1] / "model.safetensors", lambda t: t.update({"norm.weight": t["norm.weight"][:10]}))
    with pytest.raises(CheckpointError, match=r"norm.weight\(10,\) does not fit parameter 'norm.weight' of shape"):
        load_pair(*pair)


def test_missing_weight_files_are_named(pair):
    (pair[1] / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"drafter: no model.safetensors or model.safetensors.index.json"):
        load_pair(*pair)


def test_missing_shard_is_named(pair):
    (pair[0] / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model-00002-of-00002.safetensors: weight file listed in the "
                                              r"checkpoint is missing"):
        load_pair(*pair)


@pytest.mark.parametrize("damage", ["truncate", "garbage-header"])
def test_corrupt_safetensors_are_named(pair, damage):
    path = pair[1] / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\xff" * 64 + data[64:])
    with pytest.raises(CheckpointError, match=r"drafter/model.safetensors: corrupt safetensors file"):
        load_pair(*pair)


def test_drafter_config_variants_resolve_like_the_spec(pair):
    # block_size inside dflash_config, taps from the default formula, "model." prefixes
    edit_json(pair[1] / "config.json", block_size=..., **{"dflash_config.block_size": 4,
                                                          "dflash_config.target_layer_ids": ...})
    config = DraftConfig.from_dir(pair[1])
    assert config.block_size == 4
    assert config.target_layer_ids == default_target_layer_ids(2, 4) == (1, 1)


@pytest.mark.parametrize("layers, target_layers, expected", [
    (5, 36, (1, 9, 17, 25, 33)), (5, 32, (1, 8, 15, 22, 29)), (8, 40, (1, 6, 11, 16, 22, 27, 32, 37)),
    (1, 28, (14,)), (5, 64, (1, 16, 31, 46, 61)),
])
def test_default_taps_follow_the_z_lab_formula(layers, target_layers, expected):
    assert default_target_layer_ids(layers, target_layers) == expected
