"""The server's Prometheus metrics (GET /metrics, prometheus-client's text format), one registry per server.

Names follow the algorithm's words (STYLE.md habit 5): tau is the acceptance length, tokens per speculative
cycle; `eagle31_cycles_by_program_total` counts the cycles of each program the calibration layer chose (the
plain step included), so a scrape shows how much the server speculates at the load it has.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from eagle_compile.runtime.stats import GenerationStats
from eagle_compile.serve.row import Row

CONTENT_TYPE = CONTENT_TYPE_LATEST
_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class ServeMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("eagle31_requests", "Finished requests by endpoint and finish reason",
                                ["endpoint", "finish_reason"], registry=r)
        self.invalid = Counter("eagle31_invalid_requests", "Requests refused with a 4xx error", ["endpoint"],
                               registry=r)
        self.prompt_tokens = Counter("eagle31_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("eagle31_generation_tokens", "Tokens generated", registry=r)
        self.request_seconds = Histogram("eagle31_request_seconds", "Arrival to last token", buckets=_SECONDS,
                                         registry=r)
        self.ttft = Histogram("eagle31_time_to_first_token_seconds", "Arrival to first token", buckets=_SECONDS,
                              registry=r)
        self.queue = Histogram("eagle31_queue_seconds", "Arrival to joining a batch", buckets=_SECONDS, registry=r)
        self.tau = Histogram("eagle31_request_tau", "Per request: tokens per speculative cycle",
                             buckets=(1, 1.25, 1.5, 1.75, 2, 2.5, 3, 4, 5, 6, 8), registry=r)
        self.batches = Counter("eagle31_batches", "Batches decoded", registry=r)
        self.batch_rows = Histogram("eagle31_batch_rows", "Requests a batch started with",
                                    buckets=(1, 2, 4, 8, 16, 32, 64), registry=r)
        self.joins = Counter("eagle31_joins", "Requests that joined a running batch", registry=r)
        self.regroups = Counter("eagle31_regroups", "Running batches moved to another batch bucket", registry=r)
        self.cycles = Counter("eagle31_cycles", "Decoding cycles (all batches)", registry=r)
        self.program_cycles = Counter("eagle31_cycles_by_program", "Cycles per program the calibration chose",
                                      ["program"], registry=r)
        self.calibration_seconds = Counter("eagle31_calibration_seconds", "Seconds spent measuring costs",
                                           registry=r)
        self.running = Gauge("eagle31_running_rows", "Requests in the running batch", registry=r)
        self.waiting = Gauge("eagle31_waiting_requests", "Requests waiting for a batch", registry=r)

    def finished(self, row: Row) -> None:
        usage = row.usage()
        self.requests.labels(row.request.kind, row.finish_reason or "unknown").inc()
        self.prompt_tokens.inc(usage["prompt_tokens"])
        self.generation_tokens.inc(usage["completion_tokens"])
        self.request_seconds.observe(usage["total_time"])
        self.ttft.observe(usage["time_to_first_token"])
        self.queue.observe(usage["queue_time"])
        if usage["tau"] is not None:
            self.tau.observe(usage["tau"])

    def batch_started(self, rows: int) -> None:
        self.batches.inc()
        self.batch_rows.observe(rows)

    def batch(self, stats: GenerationStats) -> None:
        """A batch ended: its cycles and what the calibration chose for them."""
        self.cycles.inc(stats.cycles)
        self.calibration_seconds.inc(stats.calibration_time)
        chosen = (stats.calibration or {}).get("policy", {}).get("chosen")
        if chosen is None:            # a fixed tree, or speculation off: every cycle ran the one program
            chosen = {"tree" if stats.speculate else "plain": stats.cycles}
        for program, cycles in chosen.items():
            self.program_cycles.labels(program).inc(cycles)

    def render(self) -> bytes:
        return generate_latest(self.registry)
