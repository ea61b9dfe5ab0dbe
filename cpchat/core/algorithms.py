"""The ring algorithms, in one registry: the CLI's choices, the wire values the client sends, the names
the TUI and the bench show. Data only: the function each rank runs is in cpchat.rank.algorithms.ATTEND."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Algorithm:
    name: str  # the value of --algorithm, of the config file and of the JSON events
    title: str  # as the TUI and the bench show it
    stage: str  # "prefill" (a prompt's attention) or "decode" (one token's partial outputs)
    wire: str  # its value in cpchat.proto: enum Algorithm (prefill) or enum Decode
    moves: str  # what crosses the ring


REGISTRY = (
    Algorithm("pass_kv", "pass-KV", "prefill", "PASS_KV",
              "K/V blocks travel the ring (N-1 hops, overlapped)"),
    Algorithm("pass_q", "pass-Q", "prefill", "PASS_Q",
              "queries travel the ring with their running output (N hops)"),
    Algorithm("all_gather", "all-gather", "prefill", "ALL_GATHER",
              "every rank sends its K/V to every other rank at once"),
    Algorithm("ulysses", "Ulysses", "prefill", "ULYSSES",
              "all-to-all from a sequence split to a head split, and back"),
    Algorithm("exchange", "exchange", "decode", "DECODE_EXCHANGE",
              "every rank sends its partial output to every other rank at once"),
    Algorithm("ring", "ring", "decode", "DECODE_RING",
              "partial outputs travel the ring (N-1 hops)"),
    Algorithm("lead", "lead", "decode", "DECODE_LEAD",
              "rank 0 runs the model and sends each layer's query to every other rank, which send "
              "back their partial outputs"),
    Algorithm("gather", "gather", "decode", "DECODE_GATHER",
              "every other rank's K/V to rank 0 once an answer, which runs the steps alone; each new "
              "token's K/V to the rank that keeps them"),
)
BY_NAME = {a.name: a for a in REGISTRY}
PREFILL_ALGORITHMS = tuple(a.name for a in REGISTRY if a.stage == "prefill")
DECODE_EXCHANGES = tuple(a.name for a in REGISTRY if a.stage == "decode")
ALGORITHMS = ("auto", *PREFILL_ALGORITHMS)  # the user's choices for a prefill


def title(name: str) -> str:
    """The shown name of an algorithm ("pass-KV"); other words ("auto") as they are."""
    return BY_NAME[name].title if name in BY_NAME else name
