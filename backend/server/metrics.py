"""Prometheus metrics of the server, one registry per server, every sample labelled with its `model` (the served
name), as vLLM labels its own with model_name: a server of several models tells them apart."""

from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

disable_created_metrics()  # the *_created samples only add noise to every scrape
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2, 5, 10, 20, 60)


class EngineCollector:
    """Reads each model's engine gauges at scrape time (running, waiting, KV usage, prefix cache): `stats` gives
    {served name: engine stats} (an unloaded model's are zeros)."""

    def __init__(self, stats: Callable[[], dict[str, dict]]):
        self.stats = stats

    def collect(self):
        per_model = self.stats()

        def family(kind, name: str, doc: str, value: Callable[[dict], float]):
            metric = kind(name, doc, labels=["model"])
            for model, s in per_model.items():
                metric.add_metric([model], value(s))
            return metric

        gauge, counter = GaugeMetricFamily, CounterMetricFamily
        yield family(gauge, "scriptorium_requests_running", "Sequences in the running batch", lambda s: s["running"])
        yield family(gauge, "scriptorium_requests_waiting", "Sequences waiting to be scheduled",
                     lambda s: s["waiting"])
        yield family(gauge, "scriptorium_kv_cache_usage_ratio", "Fraction of KV-cache blocks in use",
                     lambda s: s["kv_cache_usage"])
        yield family(gauge, "scriptorium_kv_cache_free_blocks", "KV-cache blocks free (cached or empty)",
                     lambda s: s["num_free_blocks"])
        yield family(counter, "scriptorium_prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                     lambda s: s["prefix_cache_queries"])
        yield family(counter, "scriptorium_prefix_cache_hits", "Prompt tokens found in the prefix cache",
                     lambda s: s["prefix_cache_hits"])
        yield family(gauge, "scriptorium_prefix_cache_hit_rate", "Prefix-cache hits over queries, since its load",
                     lambda s: s["prefix_cache_hits"] / s["prefix_cache_queries"] if s["prefix_cache_queries"] else 0.0)
        yield family(counter, "scriptorium_preemptions", "Sequences preempted for lack of KV blocks",
                     lambda s: s["num_preemptions"])
        yield family(gauge, "scriptorium_sleeping", "1 while the engine sleeps", lambda s: 1 if s["sleeping"] else 0)
        yield family(counter, "scriptorium_spec_draft_tokens", "Speculative tokens proposed",
                     lambda s: s["spec_draft_tokens"])
        yield family(counter, "scriptorium_spec_accepted_tokens", "Speculative tokens accepted",
                     lambda s: s["spec_accepted_tokens"])
        rate = gauge("scriptorium_spec_acceptance_rate", "Accepted over proposed draft tokens, since its load, by "
                     "how drafts are made (ngram, draft; draft-intersection, draft-string: another vocabulary)",
                     labels=["model", "method"])
        for model, s in per_model.items():
            rate.add_metric([model, s.get("spec_method") or "none"],
                            s["spec_accepted_tokens"] / s["spec_draft_tokens"] if s["spec_draft_tokens"] else 0.0)
        yield rate
        yield family(gauge, "scriptorium_spec_mean_accepted_length",
                     "Tokens gained per verification (accepted drafts plus the target's own token)",
                     lambda s: (s["spec_accepted_tokens"] + s["spec_verifications"]) / s["spec_verifications"]
                     if s["spec_verifications"] else 0.0)


class ServerMetrics:
    def __init__(self, stats: Callable[[], dict[str, dict]]):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("scriptorium_requests", "Finished requests by outcome (their first choice's finish "
                                "reason, or abort)", ["model", "outcome"], registry=r)
        self.prompt_tokens = Counter("scriptorium_prompt_tokens", "Prompt tokens of finished requests", ["model"],
                                     registry=r)
        self.generation_tokens = Counter("scriptorium_generation_tokens", "Generated tokens", ["model"], registry=r)
        self.ttft = Histogram("scriptorium_time_to_first_token_seconds", "Time to first token", ["model"], registry=r,
                              buckets=_LATENCY_BUCKETS)
        self.itl = Histogram("scriptorium_inter_token_latency_seconds", "Time between a request's tokens", ["model"],
                             registry=r, buckets=_LATENCY_BUCKETS)
        r.register(EngineCollector(stats))

    def for_model(self, model: str) -> "ModelMetrics":
        return ModelMetrics(self, model)

    def render(self) -> bytes:
        return generate_latest(self.registry)


@dataclass
class ModelMetrics:
    """What one model's engine records, under its label."""

    server: ServerMetrics
    model: str

    def record_finished(self, finish_reason: str | None, prompt_tokens: int, generated_tokens: int) -> None:
        s = self.server
        s.requests.labels(model=self.model, outcome=finish_reason or "abort").inc()
        s.generation_tokens.labels(model=self.model).inc(generated_tokens)
        s.prompt_tokens.labels(model=self.model).inc(prompt_tokens)

    def record_outcome(self, outcome: str) -> None:
        self.server.requests.labels(model=self.model, outcome=outcome).inc()

    def record_token_timing(self, ttft: float | None, gap: float | None) -> None:
        if ttft is not None:
            self.server.ttft.labels(model=self.model).observe(ttft)
        if gap is not None:
            self.server.itl.labels(model=self.model).observe(gap)
