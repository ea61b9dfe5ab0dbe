"""A conversation: messages and attached documents in, token ids to the ring,
events out. Knows which tokens the ring already holds, so a later turn
prefills only what is new."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from cpchat.client.batch import Answer
from cpchat.client.cluster import Cluster
from cpchat.client.documents import Document, read_document, render_user_turn
from cpchat.client.events import (
    AlgorithmChoice,
    CacheLoaded,
    Done,
    Event,
    Prefill,
    Progress,
    RankUsage,
    Speculated,
    Token,
)
from cpchat.client.generation import (
    GenerationDone,
    GenerationRequest,
    LayerDone,
    PrefillDone,
    RankDone,
    TokenOut,
)
from cpchat.client.held import Held, HeldConversations, common_prefix
from cpchat.client.memory import MemoryShortfall
from cpchat.client.planner import Planner
from cpchat.client.prefixes import MIN_GAIN, PrefixChoice, PrefixGone, choose_prefix
from cpchat.core.sharding import rank_tokens
from cpchat.errors import BadInput

PROGRESS_INTERVAL_S = 0.25  # prefill progress at most 4 times a second (and once at its end)
SAVE_MIN_TOKENS = 1024  # the ranks save a conversation on disk once it holds this many tokens not saved yet


@dataclass
class SamplingOptions:
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False  # generate max_tokens whatever the model says (benchmarks, tests)
    top_logprobs: int = 0  # each token also names this many most likely tokens


@dataclass
class Message:
    role: str
    content: str
    docs: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Turn:
    """A user turn ready to send: its message, and the whole prompt's token ids with it."""

    content: str
    docs: list[str]
    tokens: list[int]
    history: int  # messages before it: a turn is sent on the conversation it was made on
    documents_end: int = 0  # of tokens, those a prompt with the same documents and other words shares


class ContextOverflow(BadInput):
    """The prompt does not fit the model's context; the numbers are for the user's choice."""

    def __init__(self, prompt_tokens: int, limit: int) -> None:
        super().__init__(f"the prompt is {prompt_tokens:,} tokens, more than the model's {limit:,}-token "
                         "context: attach less, or ask about a part of the document")
        self.prompt_tokens, self.limit = prompt_tokens, limit


def load_tokenizer(model: str):
    from mlx_lm.tokenizer_utils import load as load_wrapper

    path = Path(model).expanduser()
    if not (path / "tokenizer.json").exists() and not (path / "tokenizer_config.json").exists():
        raise BadInput(f"no tokenizer in {model}: expected an mlx-lm model directory")
    return load_wrapper(path)


class Session:
    # Set on purpose only: the prefill algorithm and the decode step are the planner's now, and an
    # attribute of the old name would be ignored without a word.
    __slots__ = ("_cancel", "cluster", "conversations", "draft_tokens", "last_choice", "messages",
                 "planner", "prefix_cache", "raw", "raw_history", "sampling", "save_min_tokens", "speculate",
                 "tokenizer", "turn_index")

    def __init__(
        self,
        cluster: Cluster,
        tokenizer,
        raw: bool = False,
        algorithm: str = "auto",
        sampling: SamplingOptions | None = None,
        decode: str = "auto",
        prefix_cache: bool = False,
        shares: str = "auto",
        speculate: str = "off",
        draft_tokens: int = 0,
    ) -> None:
        self.cluster, self.tokenizer, self.raw = cluster, tokenizer, raw
        # Reuse prefixes the ranks saved on disk, and have them save this conversation once it holds
        # save_min_tokens they have not saved: a new session about the same document prefills only
        # what is new, and another question about it saves nothing (the document is saved already).
        self.prefix_cache = prefix_cache
        self.save_min_tokens = SAVE_MIN_TOKENS
        # The prefill algorithm, the decode step ("exchange", "ring", "lead", "gather"; or "auto") and
        # each rank's share of a prompt, chosen from the ranks' measurements.
        self.planner = Planner(cluster, algorithm, decode, shares)
        self.sampling = sampling or SamplingOptions()
        # Speculative decoding (cpchat/core/lookup.py): "off", "lookup", "auto" (lookup) or
        # "draft:MODEL" (a model the ranks load, of this tokenizer), and the tokens proposed a step
        # (0: adaptive, or 3 from a draft model). The answer is the same either way.
        self.speculate, self.draft_tokens = speculate, draft_tokens
        self.messages: list[Message] = []
        self.raw_history: list[int] = []  # --raw: every prompt and generated token so far
        # What the ranks hold: this conversation, or (a server's) several, by name (cpchat.client.held).
        self.conversations = HeldConversations()
        self.turn_index = 0
        self.last_choice: AlgorithmChoice | None = None
        self._cancel = threading.Event()

    # ---- prompt construction

    def _chat(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.content} for m in self.messages]

    def _prompt_tokens(self, content: str) -> list[int]:
        """The conversation so far plus a user message with `content`, as token ids."""
        if self.raw:
            return self.raw_history + list(self.tokenizer.encode(content, add_special_tokens=False))
        chat = [*self._chat(), {"role": "user", "content": content}]
        return list(self.tokenizer.apply_chat_template(chat, add_generation_prompt=True))

    def _kept(self, full: list[int]) -> int:
        """How many of `full`'s tokens the ring already holds and can keep."""
        return self.conversations.continued(full)[1]

    @property
    def held(self) -> Held:
        """The conversation the last turn ran on the ranks."""
        return self.conversations.current

    @property
    def context_limit(self) -> int:
        """The model's usable context in tokens (0: unknown)."""
        return self.cluster.model.max_context

    def fits(self, turn: Turn) -> bool:
        """Whether the prompt leaves room for at least one answer token in the model's context."""
        return not self.context_limit or len(turn.tokens) < self.context_limit

    def history_cost(self) -> tuple[int, int, float | None]:
        """Tokens of the conversation so far, how many of them the ranks saved on disk (when they do not
        hold them), and seconds to prefill what they neither hold nor saved."""
        if self.raw:
            tokens = list(self.raw_history)
        else:
            chat = self._chat()
            tokens = list(self.tokenizer.apply_chat_template(chat)) if chat else []
        if not tokens:
            return 0, 0, None
        held = min(common_prefix(self.held.tokens, tokens), len(tokens))
        saved = self.saved_tokens(tokens, len(tokens), held)
        keep = max(held, saved)
        return len(tokens), saved, self.planner.prefill_seconds(len(tokens) - keep, keep)

    def saved_tokens(self, tokens: list[int], limit: int, keep: int) -> int:
        """How many of `tokens` (at most `limit`) the ranks would load from their disks, the ring
        holding `keep` of them (0: none worth loading)."""
        if not self._may_load(tokens, keep, self.conversations.continued(tokens)[0]):
            return 0
        choice = choose_prefix(self.cluster.find_prefixes(tokens), limit, keep, self.cluster.ring_size)
        return choice.tokens if choice else 0

    def _may_load(self, tokens: list[int], keep: int, held: Held | None) -> bool:
        """Whether a saved prefix could beat what the ring holds (`held`: the conversation `tokens`
        continues, None for a new one): not when the ring holds this very conversation (a later turn's),
        nor when too little is left to prefill."""
        continued = held is not None and keep >= len(held.tokens) - MIN_GAIN
        return self.prefix_cache and not continued and len(tokens) - 1 - keep >= MIN_GAIN

    def new_tokens(self, turn: Turn) -> int:
        """The prompt tokens the ranks do not hold yet: what its prefill computes."""
        return len(turn.tokens) - self._kept(turn.tokens)

    def prefill_estimate_s(self, turn: Turn) -> float | None:
        """Seconds the turn's prefill should take, from the ranks' calibration (None: not measured), with
        what they hold or have saved on disk. Blocks on the ranks: not for the event loop."""
        keep = self._kept(turn.tokens)
        keep = max(keep, self.saved_tokens(turn.tokens, len(turn.tokens) - 1, keep))
        return self.planner.prefill_seconds(len(turn.tokens) - keep, keep)

    def turn_shortfall(self, turn: Turn) -> MemoryShortfall | None:
        """The memory check `run` makes, for a turn before it is sent (the TUI asks first)."""
        return self.prompt_shortfall(turn.tokens, self.sampling.max_tokens)

    def prompt_shortfall(self, tokens: list[int], answer_tokens: int) -> MemoryShortfall | None:
        """The memory check `generate` makes, for a prompt's token ids before they are sent. Blocks on
        the ranks: not for the event loop."""
        keep = self._kept(tokens)
        new = len(tokens) - keep
        try:
            algorithm = self.planner.choose_algorithm(new, keep).algorithm
            self.planner.prefill_shares(new, keep, algorithm, answer_tokens, self._draft_model())
        except MemoryShortfall as refused:
            return refused
        return None

    def _draft_model(self) -> str:
        """The draft model of --speculate draft:MODEL ("" for any other mode)."""
        mode, _, name = self.speculate.partition(":")
        return name if mode == "draft" else ""

    # ---- a turn

    def _continue(self, full: list[int]) -> tuple[int, PrefixChoice | None]:
        """Run the held conversation that keeps most of `full`, or a new one (where the ranks load the
        longest prefix of it saved on disk, if that beats what they hold); the tokens kept, and the
        prefix loaded. A prefix gone meanwhile leaves the new conversation empty."""
        held, keep = self.conversations.continued(full)
        choice = None
        if self._may_load(full, keep, held):
            choice = choose_prefix(self.cluster.find_prefixes(full), len(full) - 1, keep,
                                   self.cluster.ring_size)
        self.let_go(self.conversations.run(held if choice is None else None))
        if choice is None:
            return keep, None
        held = self.conversations.current
        try:
            loaded = self.cluster.load_prefix(choice, held.name)
        except PrefixGone:
            self.cluster.reset(0, held.name)
            return 0, None
        held.tokens, held.saved = full[: choice.tokens], choice.tokens
        held.keep_floor, held.state_positions = loaded.keep_floor, list(loaded.state_positions)
        return held.kept(full), choice

    def _agreed(self, done: RankDone, name: str, keep: int) -> RankDone:
        """After a cancel that reached some ranks as the others ended (those rolled back to `keep`, these
        kept the request's tokens): every rank back to `keep`, or, where a sliding window no longer holds
        what that needs, the conversation let go."""
        dones = [res.done for res in self.cluster.last_results.values() if res.done]
        if len({d.cached_tokens for d in dones}) <= 1:
            return done
        if max(d.keep_floor for d in dones) > keep:
            keep = 0
        self.cluster.reset(keep, name)  # 0: let it go
        return replace(done, cached_tokens=keep, cancelled=True)

    def let_go(self, names: list[str]) -> None:
        """The ranks let these conversations go."""
        for name in names:
            self.cluster.reset(0, name)

    def make_room(self, tokens: list[int], answer_tokens: int) -> MemoryShortfall | None:
        """The memory check of `prompt_shortfall`, after letting held conversations go, least recently
        used first, while it fails and another is held."""
        while (refused := self.prompt_shortfall(tokens, answer_tokens)) is not None:
            other = self.conversations.least_recent(besides=self.conversations.continued(tokens)[0])
            if other is None:
                return refused
            self.conversations.let_go(other.name)
            self.let_go([other.name])
        return None

    def cancel(self) -> None:
        self._cancel.set()
        self.cluster.cancel()

    def attach(self, cluster: Cluster) -> None:
        """Continue on another cluster (e.g. relaunched ranks): the next turn re-prefills everything."""
        self.cluster = self.planner.cluster = cluster
        self.conversations.clear()

    def reset(self) -> None:
        self.cluster.reset(0)  # every conversation the ranks hold
        self.conversations.clear()
        self.messages.clear()
        self.raw_history.clear()

    def prepare(self, text: str, docs: Sequence[Document | str | Path] = ()) -> Turn:
        """A user turn (documents first, read here when given as paths) and its prompt's token ids."""
        documents = [d if isinstance(d, Document) else read_document(Path(d)) for d in docs]
        content = render_user_turn(documents, text)
        if not content.strip():
            raise BadInput("the prompt is empty")
        tokens = self._prompt_tokens(content)
        documents_end = 0
        if documents:
            documents_end = common_prefix(tokens, self._prompt_tokens(render_user_turn(documents, "")))
        return Turn(content, [d.name for d in documents], tokens, len(self.messages), documents_end)

    def send(self, text: str, docs: Sequence[Document | str | Path] = (),
             past_context: bool = False) -> Iterator[Event]:
        """Add a user turn and stream the answer's events."""
        yield from self.run(self.prepare(text, docs), past_context)

    def run(self, turn: Turn, past_context: bool = False) -> Iterator[Event]:
        """Send a prepared turn. A prompt past the model's context is refused (ContextOverflow) unless
        `past_context`; one that fits gets an answer of at most the tokens left in the context."""
        if turn.history != len(self.messages):
            raise ValueError("the turn was prepared on another state of the conversation")
        limit = self.context_limit
        if not self.fits(turn) and not past_context:
            raise ContextOverflow(len(turn.tokens), limit)
        max_tokens = self.sampling.max_tokens
        if limit and self.fits(turn):
            max_tokens = min(max_tokens, limit - len(turn.tokens))
        self.messages.append(Message("user", turn.content, turn.docs))
        shown: list[str] = []
        try:
            for event in self.generate(turn.tokens, max_tokens, turn.documents_end):
                if isinstance(event, Token):
                    shown.append(event.text)
                yield event
        except BaseException:
            if self.messages and self.messages[-1].role == "user":
                self.messages.pop()
            raise
        # The answer is exactly what was streamed; bytes of an unfinished character at the end are dropped.
        self.messages.append(Message("assistant", "".join(shown)))

    def generate(self, full: list[int], max_tokens: int | None = None,
                 documents_end: int = 0, batched: bool = False, save: bool = True
                 ) -> Generator[Event, None, Answer | None]:
        """Prefill what the ranks neither hold nor load from disk, and generate: the prompt's token ids
        as they are (`run` keeps the conversation's messages). With the prefix cache,
        a model with linear layers also keeps its state where the documents end (`documents_end`), so that
        another question about them can go on from there. `batched`: the ranks stop after the first
        token, and an answer that goes on is returned, to decode in a batch (cpchat.client.batch).
        `save`: the prefix cache may save the conversation after it (not after a prompt's first chunks)."""
        vocab = self.cluster.model.vocab_size
        bad = [t for t in full if not 0 <= t < vocab]
        if bad:
            raise BadInput(f"token id {bad[0]} is outside the model's vocabulary (size {vocab})")
        self._cancel.clear()
        t_start = time.perf_counter()
        keep, loaded = self._continue(full)
        held = self.conversations.current
        cache = "disk" if loaded else "memory" if keep else "none"
        load_ms = round(1000 * (time.perf_counter() - t_start), 1)
        if loaded is not None:
            yield CacheLoaded(self.turn_index, keep, load_ms, loaded.resharded(self.cluster.ring_size))
        held.saved = min(held.saved, keep)  # a rewritten conversation no longer begins like its save
        new = full[keep:]
        choice = self.planner.choose_algorithm(len(new), keep)
        answer_tokens = self.sampling.max_tokens if max_tokens is None else max_tokens
        batched = batched and answer_tokens > 1
        shares = self.planner.prefill_shares(len(new), keep, choice.algorithm, answer_tokens,
                                             self._draft_model())
        self.last_choice = choice
        seed = self.sampling.seed if self.sampling.seed is not None else random.getrandbits(32)
        linear = self.cluster.model.state_layers  # their states cannot be cut back: keep one at documents_end
        mode = self.speculate.partition(":")[0]
        request = GenerationRequest(
            tokens=new, keep_tokens=keep,
            max_tokens=1 if batched else answer_tokens,
            algorithm=choice.algorithm, decode=self.planner.decode_exchange(len(full), answer_tokens),
            temperature=self.sampling.temperature, top_p=self.sampling.top_p, seed=seed,
            stop_tokens=[] if self.sampling.ignore_eos else sorted(self.tokenizer.eos_token_ids),
            save_prefix=save and self.prefix_cache and len(full) - held.saved >= self.save_min_tokens,
            keep_state_at=max(documents_end - keep, 0) if self.prefix_cache and linear else 0,
            shares=shares or (),
            top_logprobs=self.sampling.top_logprobs,
            speculation=mode if mode in ("off", "draft") else "lookup", draft_tokens=self.draft_tokens,
            draft_model=self._draft_model(), sequence=held.name,
        )
        turn = self.turn_index
        detok = self.tokenizer.detokenizer
        detok.reset()
        generated: list[int] = []
        t_first = t_last = None
        t_progress = t_start
        done = None
        cancel_sent = False
        for event in self.cluster.generate(request):
            if self._cancel.is_set() and not cancel_sent:  # Esc may come before the ranks had the request
                self.cluster.cancel()
                cancel_sent = True
            if isinstance(event, LayerDone):
                layer, layers = event.layer, event.num_layers
                now = time.perf_counter()
                if now - t_progress >= PROGRESS_INTERVAL_S or layer == layers:
                    t_progress = now
                    yield Progress(turn, len(full), keep, len(new) * layer // layers,
                                   round(1000 * (now - t_start), 1))
            elif isinstance(event, PrefillDone):
                yield Prefill(turn, len(new), keep, choice.algorithm, round(event.ms, 1), choice.reason,
                              choice.estimates_ms, event.linear_layers, round(event.state_combine_ms, 1),
                              reused_tokens=keep, cache=cache, load_ms=load_ms if cache == "disk" else 0.0,
                              shares=rank_tokens(len(new), self.cluster.ring_size, shares),
                              stage_wait_ms=[round(w, 1) for w in event.stage_wait_ms]
                              if self.cluster.stages > 1 else [])
            elif isinstance(event, TokenOut):
                t_last = time.perf_counter()
                t_first = t_first or t_last
                generated.append(event.id)
                detok.add_token(event.id)
                yield Token(turn, event.id, detok.last_segment, event.logprob, event.top)
            elif isinstance(event, GenerationDone):
                done = event.done
        if self._cancel.is_set():
            done = self._agreed(done, held.name, keep)
        held.tokens = (full + generated)[: done.cached_tokens]
        if request.save_prefix and not done.cancelled:
            held.saved = len(held.tokens)
        held.keep_floor, held.state_positions = done.keep_floor, list(done.state_positions)
        dones = [res.done for _, res in sorted(self.cluster.last_results.items())]
        held.rank_bytes = tuple(d.kv_bytes + d.state_bytes if d else 0 for d in dones)
        if batched and generated and not done.cancelled:
            self.turn_index += 1
            return Answer(held, full, request, answer_tokens, turn, detok, generated, t_start, t_first)
        self.let_go(self.conversations.over_budget())
        if self.raw:
            self.raw_history = full + generated
        self.turn_index += 1
        ttft = 1000 * ((t_first or time.perf_counter()) - t_start)
        rate = (len(generated) - 1) / (t_last - t_first) if len(generated) > 1 and t_last > t_first else 0.0
        usage = [
            RankUsage(r, res.done.kv_tokens, res.done.kv_bytes, res.done.rss_bytes, res.done.state_bytes)
            for r, res in sorted(self.cluster.last_results.items())
            if res.done
        ]
        speculated = Speculated(request.speculation, done.proposed, done.accepted, done.decode_steps)
        yield Done(turn, len(full), len(generated), round(ttft, 1), round(rate, 2), usage, speculated)
