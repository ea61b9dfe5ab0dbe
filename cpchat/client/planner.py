"""How a prefill and its answer run on the ranks, decided from the cluster's measurements before anything
is sent: the prefill algorithm, the decode step, each rank's share of the new tokens, and whether the
ranks' memory holds it. `cpchat plan` asks it without a conversation."""

from __future__ import annotations

from dataclasses import replace

from cpchat.client.cluster import Cluster
from cpchat.client.events import AlgorithmChoice
from cpchat.client.memory import MemoryShortfall, StageSplit, shortfall
from cpchat.client.settings import parse_shares
from cpchat.core.estimate import balanced_shares, rank_seconds
from cpchat.core.heuristics import GATHER_SHARE, Measured, Workload, choose_algorithm, choose_decode
from cpchat.core.memory import gather_bytes
from cpchat.core.sharding import Shares
from cpchat.core.stages import pipeline_cuts, pipeline_seconds
from cpchat.errors import BadInput


class Planner:
    """`algorithm` (a name, or "auto": the cost model's choice), `decode` (a decode step, or "auto") and
    `shares` ("auto": what evens out the ranks' measured prefill times, "equal", or weights "W1,W2,...",
    cpchat.core.sharding) as the user set them, applied to the cluster's ranks."""

    def __init__(self, cluster: Cluster, algorithm: str = "auto", decode: str = "auto",
                 shares: str = "auto") -> None:
        self.cluster, self.algorithm, self.decode = cluster, algorithm, decode
        self.shares = parse_shares(shares)
        if isinstance(self.shares, tuple) and len(self.shares) != cluster.ring_size:
            raise BadInput(f"--shares {shares} gives {len(self.shares)} weights for {cluster.ring_size} ranks"
                           + (" a stage" if cluster.stages > 1 else ""))

    def prefill_seconds(self, new: int, keep: int) -> float | None:
        """Seconds a prefill of `new` tokens after `keep` held should take, from the ranks' calibration
        (None: not measured)."""
        c = self.cluster
        if not c.rank_costs or not all(cost.per_token_s for cost in c.rank_costs):
            return None
        shares = self.shares_for(new, keep)
        stages = [max(rank_seconds([c.rank_costs[r] for r in c.stage_ranks(s)], new, keep, c.model.groups,
                                   shares)) for s in range(c.stages)]
        return pipeline_seconds(stages, len(pipeline_cuts(keep, keep + new, c.stages)) + 1)

    def shares_for(self, new_tokens: int, cached_tokens: int) -> Shares | None:
        """Each rank's share of a prefill of `new_tokens` (None: equal ones)."""
        c = self.cluster
        if isinstance(self.shares, tuple):
            return self.shares
        if self.shares == "equal" or c.equally_fast or not all(x.per_token_s for x in c.rank_costs):
            return None
        return balanced_shares(c.context_costs(), new_tokens, cached_tokens, c.model.groups)

    def memory_shortfall(self, new_tokens: int, cached_tokens: int, algorithm: str, answer_tokens: int,
                         draft_model: str = "") -> MemoryShortfall | None:
        """Why some rank cannot hold this prefill and its answer (and `draft_model`'s K/V of them, on the
        rank that samples: it loads the draft first), from what the ranks report free now; None when
        all can. Blocks on the ranks: not for the event loop."""
        c = self.cluster
        if not any(f.fixed_bytes or f.per_token_bytes for f in c.forward_memory):
            return None  # ranks of a cpchat before the check measure no forward's memory
        tokens = cached_tokens + new_tokens + answer_tokens
        draft = c.load_draft(draft_model).need(tokens) if draft_model else 0
        free = c.free_memory()
        for s in range(c.stages):  # each stage's ranks hold the K/V of its layers
            ranks = c.stage_ranks(s)
            split = StageSplit(c.stages, c.size, max(c.ranks[r].weight_bytes for r in ranks))
            refused = shortfall(self.stage_workload(s, new_tokens, cached_tokens), algorithm,
                                [c.forward_memory[r] for r in ranks], [free[r] for r in ranks], answer_tokens,
                                [c.ranks[r].label for r in ranks], split, draft if s == c.stages - 1 else 0)
            if refused is not None:
                return refused
        return None

    def stage_workload(self, stage: int, new_tokens: int, cached_tokens: int) -> Workload:
        """The workload of one pipeline stage's ranks: the K/V of its attention layers."""
        w = self.workload(new_tokens, cached_tokens)
        head = self.cluster.ranks[self.cluster.stage_ranks(stage)[0]]
        if self.cluster.stages == 1 or head.layers == (0, 0):
            return w
        return replace(w, layers=max(head.layers[1] - head.layers[0] - head.state_layers, 1))

    def prefill_shares(self, new_tokens: int, cached_tokens: int, algorithm: str, answer_tokens: int,
                       draft_model: str = "") -> Shares | None:
        """The shares a prefill runs in: shares_for's, or under auto, where some rank cannot hold its
        share, shares in proportion to the ranks' free memory if those hold it. Raises MemoryShortfall
        when neither does. Blocks on the ranks: not for the event loop."""
        refused = self.memory_shortfall(new_tokens, cached_tokens, algorithm, answer_tokens, draft_model)
        if refused is None:
            return self.shares_for(new_tokens, cached_tokens)
        if self.shares == "auto" and refused.roomy is not None:
            return refused.roomy
        raise refused

    def choose_algorithm(self, new_tokens: int, cached_tokens: int) -> AlgorithmChoice:
        """The session's algorithm, or under auto the one the cost model expects to be fastest."""
        c = self.cluster
        choice = choose_algorithm(self.workload(new_tokens, cached_tokens), self.measured())
        forced = self.algorithm != "auto"
        return AlgorithmChoice(
            algorithm=self.algorithm if forced else choice.algorithm,
            forced=forced,
            new_tokens=new_tokens,
            cached_tokens=cached_tokens,
            miss_rate=new_tokens / (new_tokens + cached_tokens),
            estimates_ms={name: round(1000 * s, 1) for name, s in choice.estimates_s.items()},
            reason=f"forced by --algorithm {self.algorithm}" if forced else choice.reason,
            link_bytes_per_s=c.ring_bytes_per_s,
            hop_latency_ms=1000 * c.hop_latency_s,
            exchange_latency_ms=1000 * c.exchange_latency_s,
        )

    def decode_exchange(self, cached_tokens: int, answer_tokens: int = 0) -> str:
        """The decode step's exchange for an answer after `cached_tokens`. Under auto, on one machine,
        reads rank 0's free memory (blocks on the ranks: not for the event loop)."""
        if self.decode != "auto":
            return self.decode
        w, m = self.workload(1, cached_tokens), self.measured()
        copy_fits = False
        if w.ranks > 1 and m.one_machine and not w.states:
            copy = gather_bytes(w, cached_tokens, answer_tokens)
            copy_fits = copy * GATHER_SHARE <= self.cluster.free_memory()[0]
        return choose_decode(w, m, copy_fits)

    def workload(self, new_tokens: int, cached_tokens: int) -> Workload:
        m = self.cluster.model
        head_dim = m.head_dim or 64  # ranks older than the field: the model's own sizes are unknown
        return Workload(new_tokens, cached_tokens, self.cluster.ring_size, m.num_q_heads, m.num_kv_heads,
                        head_dim, m.value_dim or head_dim, m.bytes_per_element,
                        max(m.attention_layers, 1), m.kv_format, states=m.state_layers > 0,
                        shares=self.shares_for(new_tokens, cached_tokens))

    def measured(self) -> Measured:
        c = self.cluster
        per_pair = c.prefill_cost.per_pair_s if c.prefill_cost and c.prefill_cost.per_pair_s else 1e-9
        return Measured(per_pair, max(min(c.ring_bytes_per_s, 1e15), 1.0), c.hop_latency_s,
                        c.exchange_latency_s, overlap=c.spare_cores, one_machine=c.one_machine)
