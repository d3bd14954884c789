"""GPU serving (skipped without CUDA): engines built with --device cuda, served by the real
tritonserver, queried over gRPC: one streaming request and 8 concurrent requests."""

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from ports import free_ports

from dflash_trt.build import run
from dflash_trt.config import resolve_config
from dflash_trt.fixtures.pair import TinyPairSpec, write_tiny_pair
from dflash_trt.serving import client

pytestmark = pytest.mark.cuda

# About 1.2B target parameters (12 Qwen3-1.7B-shaped layers, the full Qwen3 vocabulary,
# untied head), random weights, the real Qwen3 tokenizer.
ONE_B = TinyPairSpec(hidden_size=2048, intermediate_size=6144, num_layers=12, num_heads=16, num_kv_heads=8,
                     head_dim=128, draft_layers=2, target_layer_ids=(1, 5, 9), block_size=16,
                     tokenizer_tokens=None, dtype="bfloat16", init_scale=0.5)


@pytest.fixture(scope="module", params=["tiny-demo", "random-1b"])
def served(request, tmp_path_factory):
    from dflash_trt.serving.server import TritonServer

    tmp = tmp_path_factory.mktemp(request.param)
    start = time.perf_counter()
    if request.param == "tiny-demo":
        config = resolve_config("tiny", device="cuda")
    else:
        # the full Qwen3 vocabulary: 151669 tokens, embedding rows padded to 151936 as in Qwen3
        spec = TinyPairSpec(**{**ONE_B.__dict__, "tokenizer_tokens": 151643, "vocab_size": 151936})
        pair = write_tiny_pair(tmp / "src", spec)
        config = resolve_config(None, None, target=str(pair.target), drafter=str(pair.drafter), device="cuda",
                                max_batch_size=8, max_input_len=1024, max_output_len=256)
    out = run(config, tmp / "out")
    built = time.perf_counter() - start
    http, grpc, metrics = free_ports(3)
    server = TritonServer(out / "model_repository", http_port=http, grpc_port=grpc, metrics_port=metrics,
                          host="127.0.0.1")
    endpoints = server.start(timeout=600)
    print(f"\n[{request.param}] built in {built:.1f}s, server ready in {time.perf_counter() - start - built:.1f}s")
    yield request.param, endpoints
    server.stop()


def ask(endpoints, prompt, stream=False, max_tokens=64):
    completion = client.Completion()
    start = time.perf_counter()
    chunks = list(client.generate(endpoints.grpc, prompt, stream=stream, completion=completion, max_tokens=max_tokens,
                                  temperature=0.0, top_k=0, top_p=1.0, seed=None, chat=True, thinking=False,
                                  stats=True))
    return chunks, completion, time.perf_counter() - start


def test_streaming_request_through_triton_on_the_gpu(served):
    name, endpoints = served
    chunks, completion, elapsed = ask(endpoints, "Write a quicksort in Python.", stream=True)
    _, whole, _ = ask(endpoints, "Write a quicksort in Python.", stream=False)
    tokens = completion.metrics["num_output_tokens"]
    print(f"[{name}] streaming: {len(chunks)} chunks, {tokens} tokens in {elapsed:.2f}s "
          f"({tokens / elapsed:.1f} tok/s client side), acceptance rate {completion.metrics['acceptance_rate']:.3f}")
    assert len(chunks) > 1 and tokens > 0
    assert "".join(chunks) == whole.text


def test_eight_concurrent_requests_through_triton_on_the_gpu(served):
    name, endpoints = served
    prompts = [f"Question {i}: what is {i} + {i * 3}?" for i in range(8)]
    start = time.perf_counter()
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda p: ask(endpoints, p, stream=True), prompts))
    elapsed = time.perf_counter() - start
    tokens = sum(c.metrics["num_output_tokens"] for _, c, _ in results)
    print(f"[{name}] 8 concurrent streams: {tokens} tokens in {elapsed:.2f}s ({tokens / elapsed:.1f} tok/s aggregate)")
    for chunks, completion, _ in results:
        assert completion.metrics["num_output_tokens"] > 0 and "".join(chunks) == completion.text
