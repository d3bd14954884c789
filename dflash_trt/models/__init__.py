"""Target model classes by HF `model_type`; the engine needs nothing else to pick one.

A target class takes its config and offers `forward(input_ids, batch, cache, taps)`,
`logits(hidden)`, `new_cache(num_slots, capacity, device=None)` (device "meta" sizes a cache
without allocating it), `commit(cache, batch, num_committed)` (a [bs] tensor or list)
and `tie_weights()`. `commit` is called after every target pass with the number of tokens
of each row that stay (all of them for prefill and AR, the accepted prefix + 1 after a
verify); attention-only targets roll back by length, have nothing to do there and say so
with `stateful = False` (the decode passes then skip the call). A stateful target's
`new_cache` also takes `num_snapshots`: the widest pass `commit` may cut back (the block).
"""

from __future__ import annotations

from dflash_trt.models.qwen3 import Qwen3ForCausalLM
from dflash_trt.models.qwen3_5 import Qwen3_5ForCausalLM


def target_class(model_type: str):
    classes = {"qwen3": Qwen3ForCausalLM, "qwen3_5": Qwen3_5ForCausalLM}
    return classes[model_type]
