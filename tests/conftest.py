import importlib
import os
from pathlib import Path

import pytest
import torch

from dflash_trt import fa3
from dflash_trt.fixtures.pair import TinyPairSpec, write_tiny_pair


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def attention_backend_choice_reset():
    """Engine.warm_up may let FlashAttention-3 run some shapes (dflash_trt/fa3.py, process
    state, where the wheel is installed): no test inherits another's choice."""
    yield
    fa3.use(set())


@pytest.fixture
def transformers_torch_paths(monkeypatch):
    """transformers' Qwen3.5 models take fla's Triton kernels for the gated delta rule (and
    causal-conv1d's for the conv) whenever those packages import, whatever the tensors' device:
    a CPU reference on a machine that has fla launched them on CPU tensors. Their torch code is
    the reference we compare with, so the tests put it back."""
    for name in ("qwen3_5", "qwen3_5_moe"):
        module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
        for fn in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
                   "causal_conv1d_update"):
            wrapped = getattr(getattr(module, fn), "__wrapped__", None)
            if wrapped is not None:
                monkeypatch.setattr(module, fn, wrapped)


@pytest.fixture(scope="session")
def make_pair(tmp_path_factory):
    """Write (once per spec) a tiny pair and return its paths."""
    cache = {}

    def make(**fields):
        spec = TinyPairSpec(**fields)
        key = repr(spec)
        if key not in cache:
            cache[key] = write_tiny_pair(tmp_path_factory.mktemp("pair"), spec)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def no_tokenizer():
    """Spec fields for a pair without a tokenizer (faster to write; ids only)."""
    return {"tokenizer_tokens": None, "vocab_size": 512}


@pytest.fixture(scope="session")
def device():
    """Where engine tests run: DFLASH_TEST_DEVICE=cuda runs them on the GPU (fp32)."""
    return os.environ.get("DFLASH_TEST_DEVICE", "cpu")


def write_report(request, lines: list[str], env_var: str) -> None:
    """A GPU test module's closing statistics: to pytest's terminal, and to the file $env_var names."""
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        for line in lines:
            reporter.write_line(line)
    if os.environ.get(env_var):
        Path(os.environ[env_var]).write_text("\n".join(lines) + "\n")
