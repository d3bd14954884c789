"""Environment variables keep one meaning each, and a kernel never falls back silently."""

import logging

import pytest
import torch

from dflash_trt import ops
from dflash_trt.config import cache_dir
from dflash_trt.serving import server


def test_dflash_trt_cache_is_the_one_cache_root(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_TRT_CACHE", str(tmp_path / "cache"))
    assert cache_dir() == tmp_path / "cache"
    root = server._bundled_root()
    if root is None:
        pytest.skip("nvidia-pytriton is not installed")
    assert server._prepare_backend_dir(root).is_relative_to(tmp_path / "cache" / "triton-backends")


def test_without_dflash_trt_cache_the_cache_follows_xdg(tmp_path, monkeypatch):
    monkeypatch.delenv("DFLASH_TRT_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_dir() == tmp_path / "dflash-trt"


def test_the_cpu_reference_path_logs_nothing(caplog):
    x = torch.randn(2, 8)
    with caplog.at_level(logging.WARNING, logger="dflash_trt"):
        ops.rms_norm(x, torch.ones(8), 1e-6)
    assert not caplog.records


@pytest.mark.cuda
def test_a_cuda_op_that_takes_its_reference_says_so_once(caplog):
    x = torch.randn(2, 8, device="cuda")  # fp32: the fused layer kernels cover bf16/fp16 only
    ops._warn_once.cache_clear()  # an earlier test may have taken this path already
    with caplog.at_level(logging.WARNING, logger="dflash_trt"):
        for _ in range(3):
            ops.silu_mul(x)
    messages = [r.getMessage() for r in caplog.records if "silu_mul" in r.getMessage()]
    assert len(messages) == 1 and "runs its PyTorch reference" in messages[0], messages
