"""A conversation: messages and attached documents in, token ids to the ring,
events out. Knows which tokens the ring already holds, so a later turn
prefills only what is new."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from cpchat.client.cluster import BadInput, Cluster
from cpchat.client.documents import read_document, render_user_turn
from cpchat.client.events import (
    AlgorithmChoice,
    Done,
    Prefill,
    Progress,
    RankUsage,
    Token,
)
from cpchat.core.heuristics import explain_algorithm
from cpchat.protocol import cpchat_pb2 as pb


@dataclass
class SamplingOptions:
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None


@dataclass
class Message:
    role: str
    content: str
    docs: list[str] = field(default_factory=list)


def load_tokenizer(model: str):
    from mlx_lm.tokenizer_utils import load as load_wrapper

    path = Path(model).expanduser()
    if not (path / "tokenizer.json").exists() and not (path / "tokenizer_config.json").exists():
        raise BadInput(f"no tokenizer in {model}: expected an mlx-lm model directory")
    return load_wrapper(path)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class Session:
    def __init__(
        self,
        cluster: Cluster,
        tokenizer,
        raw: bool = False,
        algorithm: str = "auto",
        sampling: SamplingOptions | None = None,
    ) -> None:
        self.cluster, self.tokenizer, self.raw = cluster, tokenizer, raw
        self.algorithm = algorithm
        self.sampling = sampling or SamplingOptions()
        self.messages: list[Message] = []
        self.raw_history: list[int] = []  # --raw: every prompt and generated token so far
        self.held: list[int] = []  # tokens whose K/V the ring holds
        self.keep_floor = 0  # a later turn keeps at least this many held tokens, or none
        self.turn_index = 0
        self.last_choice: AlgorithmChoice | None = None
        self._cancel = threading.Event()

    # ---- prompt construction

    def _prompt_tokens(self, text: str) -> list[int]:
        if self.raw:
            return self.raw_history + list(self.tokenizer.encode(text, add_special_tokens=False))
        chat = [{"role": m.role, "content": m.content} for m in self.messages]
        return list(self.tokenizer.apply_chat_template(chat, add_generation_prompt=True))

    def choose_algorithm(self, new_tokens: int, cached_tokens: int) -> AlgorithmChoice:
        m = self.cluster.model
        c = explain_algorithm(
            new_tokens,
            cached_tokens,
            m.num_kv_heads,
            m.num_q_heads,
            self.cluster.size,
            max(self.cluster.flops_per_s, 1.0),
            max(self.cluster.ring_bytes_per_s, 1.0),
            m.bytes_per_element,
        )
        forced = self.algorithm != "auto"
        algorithm = self.algorithm if forced else c.algorithm
        reason = "forced by --algorithm" if forced else c.reason
        return AlgorithmChoice(
            algorithm,
            forced,
            new_tokens,
            cached_tokens,
            c.miss_rate,
            c.miss_rate_threshold,
            c.token_threshold,
            reason,
        )

    # ---- a turn

    def cancel(self) -> None:
        self._cancel.set()
        self.cluster.cancel()

    def attach(self, cluster: Cluster) -> None:
        """Continue on another cluster (e.g. relaunched ranks): the next turn re-prefills everything."""
        self.cluster = cluster
        self.held = []
        self.keep_floor = 0

    def reset(self) -> None:
        self.cluster.reset(0)
        self.messages.clear()
        self.raw_history.clear()
        self.held.clear()
        self.keep_floor = 0

    def send(self, text: str, docs: list[str | Path] = ()) -> Iterator[Prefill | Progress | Token | Done]:
        """Add a user turn (documents first) and stream the answer's events."""
        documents = [read_document(Path(d)) for d in docs]
        content = render_user_turn(documents, text)
        if not content.strip():
            raise BadInput("the prompt is empty")
        self.messages.append(Message("user", content, [d.name for d in documents]))
        try:
            yield from self._generate(self._prompt_tokens(content))
        except BaseException:
            if self.messages and self.messages[-1].role == "user":
                self.messages.pop()
            raise

    def _generate(self, full: list[int]) -> Iterator[Prefill | Progress | Token | Done]:
        vocab = self.cluster.model.vocab_size
        bad = [t for t in full if not 0 <= t < vocab]
        if bad:
            raise BadInput(f"token id {bad[0]} is outside the model's vocabulary (size {vocab})")
        keep = min(common_prefix(self.held, full), len(full) - 1)
        if keep < self.keep_floor:  # sliding-window layers no longer hold what that would need
            keep = 0
        new = full[keep:]
        choice = self.choose_algorithm(len(new), keep)
        self.last_choice = choice
        seed = self.sampling.seed if self.sampling.seed is not None else random.getrandbits(32)
        request = pb.GenerateRequest(
            keep_tokens=keep,
            tokens=new,
            algorithm=pb.PASS_Q if choice.algorithm == "pass_q" else pb.PASS_KV,
            max_tokens=self.sampling.max_tokens,
            sampling=pb.Sampling(temperature=self.sampling.temperature, top_p=self.sampling.top_p, seed=seed),
            stop_tokens=sorted(self.tokenizer.eos_token_ids),
        )
        self._cancel.clear()
        turn = self.turn_index
        detok = self.tokenizer.detokenizer
        detok.reset()
        generated: list[int] = []
        shown: list[str] = []
        t_start = time.perf_counter()
        t_first = t_last = None
        done = None
        cancel_sent = False
        for event in self.cluster.generate(request):
            if self._cancel.is_set() and not cancel_sent:  # Esc may come before the ranks had the request
                self.cluster.cancel()
                cancel_sent = True
            which = event.WhichOneof("event")
            if which == "progress":
                yield Progress("prefill", event.progress.layer, event.progress.num_layers)
            elif which == "prefill":
                yield Prefill(turn, len(new), keep, choice.algorithm, round(event.prefill.ms, 1))
            elif which == "token":
                t_last = time.perf_counter()
                t_first = t_first or t_last
                generated.append(event.token.id)
                detok.add_token(event.token.id)
                segment = detok.last_segment
                shown.append(segment)
                yield Token(turn, event.token.id, segment, event.token.logprob)
            elif which == "done":
                done = event.done
        self.held = (full + generated)[: done.cached_tokens]
        self.keep_floor = done.keep_floor
        if self.raw:
            self.raw_history = full + generated
        # The answer is exactly what was streamed; bytes of an unfinished character at the end are dropped.
        self.messages.append(Message("assistant", "".join(shown)))
        self.turn_index += 1
        ttft = 1000 * ((t_first or time.perf_counter()) - t_start)
        rate = (len(generated) - 1) / (t_last - t_first) if len(generated) > 1 and t_last > t_first else 0.0
        usage = [
            RankUsage(r, res.done.kv_tokens, res.done.kv_bytes, res.done.rss_bytes)
            for r, res in sorted(self.cluster.last_results.items())
            if res.done
        ]
        yield Done(turn, len(full), len(generated), round(ttft, 1), round(rate, 2), usage)
