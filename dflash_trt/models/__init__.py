"""The supported targets, by the HF `model_type` at the top of config.json (`TARGETS`, the one
registry: a model class names its config class); the engine needs nothing else to pick one.

A target class takes its config and offers `forward(input_ids, batch, cache, taps)`,
`logits(hidden)`, `new_cache(num_slots, capacity, device=None)` (device "meta" sizes a cache
without allocating it), `commit(cache, batch, num_committed)` (a [bs] tensor or list)
and `tie_weights()`. `commit` is called after every target pass with the number of tokens
of each row that stay (all of them for prefill and AR, the accepted prefix + 1 after a
verify); attention-only targets roll back by length, have nothing to do there and say so
with `stateful = False` (the decode passes then skip the call). A stateful target's
`new_cache` also takes `num_snapshots`: the widest pass `commit` may cut back (the block).
`graph_safe` says its decode passes read no device value on the host (so they may be CUDA
graphs), and `graph_prefill_tokens` up to how wide a prefill that also holds.
"""

from __future__ import annotations

from pathlib import Path

from dflash_trt.config import read_json
from dflash_trt.errors import ConfigError
from dflash_trt.models.qwen3 import Qwen3ForCausalLM
from dflash_trt.models.qwen3_5 import Qwen3_5ForCausalLM

# "qwen3_5" / "qwen3_5_moe" are the released multimodal layouts (text model under
# text_config), the "_text" types text-only exports of the same models. A dense and an MoE
# target of one family share the model class: the config says which layers are sparse.
TARGETS = {"qwen3": Qwen3ForCausalLM, "qwen3_moe": Qwen3ForCausalLM,
           "qwen3_5": Qwen3_5ForCausalLM, "qwen3_5_text": Qwen3_5ForCausalLM,
           "qwen3_5_moe": Qwen3_5ForCausalLM, "qwen3_5_moe_text": Qwen3_5ForCausalLM}


def target_class(model_type: str):
    return TARGETS[model_type]


def load_target_config(directory: Path):
    """The target config of a checkpoint directory, of the class its `model_type` names."""
    path = Path(directory) / "config.json"
    model_type = read_json(path).get("model_type")
    if model_type not in TARGETS:
        raise ConfigError(f"{path}: key 'model_type' is {model_type!r}; supported targets: {', '.join(TARGETS)}")
    return TARGETS[model_type].config_class.from_dir(directory)
