"""Prometheus metrics of the server, one registry per server."""

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

disable_created_metrics()  # the *_created samples only add noise to every scrape
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2, 5, 10, 20, 60)


class EngineCollector:
    """Reads the engine's gauges at scrape time (running, waiting, KV usage, prefix cache)."""

    def __init__(self, stats):
        self.stats = stats

    def collect(self):
        s = self.stats()
        yield GaugeMetricFamily("scriptorium_requests_running", "Sequences in the running batch", value=s["running"])
        yield GaugeMetricFamily("scriptorium_requests_waiting", "Sequences waiting to be scheduled", value=s["waiting"])
        yield GaugeMetricFamily("scriptorium_kv_cache_usage_ratio", "Fraction of KV-cache blocks in use",
                                value=s["kv_cache_usage"])
        yield GaugeMetricFamily("scriptorium_kv_cache_free_blocks", "KV-cache blocks free (cached or empty)",
                                value=s["num_free_blocks"])
        yield CounterMetricFamily("scriptorium_prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                  value=s["prefix_cache_queries"])
        yield CounterMetricFamily("scriptorium_prefix_cache_hits", "Prompt tokens found in the prefix cache",
                                  value=s["prefix_cache_hits"])
        queries = s["prefix_cache_queries"]
        yield GaugeMetricFamily("scriptorium_prefix_cache_hit_rate", "Prefix-cache hits over queries, since start",
                                value=s["prefix_cache_hits"] / queries if queries else 0.0)
        yield CounterMetricFamily("scriptorium_preemptions", "Sequences preempted for lack of KV blocks",
                                  value=s["num_preemptions"])
        yield GaugeMetricFamily("scriptorium_sleeping", "1 while the engine sleeps", value=1 if s["sleeping"] else 0)
        drafted, accepted, verifications = s["spec_draft_tokens"], s["spec_accepted_tokens"], s["spec_verifications"]
        yield CounterMetricFamily("scriptorium_spec_draft_tokens", "Speculative tokens proposed", value=drafted)
        yield CounterMetricFamily("scriptorium_spec_accepted_tokens", "Speculative tokens accepted", value=accepted)
        yield GaugeMetricFamily("scriptorium_spec_acceptance_rate", "Accepted over proposed draft tokens, since start",
                                value=accepted / drafted if drafted else 0.0)
        yield GaugeMetricFamily("scriptorium_spec_mean_accepted_length",
                                "Tokens gained per verification (accepted drafts plus the target's own token)",
                                value=(accepted + verifications) / verifications if verifications else 0.0)


class ServerMetrics:
    def __init__(self, stats):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("scriptorium_requests", "Finished requests by outcome (their first choice's finish "
                                "reason, or abort)", ["outcome"], registry=r)
        self.prompt_tokens = Counter("scriptorium_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("scriptorium_generation_tokens", "Generated tokens", registry=r)
        self.ttft = Histogram("scriptorium_time_to_first_token_seconds", "Time to first token", registry=r,
                              buckets=_LATENCY_BUCKETS)
        self.itl = Histogram("scriptorium_inter_token_latency_seconds", "Time between a request's tokens",
                             registry=r, buckets=_LATENCY_BUCKETS)
        r.register(EngineCollector(stats))

    def record_finished(self, finish_reason: str | None, prompt_tokens: int, generated_tokens: int) -> None:
        self.requests.labels(outcome=finish_reason or "abort").inc()
        self.generation_tokens.inc(generated_tokens)
        self.prompt_tokens.inc(prompt_tokens)

    def record_outcome(self, outcome: str) -> None:
        self.requests.labels(outcome=outcome).inc()

    def record_token_timing(self, ttft: float | None, gap: float | None) -> None:
        if ttft is not None:
            self.ttft.observe(ttft)
        if gap is not None:
            self.itl.observe(gap)

    def render(self) -> bytes:
        return generate_latest(self.registry)
