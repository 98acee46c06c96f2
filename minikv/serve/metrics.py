"""Prometheus metrics of one server, in a registry of its own.

Every app gets a fresh :class:`prometheus_client.CollectorRegistry` instead of the process-wide
default one, so tests (and a notebook) can create several apps in one process without
"Duplicated timeseries" errors, and ``/metrics`` shows exactly one server's numbers.

Names follow vLLM's where there is an equivalent (``vllm:prompt_tokens_total`` ->
``minikv_prompt_tokens_total``).

**Metrics are a side channel, so they are the operator's alone.**  When traffic is light, the
difference between two scrapes is one request: an anonymous observer of ``/metrics`` read a
victim's exact prompt length, its cached tokens (did it re-use its own prefix?) and its output
length -- and with ``cache_isolation="shared"`` the cached-token counter is a cache-hit oracle
even when responses hide ``cached_tokens``.  So ``/metrics`` needs an operator key
(:mod:`minikv.serve.app`) or lives on an operator-only address, and only then may counters
carry ``tenant`` labels, which operators need to see who is being throttled.  Labels never
carry prompt content.

**Labels are bounded.**  A ``tenant`` label is the API key's tenant, never the engine-side domain
a request ran in: under ``--trust-client-salt`` every fresh ``cache_salt`` is a domain of its
own (:mod:`.client_salt`), and labelling by domain grew ``/metrics`` by a series per salted
request.  So the label drops the salt part (:func:`minikv.security.domains.tenant_of`); the
number of series is bounded by the keys files (and the gateway tenants cap, :mod:`.identity`).
"""
from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..security.domains import tenant_of

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
        self.tenant_requests = Counter("minikv_tenant_requests_finished", "Finished requests by tenant "
                                       "and finish reason (operator only)", ["tenant", "finish_reason"],
                                       registry=r)
        self.tenant_tokens = Counter("minikv_tenant_tokens", "Prompt and generated tokens by tenant "
                                     "(operator only)", ["tenant", "kind"], registry=r)
        self.rejected = Counter("minikv_tenant_requests_rejected", "Requests refused with 429 by tenant "
                                "and limit (operator only)", ["tenant", "limit"], registry=r)
        self.e2e = Histogram("minikv_e2e_request_latency_seconds", "Request latency (server side)",
                             buckets=E2E_BUCKETS, registry=r)

    def observe_first_token(self, ttft_s: float | None) -> None:
        if ttft_s is not None:
            self.ttft.observe(max(0.0, ttft_s))

    def observe_finish(self, prompt_tokens: int, cached_tokens: int, generated: int, reason: str | None,
                       e2e_s: float | None, tenant: str | None = None) -> None:
        t = str(tenant_of(tenant))
        self.tenant_requests.labels(tenant=t, finish_reason=str(reason)).inc()
        self.tenant_tokens.labels(tenant=t, kind="prompt").inc(prompt_tokens)
        self.tenant_tokens.labels(tenant=t, kind="generated").inc(generated)
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
