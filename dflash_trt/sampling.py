"""Per-request sampling settings and the target distribution they define."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

import torch

from dflash_trt import ops
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

    Temperature first, then top-k (every token tied with the k-th stays), then top-p over what
    top-k kept (the usual HF / vLLM order): a token is dropped when the mass of the tokens
    before it in descending order already reaches top_p. Among tokens of equal probability
    that order is the sort's (top-p alone), or top-k's own picks first and then token order.
    Logits in bf16 (the LM head's) are ranked as they come: the order of their probabilities,
    found with half the key bits of fp32.
    """
    given = logits
    logits = logits.float() / params.temperature
    top = None
    if params.top_k and params.top_k < logits.shape[-1]:
        top = given.topk(params.top_k, dim=-1)
        kth = top.values[..., -1:].float() / params.temperature  # exactly the k-th of `logits`
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(dim=-1)
    if params.top_p < 1:
        drop = _past_the_nucleus(probs, params.top_p, given) if top is None else \
            _past_the_nucleus_of_top_k(probs, logits, top.indices, kth, params.top_p)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def _past_the_nucleus(probs: torch.Tensor, top_p: float, order_by: torch.Tensor) -> torch.Tensor:
    """Where top-p drops a token, from the whole vocabulary sorted (the top token always stays)
    by `order_by`: probs, or the logits they came from (their order, in fewer bits)."""
    order = order_by.sort(dim=-1, descending=True).indices
    sorted_probs = probs.gather(-1, order)
    drop_sorted = sorted_probs.cumsum(dim=-1) - sorted_probs >= top_p
    return torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)


def _past_the_nucleus_of_top_k(probs: torch.Tensor, logits: torch.Tensor, picks: torch.Tensor, kth: torch.Tensor,
                               top_p: float) -> torch.Tensor:
    """_past_the_nucleus where top-k kept its k picks (their indices in descending order) and
    the tokens tied with the k-th (logit kth): only those can be in the nucleus, so only the k
    are ordered (a sort of the whole vocabulary at every verify position cost more than the
    rest of the rule); the tied ones follow them in token order, all of probability p_k."""
    picked = probs.gather(-1, picks)
    before = picked.cumsum(dim=-1) - picked
    drop = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, picks, before >= top_p)
    tied = (logits == kth).scatter(-1, picks, False)
    rank = tied.cumsum(dim=-1) - 1  # among the tied ones
    mass = picked.sum(dim=-1, keepdim=True) + rank * picked[..., -1:]
    return drop | (tied & (mass >= top_p))


def draw_keys(seqs: list, count: int, device) -> torch.Tensor:
    """The keys [len(seqs), count] of each sequence's next `count` draws (ops.random_uniform),
    on the device, each a function of the request's seed and how many draws it made before
    (seq.seed, seq.draws, which this advances): a seeded request draws the same numbers
    whatever rows are beside it. Copied from pinned memory without blocking (no stream sync)."""
    keys = []
    for seq in seqs:
        keys += [stream_key(seq.seed, seq.draws + j) for j in range(count)]
        seq.draws += count
    host = torch.tensor(keys, dtype=torch.int64, pin_memory=torch.device(device).type == "cuda")
    return host.to(device, non_blocking=True).view(len(seqs), count)


def stream_key(seed: int, draw: int) -> int:
    """The key of a request's draw-th draw: its seed and the count through two rounds of the
    kernel's mix (a bijection of 64-bit values), so distinct (seed, draw) give distinct keys
    whose streams do not overlap in practice."""
    return ops.as_int64(ops.random_mix(ops.random_mix(seed) + draw))


def gumbel_noise(size: int, keys: torch.Tensor) -> torch.Tensor:
    """Gumbel(0, 1) noise [len(keys), size] (size: a row's positions times the vocabulary),
    row b from keys[b] alone: argmax(log p + noise) is a draw from p (the Gumbel-max trick).
    Drawn for the whole vocabulary even by a rank that holds a slice of it, so the ranks'
    slices together are one device's noise."""
    return ops.random_uniform(keys.contiguous(), size, gumbel=True)


def sampled_groups(params: list[SamplingParams]) -> list[list[int]]:
    """The indices of the requests that sample, grouped by the distribution their settings
    define: each group's rows are drawn together (one distribution over their logits)."""
    groups: dict[tuple, list[int]] = {}
    for i, p in enumerate(params):
        if not p.greedy:
            groups.setdefault((p.temperature, p.top_k, p.top_p), []).append(i)
    return list(groups.values())


def row_index(rows: list[int], device: torch.device) -> slice | torch.Tensor:
    """Rows of a batch as an index that costs no host sync: a slice where they are consecutive
    (the usual case: every row samples alike), else a tensor copied from pinned memory without
    blocking. A Python list would be copied to the GPU with a stream sync, waiting for the
    step queued ahead."""
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return slice(rows[0], rows[0] + len(rows))
    index = torch.tensor(rows, pin_memory=device.type == "cuda")
    return index.to(device, non_blocking=True)


class Distribution:
    """The target distributions of a group of requests, one row each (probs [n, ..., V] of
    target_probs: one position a row for an AR step, a block's for a verify), as the sampling
    steps use them. Row r's randomness comes from its key (draw_keys) alone. Tensor
    parallelism swaps in one over vocabulary slices (parallel.py) with the same methods."""

    def __init__(self, logits: torch.Tensor, params: SamplingParams):
        self.probs = target_probs(logits, params)

    def probs_of(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [n, J] -> [n, J]: each row's probability of its token j at position j."""
        return self.probs[:, :tokens.shape[1]].gather(-1, tokens[..., None])[..., 0]

    def at(self, positions: torch.Tensor) -> "Distribution":
        """The distributions [n, 1, V] at one position per row (positions [n], on the device)."""
        picked = copy.copy(self)
        picked.probs = self.probs[torch.arange(len(positions), device=positions.device), positions][:, None]
        return picked

    def draw(self, keys: torch.Tensor, exclude: torch.Tensor | None = None) -> torch.Tensor:
        """A draw at every position of every row ([n, ...]) with row r's noise from keys[r], on
        the device; `exclude` [n, J]: at position j < J a row's token j (none where it is -1)
        is removed and the rest renormalised."""
        score = gumbel_noise(self.probs[0].numel(), keys).view_as(self.probs)
        score += self.probs.log()
        if exclude is not None:
            index, removed = exclude.clamp(min=0)[..., None], (exclude >= 0)[..., None]
            part = score[:, :exclude.shape[1]]
            part.scatter_(-1, index, torch.where(removed, float("-inf"), part.gather(-1, index)))
        return score.argmax(dim=-1)
