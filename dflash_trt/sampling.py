"""Per-request sampling settings and the target distribution they define."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from dflash_trt.errors import RequestError


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request is decoded. temperature 0 is greedy; top_k 0 and top_p 1 are off."""

    max_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default=())
    ignore_eos: bool = False

    def __post_init__(self):
        checks = [
            ("max_tokens", self.max_tokens, isinstance(self.max_tokens, int) and self.max_tokens > 0, "an int > 0"),
            ("temperature", self.temperature, _finite(self.temperature) and self.temperature >= 0, "a number >= 0"),
            ("top_k", self.top_k, isinstance(self.top_k, int) and self.top_k >= 0, "an int >= 0"),
            ("top_p", self.top_p, _finite(self.top_p) and 0 < self.top_p <= 1, "in (0, 1]"),
            ("seed", self.seed, self.seed is None or isinstance(self.seed, int), "an int"),
        ]
        for name, value, ok, expected in checks:
            if not ok:
                raise RequestError(f"sampling parameter '{name}' must be {expected}, got {value!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a sampling request draws from: logits [..., V] -> probs [..., V] (fp32).

    Temperature first, then top-k, then top-p over what top-k kept (the usual HF / vLLM order).
    """
    logits = logits.float() / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(dim=-1)
    if params.top_p < 1:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Drop a token when the mass before it already reaches top_p; the top token always stays.
        drop_sorted = sorted_probs.cumsum(dim=-1) - sorted_probs >= params.top_p
        probs = probs.masked_fill(torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted), 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def gumbel_noise(vocab: int, generators: list[torch.Generator | None], device) -> torch.Tensor:
    """Gumbel(0, 1) noise [len(generators), vocab], row b from generators[b]: argmax(log p +
    noise) is a draw from p (the Gumbel-max trick). Drawn for the whole vocabulary even by a
    rank that holds a slice of it, so every rank's generator stays in step and their slices
    together are one device's noise. A row's numbers are its generator's alone: they do not
    depend on which other rows are drawn beside it."""
    u = torch.empty(len(generators), vocab, device=device)
    for row, generator in zip(u, generators):
        torch.rand(vocab, generator=generator, device=device, out=row)
    return -torch.log(-torch.log(u.clamp(min=torch.finfo(u.dtype).tiny)))


class Distribution:
    """The target distributions of B positions of one request (probs [B, V] of target_probs),
    as the sampling steps use them. Tensor parallelism swaps in one over vocabulary slices
    (parallel.py) with the same two methods."""

    def __init__(self, logits: torch.Tensor, params: SamplingParams):
        self.probs = target_probs(logits, params)

    def prob(self, position: int, token: int) -> float:
        return float(self.probs[position, token])

    def sample(self, position: int, generator: torch.Generator | None, exclude: int | None = None) -> int:
        """A draw from position's distribution; `exclude`: with that token removed, renormalised."""
        logp = self.probs[position].log()
        if exclude is not None:
            logp[exclude] = float("-inf")
        noise = gumbel_noise(logp.shape[-1], [generator], logp.device)[0]
        return int((logp + noise).argmax())

    def sample_rows(self, generators: list[torch.Generator | None]) -> torch.Tensor:
        """A draw at every position, position b's with generators[b], left on the device: a
        batch of sampled rows costs one host sync, not one a row."""
        logp = self.probs.log()
        return (logp + gumbel_noise(logp.shape[-1], generators, logp.device)).argmax(dim=-1)
