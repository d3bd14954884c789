"""Adaptive verify width: per step, how many of the block's tokens the target verifies.

A verify of w tokens (the bonus and w - 1 drafts) emits at most w tokens per row, and under
load it costs more the wider it is: at concurrency 32 a 16-token verify is a compute-bound
512-token pass. Any width is lossless (speculate.speculative_step), so the width is a pure
throughput choice. Per step this picks the width w of candidate_widths that maximises

    E[tokens per row | w] / (draft + verify(w) + commit(w) time of the step's batch),

with the pass times measured per batch-size bucket at warm-up (graphs.GraphedPasses.step_ms)
and E[tokens | w] = 1 + the sum over j < w of S(j), S(j) the probability that drafts 1..j are
all accepted. S is estimated from the running steps as a product of per-position acceptance
rates: a row verified at width w reports on positions up to min(accepted + 1, w - 1), so
narrower steps still inform the rates they can see; every EXPLORE-th step verifies the whole
block, so the rates past the current width stay current. Counts decay (DECAY per step):
acceptance follows the traffic.
"""

from __future__ import annotations

EXPLORE = 16  # every this many steps, the whole block (rates past the chosen width stay fresh)
DECAY = 0.995  # per step, on the acceptance counts
PRIOR = 1.0  # pseudo-counts of one acceptance per position: unseen positions look promising


def candidate_widths(block_size: int) -> tuple[int, ...]:
    """The whole block and its quarters (at least 2 tokens: the bonus and one draft)."""
    return tuple(sorted({max(2, block_size * q // 4) for q in (1, 2, 3, 4)}))


class VerifyWidth:
    def __init__(self, block_size: int, step_ms: dict[int, dict[int, float]]):
        """`step_ms[bucket][w]`: the draft + verify (+ commit) time of a step of `bucket` rows
        verifying w tokens, for every width of candidate_widths(block_size)."""
        self.block_size, self.widths = block_size, candidate_widths(block_size)
        self.step_ms = step_ms
        for bucket, times in step_ms.items():
            missing = set(self.widths) - set(times)
            assert not missing, f"bucket {bucket} has no step time for widths {sorted(missing)}"
        # Plain floats, not tensors: this runs on the host every step, between graph replays.
        self.reached = [0.0] * block_size  # [j]: rows whose draft j was accepted (decayed)
        self.at_risk = [0.0] * block_size  # [j]: rows that could show draft j
        self.steps = 0
        self._tokens = self._expected_tokens()

    def survival(self) -> list[float]:
        """S[j] for j = 0..B-1: the estimated probability that drafts 1..j are all accepted."""
        out = [1.0]
        for j in range(1, self.block_size):
            out.append(out[-1] * (self.reached[j] + PRIOR) / (self.at_risk[j] + PRIOR))
        return out

    def _expected_tokens(self) -> dict[int, float]:
        s = self.survival()
        return {w: sum(s[:w]) for w in self.widths}

    def expected_tokens(self, width: int) -> float:
        return self._tokens[width]

    def choose(self, num_rows: int) -> int:
        """The width for a step of num_rows rows (timed as the smallest measured batch that
        holds them: their CUDA-graph bucket)."""
        self.steps += 1
        if self.steps % EXPLORE == 0:
            return self.block_size
        bucket = min((b for b in self.step_ms if b >= num_rows), default=max(self.step_ms))
        times = self.step_ms[bucket]
        return max(self.widths, key=lambda w: self._tokens[w] / times[w])

    def update(self, accepted: list[int], width: int) -> None:
        """A step's accepted drafts per row, verified at `width`: a row shows drafts 1..a
        accepted and, if it was verified, draft a + 1 rejected."""
        risk_ends, reach_ends = [0] * self.block_size, [0] * self.block_size
        for a in accepted:
            risk_ends[min(a + 1, width - 1)] += 1
            reach_ends[min(a, width - 1)] += 1
        risk = reach = 0  # rows whose run reaches position j, from the top down
        for j in range(self.block_size - 1, 0, -1):
            risk, reach = risk + risk_ends[j], reach + reach_ends[j]
            self.at_risk[j] = self.at_risk[j] * DECAY + risk
            self.reached[j] = self.reached[j] * DECAY + reach
        self._tokens = self._expected_tokens()
