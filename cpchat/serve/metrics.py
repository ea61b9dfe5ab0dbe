"""`/metrics` of `cpchat serve`, in Prometheus's text format: what was asked and answered, how long the
first token and the next ones took, the queue, and what each rank holds (read from the ranks as the
metrics are scraped)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from cpchat.client.events import RankStats
from cpchat.serve.openai_api import Outcome

TTFT_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
STEP_ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
TOKEN_BUCKETS_S = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5)


class ServerMetrics:
    """One server's metrics, in a registry of their own (a process may run several servers: tests)."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("cpchat_requests", "Requests the ranks ran, by endpoint and how they "
                                "ended (answered: the ranks or a stop string ended them; cancelled: the "
                                "client went away)", ["endpoint", "outcome"], registry=r)
        self.refused = Counter("cpchat_requests_refused", "Requests answered with an error, by HTTP status",
                               ["status"], registry=r)
        self.prompt_tokens = Counter("cpchat_prompt_tokens", "Prompt tokens of the requests run", registry=r)
        self.cached_tokens = Counter("cpchat_prompt_tokens_cached", "Of them, those the ranks held already "
                                     "or loaded from disk (not prefilled)", registry=r)
        self.generated_tokens = Counter("cpchat_generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("cpchat_time_to_first_token_seconds", "From the request's start on the ranks "
                              "to its first token", buckets=TTFT_BUCKETS_S, registry=r)
        self.per_token = Histogram("cpchat_time_per_output_token_seconds", "A request's mean time per token "
                                   "after its first", buckets=TOKEN_BUCKETS_S, registry=r)
        self.kept_from = Counter("cpchat_requests_by_cache", "Answered requests by where their kept prompt "
                                 "tokens came from: memory, disk or none", ["cache"], registry=r)
        self.waiting = Gauge("cpchat_queue_waiting", "Requests waiting for the ranks", registry=r)
        self.conversations = Gauge("cpchat_conversations_held", "Conversations the ranks hold", registry=r)
        self.batch = Gauge("cpchat_batch_size", "Requests running on the ranks now", registry=r)
        self.step_rows = Histogram("cpchat_decode_step_answers", "Answers each batched decode step advanced",
                                   buckets=STEP_ROW_BUCKETS, registry=r)
        self.kv_bytes = Gauge("cpchat_rank_kv_bytes", "Bytes of K/V (and linear layers' states) each rank "
                              "holds", ["rank", "address"], registry=r)
        self.kv_tokens = Gauge("cpchat_rank_kv_tokens", "Tokens each rank holds K/V of", ["rank", "address"],
                               registry=r)

    def finished(self, endpoint: str, outcome: Outcome, answered: bool) -> None:
        self.requests.labels(endpoint, "answered" if answered else "cancelled").inc()
        self.prompt_tokens.inc(outcome.prompt_tokens)
        self.cached_tokens.inc(outcome.cached_tokens)
        self.generated_tokens.inc(outcome.completion_tokens)
        if answered and outcome.completion_tokens:
            self.ttft.observe(outcome.ttft_ms / 1000)
            self.kept_from.labels(outcome.cache).inc()
        if answered and outcome.completion_tokens > 1 and outcome.decode_tokens_per_s > 0:
            self.per_token.observe(1 / outcome.decode_tokens_per_s)

    def text(self, waiting: int, running: int, conversations: int, ranks: list[RankStats]) -> bytes:
        """The exposition, with the queue and the ranks' holdings as they are now."""
        self.waiting.set(waiting)
        self.conversations.set(conversations)
        self.batch.set(running)
        self.kv_bytes.clear()
        self.kv_tokens.clear()
        for s in ranks:
            self.kv_bytes.labels(str(s.rank), s.address).set(s.kv_bytes + s.state_bytes)
            self.kv_tokens.labels(str(s.rank), s.address).set(s.kv_tokens)
        return generate_latest(self.registry)
