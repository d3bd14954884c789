"""Sampling's counter-based random numbers (plugins/random.cu, ops.random_uniform): the reference
is the 64-bit arithmetic of plugins/random.h (checked against Python's integers), its numbers
are uniform, independent across keys and never 0 or 1; a request's keys follow its seed and
draw count alone; on the GPU the kernel draws the reference's uniforms bit for bit and its
noise to logf's last place (cuda marker)."""

import math

import pytest
import torch
from scipy.stats import chisquare

from dflash_trt import ops, sampling
from dflash_trt.sequence import Sequence
from dflash_trt.sampling import SamplingParams

WEYL = 0x9E3779B97F4A7C15


def uniform_by_definition(key: int, i: int) -> float:
    """plugins/random.h for one element, on Python's unbounded integers."""
    x = ops.random_mix(key + (i + 1) * WEYL)
    return ((x >> 41) + 0.5) * 2.0 ** -23


def test_the_reference_is_the_64_bit_arithmetic_of_random_h():
    keys = [0, 1, 2**62 + 12345, 2**63, 2**64 - 1]  # wrapping products and sums, the sign bit
    u = ops.random_uniform_reference(torch.tensor([ops.as_int64(k) for k in keys]), 9)
    assert u.dtype == torch.float32 and u.shape == (5, 9)
    assert u.tolist() == [[uniform_by_definition(k, i) for i in range(9)] for k in keys]


def test_uniforms_are_uniform_and_never_0_or_1():
    u = ops.random_uniform_reference(torch.arange(200), 5000).flatten()
    assert 0 < u.min().item() and u.max().item() < 1
    counts = torch.histc(u, bins=100, min=0, max=1)
    assert chisquare(counts.numpy()).pvalue > 1e-3
    assert ops.random_uniform_reference(torch.tensor([0]), 1).item() != 0.5  # not a constant


def test_neighbouring_keys_and_elements_are_uncorrelated():
    u = ops.random_uniform_reference(torch.arange(2), 100_000) - 0.5
    bound = 4 / math.sqrt(100_000) * (1 / 12)  # four standard errors of a covariance
    assert abs((u[0] * u[1]).mean().item()) < bound
    assert abs((u[0, 1:] * u[0, :-1]).mean().item()) < bound


def test_gumbel_noise_is_minus_log_minus_log_of_the_uniforms():
    keys = torch.tensor([3, -7])
    u = ops.random_uniform_reference(keys, 50)
    torch.testing.assert_close(ops.random_uniform_reference(keys, 50, gumbel=True), -torch.log(-torch.log(u)))
    assert ops.random_uniform(keys, 50, gumbel=True).isfinite().all()


def test_a_requests_keys_follow_its_seed_and_draw_count_alone():
    seqs = [Sequence(i, [1], SamplingParams(temperature=1.0), frozenset(), seed) for i, seed in enumerate((5, 9, 5))]
    first = sampling.draw_keys(seqs, 2, "cpu")
    assert [s.draws for s in seqs] == [2, 2, 2]
    assert first[0].tolist() == first[2].tolist() and first[0].tolist() != first[1].tolist()
    assert first[0].tolist() == [sampling.stream_key(5, 0), sampling.stream_key(5, 1)]
    assert sampling.draw_keys(seqs[:1], 1, "cpu")[0, 0].item() == sampling.stream_key(5, 2)  # on from the count
    assert len({sampling.stream_key(s, d) for s in range(50) for d in range(50)}) == 2500


@pytest.mark.parametrize("keys, cols, message", [
    (torch.tensor([1, 2], dtype=torch.int32), 3, "keys must be a contiguous int64 \\[R\\] tensor, got torch.int32"),
    (torch.zeros(2, 2, dtype=torch.long), 3, "keys must be a contiguous int64 \\[R\\] tensor"),
    (torch.zeros(4, dtype=torch.long)[::2], 3, "keys must be a contiguous int64"),
    (torch.zeros(2, dtype=torch.long), -1, "cols must be an int >= 0, got -1"),
])
def test_random_uniform_rejects_bad_arguments_naming_them(keys, cols, message):
    with pytest.raises(AssertionError, match=message):
        ops.random_uniform(keys, cols)


@pytest.mark.cuda
@pytest.mark.parametrize("rows, cols", [(1, 1), (3, 1000), (32, 16 * 151936), (0, 5), (2, 0)])
def test_kernel_draws_the_references_numbers(rows, cols):
    keys = torch.tensor([sampling.stream_key(r, 7) for r in range(rows)], dtype=torch.long, device="cuda")
    u = ops.random_uniform(keys, cols)
    assert u.shape == (rows, cols) and u.dtype == torch.float32 and u.is_cuda
    assert torch.equal(u, ops.random_uniform_reference(keys, cols))
    noise = ops.random_uniform(keys, cols, gumbel=True)
    torch.testing.assert_close(noise, ops.random_uniform_reference(keys, cols, gumbel=True), rtol=2e-6, atol=2e-6)
