"""Prometheus metrics of one server, in a registry of its own.

Every app gets a fresh :class:`prometheus_client.CollectorRegistry` instead of the process-wide
default one, so tests (and a notebook) can create several apps in one process without
"Duplicated timeseries" errors, and ``/metrics`` shows exactly one server's numbers.

Names follow vLLM's where there is an equivalent (``vllm:prompt_tokens_total`` ->
``minikv_prompt_tokens_total``).  Labels never carry tenant names or prompt content: a
metrics scraper is usually less trusted than the operator's audit trail, and per-tenant
cache-hit counters would themselves be a (coarse) side channel.
"""
from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)


class ServerMetrics:
    """The counters, gauges and histograms ``/metrics`` exposes."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.requests = Counter("minikv_requests", "HTTP requests by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("minikv_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.cached_tokens = Counter("minikv_cached_prompt_tokens",
                                     "Prompt tokens served from the prefix cache", registry=r)
        self.generated_tokens = Counter("minikv_generation_tokens", "Generated tokens", registry=r)
        self.finished = Counter("minikv_request_finished", "Finished engine requests by finish reason",
                                ["finish_reason"], registry=r)
        self.running = Gauge("minikv_num_requests_running", "Requests in the running batch", registry=r)
        self.waiting = Gauge("minikv_num_requests_waiting", "Requests waiting to be scheduled", registry=r)
        self.batch_size = Gauge("minikv_max_batch_size", "Largest batch the engine has stepped", registry=r)
        self.ttft = Histogram("minikv_time_to_first_token_seconds", "Time to first token (server side)",
                              buckets=TTFT_BUCKETS, registry=r)
        self.e2e = Histogram("minikv_e2e_request_latency_seconds", "Request latency (server side)",
                             buckets=E2E_BUCKETS, registry=r)

    def observe_first_token(self, ttft_s: float | None) -> None:
        if ttft_s is not None:
            self.ttft.observe(max(0.0, ttft_s))

    def observe_finish(self, prompt_tokens: int, cached_tokens: int, generated: int, reason: str | None,
                       e2e_s: float | None) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.cached_tokens.inc(cached_tokens)
        self.generated_tokens.inc(generated)
        self.finished.labels(finish_reason=str(reason)).inc()
        if e2e_s is not None:
            self.e2e.observe(max(0.0, e2e_s))

    def set_queue(self, running: int, waiting: int) -> None:
        self.running.set(running)
        self.waiting.set(waiting)

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
