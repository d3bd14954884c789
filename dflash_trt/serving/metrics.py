"""Prometheus metrics of the dflash model, on Triton's metrics port (`/metrics`), through the
Python backend's custom-metric API, so no second HTTP server is needed.

Counters of output, draft and accepted draft tokens and of verify steps, and the histogram of
acceptance lengths (tokens a verify step produced), are added when a request ends, from the
same statistics its own perf metrics report, so the scraped totals and the responses' figures
add up exactly. Gauges (running and waiting requests, KV-cache slots in use) follow each
engine step. Every series carries the labels model and version.
"""

from __future__ import annotations

from dflash_trt.serving import protocol as p
from dflash_trt.serving.worker import perf_metrics

PREFIX = "dflash_"


class TritonMetrics:
    """`pb_utils`: triton_python_backend_utils (only the stub can import it, so the adapter
    hands it over); `block_size`: the engine's, the histogram's top bucket."""

    def __init__(self, pb_utils, labels: dict[str, str], block_size: int):
        kinds = pb_utils.MetricFamily
        self._families = []  # a family must outlive its metrics: deleting it disables them

        def metric(name: str, description: str, kind, **kwargs):
            self._families.append(kinds(name=PREFIX + name, description=description, kind=kind))
            return self._families[-1].Metric(labels=labels, **kwargs)

        self.output_tokens = metric("output_tokens_total", "tokens returned to clients", kinds.COUNTER)
        self.draft_tokens = metric("draft_tokens_total", "tokens the drafter proposed", kinds.COUNTER)
        self.accepted_tokens = metric("accepted_draft_tokens_total", "proposed tokens the target kept",
                                      kinds.COUNTER)
        self.verify_steps = metric("verify_steps_total", "draft/verify steps", kinds.COUNTER)
        self.acceptance = metric("acceptance_length", "tokens one verify step produced (accepted drafts + 1)",
                                 kinds.HISTOGRAM, buckets=[float(b) for b in range(1, block_size + 1)])
        self.running = metric("running_requests", "requests in the engine's batch", kinds.GAUGE)
        self.waiting = metric("waiting_requests", "requests waiting for a KV-cache slot", kinds.GAUGE)
        self.kv_slots = metric("kv_slots_used", "KV-cache slots held by requests", kinds.GAUGE)
        self.block_size = block_size

    def request_ended(self, stats, num_output_tokens: int) -> None:
        figures = perf_metrics(stats, self.block_size, num_output_tokens)
        self.output_tokens.increment(num_output_tokens)
        self.draft_tokens.increment(figures[p.TOTAL_DRAFT_TOKENS])
        self.accepted_tokens.increment(figures[p.TOTAL_ACCEPTED_DRAFT_TOKENS])
        self.verify_steps.increment(stats.verify_steps)
        for length in stats.acceptance_lengths:
            self.acceptance.observe(float(length))

    def engine_state(self, running: int, waiting: int, slots_used: int) -> None:
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_slots.set(slots_used)
