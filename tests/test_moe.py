"""Mixture-of-experts targets (Qwen3 MoE, Qwen3.5/3.6 MoE): configs read as transformers reads
them, checkpoints in either expert layout, logits and taps equal to transformers' models
(fp32, tiny random configs), and greedy DFlash equal to greedy AR on them."""

import shutil

import pytest
import torch
from test_checkpoint_errors import edit_json
from test_hybrid_lossless import ORACLES, dflash_with_oracle
from test_qwen3_5_parity import forward

from dflash_trt.build import _save_model
from dflash_trt.errors import CheckpointError, ConfigError
from dflash_trt.kv_cache import Batch
from dflash_trt.loading import load_pair, load_target
from dflash_trt.models import load_target_config
from dflash_trt.models import moe as moe_module
from dflash_trt.models.moe import SparseMoeBlock
from dflash_trt.sampling import SamplingParams

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("transformers_torch_paths")

IDS_ONLY = dict(tokenizer_tokens=None, vocab_size=512)
QWEN3_MOE = dict(num_experts=8, experts_per_tok=2, moe_intermediate_size=24, num_layers=3, **IDS_ONLY)
# the shared expert as wide as the routed ones, as in the releases: packed as one expert more
QWEN3_5_MOE = dict(target_type="qwen3_5", num_experts=8, experts_per_tok=3, moe_intermediate_size=16,
                   shared_expert_size=16, head_dim=32, rope_theta=1e7, draft_rope_theta=1e7, **IDS_ONLY)
CONFIGS = {
    # Qwen3-30B-A3B's layout: one tensor per expert; a dense layer in between; top-k renormalised
    "qwen3-moe-per-expert-dense-layer": (dict(**QWEN3_MOE, mlp_only_layers=(1,)), "Qwen3MoeForCausalLM"),
    # norm_topk_prob false: the picks keep their softmax weights (sum < 1)
    "qwen3-moe-unnormalised-top4-sharded": (dict(**{**QWEN3_MOE, "experts_per_tok": 4}, norm_topk_prob=False,
                                                 num_shards=3), "Qwen3MoeForCausalLM"),
    # the Qwen3.5/3.6 MoE releases: multimodal, packed experts, shared expert
    "qwen3.5-moe-multimodal-packed": (QWEN3_5_MOE, "Qwen3_5MoeForCausalLM"),
    # a text-only export with one tensor per expert
    "qwen3.5-moe-text-per-expert": (dict(**QWEN3_5_MOE, multimodal=False, per_expert_tensors=True),
                                    "Qwen3_5MoeForCausalLM"),
    # a shared expert wider than the routed ones: a dense MLP of its own
    "qwen3.5-moe-wider-shared-expert": (dict(**{**QWEN3_5_MOE, "shared_expert_size": 40}), "Qwen3_5MoeForCausalLM"),
}
ATOL = 1e-4


def hf_model(path, class_name):
    return getattr(transformers, class_name).from_pretrained(path, dtype=torch.float32).eval()


def target_and_logits(make_pair, name, n, seed):
    """The target of CONFIGS[name], n random ids and transformers' logits for them."""
    fields, class_name = CONFIGS[name]
    pair = make_pair(**fields)
    ids = torch.randint(0, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    with torch.no_grad():
        expected = hf_model(pair.target, class_name)(torch.tensor([ids])).logits[0]
    return load_target(pair.target), ids, expected


@pytest.mark.parametrize("name", CONFIGS)
def test_prefill_decode_and_verify_passes_match_transformers(make_pair, name):
    target, ids, expected = target_and_logits(make_pair, name, 20, seed=1)
    cache = target.new_cache(num_slots=2, capacity=32)
    prefill, _ = forward(target, cache, slot=1, ids=ids[:12], start=0)
    assert (prefill - expected[:12]).abs().max() <= ATOL
    for pos in range(12, 16):
        step, _ = forward(target, cache, slot=1, ids=[ids[pos]], start=pos)
        assert (step[0] - expected[pos]).abs().max() <= ATOL, pos
    block, _ = forward(target, cache, slot=1, ids=ids[16:], start=16)
    assert (block - expected[16:]).abs().max() <= ATOL


@pytest.mark.parametrize("name", ["qwen3-moe-per-expert-dense-layer", "qwen3.5-moe-multimodal-packed",
                                  "qwen3.5-moe-wider-shared-expert"])
def test_one_token_experts_left_for_the_norm_after_them_change_no_result(make_pair, name, monkeypatch):
    # SparseMoeBlock.output_norm_in_experts: a decode step's experts come out not run
    # (ExpertsOut) and the next layer's input norm, a tap or the final norm runs them
    # (ops.moe_experts_add_rms_norm); where a dense shared expert adds to them, they run at once
    target, ids, expected = target_and_logits(make_pair, name, 16, seed=2)
    monkeypatch.setattr(SparseMoeBlock, "output_norm_in_experts", True)
    taken = []
    monkeypatch.setattr(moe_module.ExpertsOut, "add_rms_norm",
                        lambda self, *a, _f=moe_module.ExpertsOut.add_rms_norm: taken.append(1) or _f(self, *a))
    cache = target.new_cache(num_slots=1, capacity=16)
    forward(target, cache, slot=0, ids=ids[:12], start=0)
    for pos in range(12, 16):
        step, tapped = forward(target, cache, slot=0, ids=[ids[pos]], start=pos, taps=(0,))
        assert (step[0] - expected[pos]).abs().max() <= ATOL, pos
    sparse = sum(isinstance(layer.mlp, SparseMoeBlock) for layer in target.model.layers)
    assert len(taken) == (0 if "wider" in name else 4 * sparse - (0 in target.config.moe.sparse_layers) * 4)


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["qwen3-moe-per-expert-dense-layer", "qwen3.5-moe-multimodal-packed"])
def test_cuda_bf16_decode_steps_are_the_same_bits_with_the_norm_in_the_experts(make_pair, name, monkeypatch):
    # on the GPU in bf16 a decode step's experts and the norm after them are one launch pair
    # (ops.moe_experts_add_rms_norm): the logits and taps keep their bits
    pair = make_pair(**CONFIGS[name][0])
    target = load_target(pair.target, device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(0, 500, (16,), generator=torch.Generator().manual_seed(3)).tolist()

    def steps(on: bool):
        monkeypatch.setattr(SparseMoeBlock, "output_norm_in_experts", on)
        cache = target.new_cache(num_slots=1, capacity=16)
        cuda_forward(target, cache, ids[:12], 0)
        return [cuda_forward(target, cache, [ids[pos]], pos, taps=(1,)) for pos in range(12, 16)]

    for (logits, tapped), (want_logits, want_tapped) in zip(steps(True), steps(False)):
        assert torch.equal(logits, want_logits) and torch.equal(tapped, want_tapped)


def cuda_forward(target, cache, ids, start, taps=()):
    batch = Batch.make([0], [start], [len(ids)], len(ids), "cuda")
    with torch.no_grad():
        hidden, tapped = target(torch.tensor([ids], device="cuda"), batch, cache, taps)
        target.commit(cache, batch, batch.num_tokens)
        return target.logits(hidden)[0], tapped


@pytest.mark.parametrize("name", ["qwen3-moe-per-expert-dense-layer", "qwen3.5-moe-multimodal-packed"])
def test_taps_match_transformers_hidden_states(make_pair, name):
    fields, class_name = CONFIGS[name]
    pair = make_pair(**fields)
    target = load_target(pair.target)
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    taps = (1, 0)  # not the last layer: transformers' last hidden state is normed
    with torch.no_grad():
        states = hf_model(pair.target, class_name)(torch.tensor([ids]), output_hidden_states=True).hidden_states
    _, tapped = forward(target, target.new_cache(1, 8), 0, ids, 0, taps)
    H = target.config.dims.hidden_size
    for k, layer in enumerate(taps):  # layer i's output is HF hidden_states[i + 1]
        assert (tapped[0, :, k * H:(k + 1) * H] - states[layer + 1][0]).abs().max() <= ATOL


def test_config_names_the_sparse_layers_and_routing(make_pair):
    qwen3 = load_target_config(make_pair(**CONFIGS["qwen3-moe-per-expert-dense-layer"][0]).target)
    assert qwen3.model_type == "qwen3_moe"
    assert (qwen3.moe.num_experts, qwen3.moe.top_k, qwen3.moe.expert_size) == (8, 2, 24)
    assert qwen3.moe.sparse_layers == (0, 2) and qwen3.moe.norm_topk_prob and not qwen3.moe.shared_expert_size
    hybrid = load_target_config(make_pair(**QWEN3_5_MOE).target)
    assert hybrid.model_type == "qwen3_5_moe" and hybrid.moe.sparse_layers == (0, 1, 2, 3)
    assert hybrid.moe.shared_expert_size == 16 and hybrid.moe.norm_topk_prob
    assert hybrid.dims.intermediate_size == 0  # Qwen3.5 MoE configs name no dense width
    target = load_target(make_pair(**CONFIGS["qwen3-moe-per-expert-dense-layer"][0]).target)
    assert [isinstance(layer.mlp, SparseMoeBlock) for layer in target.model.layers] == [True, False, True]
    packed = load_target(make_pair(**QWEN3_5_MOE).target).model.layers[0].mlp
    assert packed.packed_shared and packed.experts.gate_up_proj.shape == (9, 32, 64)  # 8 routed + shared
    assert packed.router.weight.shape == (9, 64) and not hasattr(packed, "shared_expert")
    wider = load_target(make_pair(**CONFIGS["qwen3.5-moe-wider-shared-expert"][0]).target).model.layers[0].mlp
    assert not wider.packed_shared and wider.experts.gate_up_proj.shape == (8, 32, 64)


def test_packed_engine_weights_load_back(make_pair, tmp_path):
    """`build` stores the experts packed under the runtime's names; they load back bit for bit."""
    for name in ("qwen3-moe-per-expert-dense-layer", "qwen3.5-moe-multimodal-packed",
                 "qwen3.5-moe-wider-shared-expert"):
        pair = make_pair(**CONFIGS[name][0])
        target = load_target(pair.target)
        _save_model(target, tmp_path / name, pair.target)
        packed = load_target(tmp_path / name)
        ids = [1, 2, 3, 4, 5]
        a, _ = forward(target, target.new_cache(1, 8), 0, ids, 0)
        b, _ = forward(packed, packed.new_cache(1, 8), 0, ids, 0)
        assert torch.equal(a, b), name


CONFIG_ERRORS = [
    ("qwen3", {"num_experts_per_tok": 9}, r"key 'num_experts_per_tok' = 9 exceeds num_experts = 8"),
    ("qwen3", {"moe_intermediate_size": ...}, r"required key 'moe_intermediate_size' is missing"),
    ("qwen3", {"num_experts": 0}, r"key 'num_experts' must be > 0, got 0"),
    ("qwen3", {"mlp_only_layers": [3]}, r"key 'mlp_only_layers' must list layer indices in \[0, 3\), got \[3\]"),
    ("qwen3", {"norm_topk_prob": "yes"}, r"key 'norm_topk_prob' must be bool"),
    ("qwen3", {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}},
     r"key 'quantization_config' names a quantized checkpoint \(quant_method 'fp8'\)"),
    ("qwen3.5", {"text_config.shared_expert_intermediate_size": ...},
     r"required key 'text_config.shared_expert_intermediate_size' is missing"),
    ("qwen3.5", {"text_config.model_type": "qwen3_5_text"},
     r"key 'text_config.model_type' is 'qwen3_5_text'; expected 'qwen3_5_moe_text'"),
    ("qwen3.5", {"quantization_config": {"quant_method": "fp8"}},
     r"key 'quantization_config' names a quantized checkpoint"),
]


@pytest.mark.parametrize("family, changes, message", CONFIG_ERRORS)
def test_bad_moe_config_values_are_named_in_the_error(make_pair, tmp_path, family, changes, message):
    source = make_pair(**(CONFIGS["qwen3-moe-per-expert-dense-layer"][0] if family == "qwen3" else QWEN3_5_MOE))
    shutil.copytree(source.target, tmp_path / "target")
    edit_json(tmp_path / "target" / "config.json", **changes)
    with pytest.raises(ConfigError, match=r"target/config.json: .*" + message):
        load_target(tmp_path / "target")


def test_a_missing_or_misshapen_expert_tensor_is_named(make_pair, tmp_path):
    from safetensors.torch import load_file, save_file

    source = make_pair(**CONFIGS["qwen3-moe-per-expert-dense-layer"][0])
    for case, edit in (("missing", lambda t: t.pop("model.layers.2.mlp.experts.7.up_proj.weight")),
                       ("misshapen", lambda t: t.update({"model.layers.0.mlp.experts.3.down_proj.weight":
                                                         torch.zeros(24, 64)}))):
        target = tmp_path / case
        shutil.copytree(source.target, target)
        tensors = load_file(target / "model.safetensors")
        edit(tensors)
        save_file(tensors, target / "model.safetensors")
        with pytest.raises(CheckpointError) as error:
            load_target(target)
        if case == "missing":
            assert "tensor 'model.layers.2.mlp.experts.7.up_proj.weight' is missing" in str(error.value)
        else:
            assert "model.layers.0.mlp.experts.3.down_proj.weight(24, 64)" in str(error.value)
            assert "parameter 'model.layers.0.mlp.experts.down_proj'" in str(error.value)


LOSSLESS_PAIRS = {
    "qwen3-moe": dict(**{**QWEN3_MOE, "num_layers": 4}, mlp_only_layers=(2,), target_layer_ids=(1, 3)),
    "qwen3.5-moe": dict(**QWEN3_5_MOE, target_layer_ids=(1, 3)),
}
PROMPTS = [[7], [3, 1, 4], [10, 20, 30, 40, 50, 60, 70], list(range(100, 119))]
PARAMS = SamplingParams(max_tokens=19, ignore_eos=True)


@pytest.fixture(scope="module")
def moe_engine(make_pair, device):
    made = {}

    def get(name, block_size):
        if (name, block_size) not in made:
            pair = make_pair(**LOSSLESS_PAIRS[name], block_size=block_size)
            engine = load_pair(pair.target, pair.drafter, device=device, max_seq_len=96, max_batch_size=8)
            made[name, block_size] = engine, engine.generate(PROMPTS, PARAMS, mode="ar")
        return made[name, block_size]

    return get


@pytest.mark.parametrize("oracle", ORACLES)
@pytest.mark.parametrize("name, block_size", [("qwen3-moe", 4), ("qwen3-moe", 16), ("qwen3.5-moe", 8)])
def test_greedy_dflash_equals_ar_on_an_moe_target(moe_engine, name, block_size, oracle):
    engine, ar = moe_engine(name, block_size)
    dflash = dflash_with_oracle(engine, PROMPTS, PARAMS, ar, ORACLES[oracle])
    assert [d.token_ids for d in dflash] == [a.token_ids for a in ar]
    lengths = [n for d in dflash for n in d.stats.acceptance_lengths[:-1]]
    if oracle == "full-acceptance":
        assert set(lengths) == {block_size}
    if oracle == "bonus-only":  # the drafter's own drafts follow; a random one rarely agrees
        assert lengths.count(1) >= 0.9 * len(lengths)


def test_the_real_drafter_runs_on_an_moe_target_too(moe_engine):
    """No oracle: the (random) drafter's own blocks are verified; output still equals AR."""
    engine, ar = moe_engine("qwen3.5-moe", 8)
    dflash = engine.generate(PROMPTS, PARAMS, mode="dflash")
    assert [d.token_ids for d in dflash] == [a.token_ids for a in ar]
