"""A real tritonserver serving a tiny Qwen3.5 hybrid pair (Gated DeltaNet + gated attention
target in the released multimodal layout, Qwen3.5-style drafter), built with `dflash-trt build`
from real safetensors and a real Qwen3.5-family tokenizer, with dense MLPs and as a mixture
of experts (the Qwen3.5/3.6 MoE layout). Served outputs must equal the in-process engine's
greedy output, also when concurrent requests of different lengths share DFlash batches."""

import dataclasses
import json
import threading

import pytest
from click.testing import CliRunner
from safetensors.torch import load_file, save_file
from triton_clients import (  # noqa: F401 (server, local, expected: fixtures)
    MAX_TOKENS,
    TIMEOUT_S,
    InferenceServerException,
    expected,
    expected_text,
    grpc_infer,
    grpc_stream,
    http_client,
    http_infer,
    local,
    post,
    server,
    text_of,
)

from dflash_trt.cli import cli
from dflash_trt.fixtures.pair import TinyPairSpec, write_tiny_pair
from dflash_trt.sampling import SamplingParams
from dflash_trt.serving import protocol as p
from dflash_trt.serving.worker import perf_metrics
from dflash_trt.tokenizer import Tokenizer

pytestmark = pytest.mark.slow

# Qwen3.5-family drafter settings: RoPE theta 1e7, explicit taps (a linear and a full target
# layer), one sliding-window layer; the target has 3 linear-attention layers and 1 full.
SPEC = TinyPairSpec(target_type="qwen3_5", multimodal=True, tokenizer_tokens=4000, head_dim=32, rope_theta=1e7,
                    draft_rope_theta=1e7, target_layer_ids=(1, 3), block_size=8,
                    draft_layer_types=("sliding_attention", "full_attention"), sliding_window=8)
SPECS = {"dense": SPEC, "moe": dataclasses.replace(SPEC, num_experts=8, experts_per_tok=2, moe_intermediate_size=32,
                                                   shared_expert_size=32)}
# An untrained drafter never agrees with a random target, so every verify would keep only its
# bonus token. Scaling up three lm_head rows (the drafter uses the target's lm_head) makes both
# models lean to those tokens: drafts are sometimes accepted, and rows of one batch commit
# different lengths, which is the hybrid cache's per-row snapshot cut.
FAVOURED_WORDS, FAVOUR = (" is", " for", " that"), 6.0
MAX_OUTPUT_LEN = 64
PROMPTS = {"Hello": 32, "你好，世界": 11, "The capital of France is": 25, "def f(x):\n    return": 18}


def finish_pair(pair):
    """What write_tiny_pair does not do: move the chat template to chat_template.jinja, where
    Qwen3.5 checkpoints keep it (tokenizer_config.json then has none), and favour the words."""
    config_file = pair.target / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    (pair.target / "chat_template.jinja").write_text(config.pop("chat_template"))
    config_file.write_text(json.dumps(config, indent=2))
    favoured = [Tokenizer.from_dir(pair.target).encode(word)[0] for word in FAVOURED_WORDS]
    weights = load_file(pair.target / "model.safetensors")
    weights["lm_head.weight"][favoured] *= FAVOUR
    save_file(weights, pair.target / "model.safetensors", metadata={"format": "pt"})


@pytest.fixture(scope="module", params=list(SPECS))
def engine_dir(tmp_path_factory, request):
    root = tmp_path_factory.mktemp(f"hybrid-{request.param}")
    pair = write_tiny_pair(root / "pair", SPECS[request.param])
    finish_pair(pair)
    out = root / "out"
    args = ["build", "--target", str(pair.target), "--drafter", str(pair.drafter), "-o", str(out),
            "--max-batch-size", "4", "--max-input-len", "128", "--max-output-len", str(MAX_OUTPUT_LEN)]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == str(out)
    return out




def test_the_build_keeps_the_qwen3_5_tokenizer_files_and_the_hybrid_target(engine_dir, local):
    assert (engine_dir / "engine" / "tokenizer" / "chat_template.jinja").is_file()
    assert local.engine.target.stateful and local.engine.target_cache.num_snapshots == local.engine.block_size == 8
    assert local.engine.drafter.config.layer_types == ("sliding_attention", "full_attention")
    moe = local.engine.target.config.moe
    assert (moe is not None) == ("moe" in engine_dir.parent.name)
    if moe is not None:  # the engine stores the experts packed, as the kernels read them
        packed = load_file(engine_dir / "engine" / "target" / "model.safetensors")
        # the shared expert packed as a ninth
        assert packed["model.layers.0.mlp.experts.gate_up_proj"].shape == (9, 64, SPEC.hidden_size)
        assert moe.num_experts == 8 and moe.shared_expert_size > 0


def test_http_infer_grpc_stream_and_generate_return_the_in_process_greedy_text(server, local, expected):
    prompt = "你好，世界"
    want = expected_text(local, expected, prompt)
    assert text_of(http_infer(server, text=prompt, exclude_input_in_output=True)) == want
    # TensorRT-LLM's default: the unstreamed output starts with the prompt.
    assert text_of(http_infer(server, text=prompt)) == prompt + want
    chunks = [c.decode("utf-8") for c in grpc_stream(server, text=prompt, stream=True)]
    assert len(chunks) > 1 and "".join(chunks) == want
    body = {"text_input": prompt, "max_tokens": MAX_TOKENS, "exclude_input_in_output": True}
    assert json.loads(post(server, "/v2/models/ensemble/generate", body))["text_output"] == want


def test_concurrent_clients_of_mixed_lengths_each_get_their_own_greedy_output(server, local, expected):
    # Prompts and max_tokens differ, so rows of different lengths share the DFlash batches.
    wants = {prompt: expected_text(local, expected, prompt, n) for prompt, n in PROMPTS.items()}
    assert len(set(wants.values())) == len(wants)
    calls = [  # a mix of the ways clients call
        lambda prompt, n: "".join(c.decode() for c in grpc_stream(server, text=prompt, max_tokens=n, stream=True)),
        lambda prompt, n: text_of(http_infer(server, text=prompt, max_tokens=n, exclude_input_in_output=True)),
        lambda prompt, n: grpc_infer(server, text=prompt, max_tokens=n, exclude_input_in_output=True),
        lambda prompt, n: json.loads(post(server, "/v2/models/ensemble/generate",
                                          {"text_input": prompt, "max_tokens": n,
                                           "exclude_input_in_output": True}))["text_output"],
    ]
    got, errors, start = {}, [], threading.Barrier(len(PROMPTS))

    def client(i, prompt):
        try:
            start.wait(TIMEOUT_S)
            got[prompt] = calls[i % len(calls)](prompt, PROMPTS[prompt])
        except Exception as e:  # reported below, with the prompt
            errors.append((prompt, e))

    threads = [threading.Thread(target=client, args=(i, prompt)) for i, prompt in enumerate(PROMPTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S)
    assert not errors
    assert got == wants


def test_chat_applies_the_qwen3_5_chat_template_with_thinking_off(server, local, expected):
    chat = local.tokenizer.apply_chat_template([{"role": "user", "content": "Hi!"}], enable_thinking=False)
    assert chat.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    want = expected_text(local, expected, chat)
    assert text_of(http_infer(server, text="Hi!", chat=True, exclude_input_in_output=True)) == want


def test_perf_metrics_report_the_drafted_and_accepted_tokens(server, local, expected):
    tok, prompt = local.tokenizer, "The capital of France is"
    params = SamplingParams(max_tokens=MAX_TOKENS, stop_token_ids=tuple(tok.stop_token_ids))
    run = local.engine.generate([tok.encode(prompt)], params, mode="dflash")[0]
    assert run.token_ids[:len(expected(prompt))] == expected(prompt)  # lossless in-process too
    want = perf_metrics(run.stats, local.engine.block_size, len(expected(prompt)))
    result = http_infer(server, text=prompt, return_perf_metrics=True)
    got = {name: result.as_numpy(name)[0, 0].item() for name in want}
    assert got == pytest.approx(want)
    assert got[p.TOTAL_DRAFT_TOKENS] == run.stats.verify_steps * (local.engine.block_size - 1) > 0
    assert got[p.TOTAL_ACCEPTED_DRAFT_TOKENS] > 0, "no draft accepted: favour other tokens (FAVOURED_WORDS)"


def test_a_bad_request_gets_a_clear_error_and_the_server_serves_on(server, local, expected):
    too_long = f"'max_tokens' is {MAX_OUTPUT_LEN + 1}, more than this engine's max_output_len = {MAX_OUTPUT_LEN}"
    with pytest.raises(InferenceServerException, match=too_long):
        http_infer(server, text="Hello", max_tokens=MAX_OUTPUT_LEN + 1)
    with pytest.raises(InferenceServerException, match="'max_tokens' must be an int > 0"):
        grpc_stream(server, text="Hello", max_tokens=0, stream=True)
    with http_client(server) as client:
        assert client.is_server_live() and client.is_model_ready(p.ENSEMBLE)
    got = http_infer(server, text="Hello", max_tokens=8, exclude_input_in_output=True)
    assert text_of(got) == expected_text(local, expected, "Hello", 8)
