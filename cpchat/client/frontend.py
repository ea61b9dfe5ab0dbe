"""What a front end stands on: the model resolved and fetched, the ranks launched or attached, the
model loaded on them, the tokenizer, and a session with the settings. Both front ends (the TUI's
workers, headless) use it; its methods block.

Progress goes through `report(phase, done, total)`: "download" (bytes), "convert" (tensors),
"connect" (ranks), "load" (ranks).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

from cpchat.client.cluster import Cluster
from cpchat.client.connect import ClusterOptions, connect_cluster
from cpchat.client.draft import resolve_speculation
from cpchat.client.hub import front_end_copy
from cpchat.client.models import weight_parts
from cpchat.client.session import Message, SamplingOptions, Session, load_tokenizer
from cpchat.client.settings import Settings, rank_flags, resolve_model
from cpchat.core.stages import ONE_STAGE, Stages, even_split, memory_split, speed_split
from cpchat.errors import BackendError, BadInput

Report = Callable[[str, int, int], None]


class Frontend:
    """`cluster`/`model_path` inject a running, loaded cluster (tests); otherwise `start` launches
    or attaches one from `options`. `say` takes the lines a GGUF conversion writes (what it
    requantized); without it they are kept for `take_notes`."""

    def __init__(self, settings: Settings, options: ClusterOptions, cluster: Cluster | None = None,
                 model_path: str | None = None, say: Callable[[str], None] | None = None) -> None:
        self.settings, self.options = settings, options
        self.cluster, self.model_path = cluster, model_path
        self.own_cluster = False  # formed here, not injected: closed with us (attached ranks run on)
        self.tokenizer_dir: str | None = None  # where the front end reads a hub model's tokenizer
        self.tokenizer = None
        self.speculate = settings.speculate  # a draft model's name resolved (cpchat.client.draft)
        self.session: Session | None = None
        self.closing = threading.Event()
        self.notes: list[str] = []  # lines for the user from the work (what a GGUF conversion did)
        self.say = say or self.notes.append

    def start(self, report: Report) -> str:
        """Launch or attach the ranks and load the model and its tokenizer; returns the model's
        description ("" for an injected cluster). The tokenizer and a draft model are checked first:
        a draft of another tokenizer is refused before any rank starts."""
        description = ""
        if self.cluster is None:
            self.model_path, description = resolve_model(self.settings.model)
            self.tokenizer_dir = self._fetch(self.model_path, report)
        assert self.model_path is not None
        self.tokenizer = load_tokenizer(self.tokenizer_dir or self.model_path)
        self.speculate = self._speculation(self.tokenizer, self.model_path, report)
        if self.cluster is None:
            self._connect(report)
            if self.closing.is_set():
                return description
        if self.cluster.model is None:
            self._load(self.model_path, report)
        return description

    def _connect(self, report: Report) -> None:
        report("connect", 0, self.settings.ranks)
        self.cluster = connect_cluster(self.options, self.settings.ranks, self.settings.blas,
                                       rank_flags(self.settings), self.settings.threads)
        self.own_cluster = True

    def reconnect(self, report: Report) -> None:
        """After ranks stopped answering: launch fresh local ones (or reach the attached ones again), load
        the model, and have the session go on there. BackendError if they cannot be reached."""
        assert self.model_path is not None
        if self.own_cluster and self.cluster is not None:
            self.cluster.close()
        self.cluster = None
        self._connect(report)
        self._load(self.model_path, report)

    def relaunch(self, report: Report) -> None:
        """Replace the ranks with fresh local ones and load the model again."""
        old = self.cluster
        n = old.size if old is not None else self.settings.ranks
        if old is not None and self.own_cluster:
            old.close()
        report("connect", 0, n)
        cluster = Cluster.launch(n, self.settings.blas, flags=rank_flags(self.settings),
                                 threads=self.settings.threads)
        cluster.connect()
        self.cluster, self.own_cluster = cluster, True
        if not self.closing.is_set():
            assert self.model_path is not None
            self._load(self.model_path, report)

    def switch_model(self, model: str, report: Report) -> None:
        """Every rank loads `model` from its own disk. On failure they all go back to the old one and
        the error is raised; a failure of that too raises BackendError."""
        assert self.cluster is not None and self.model_path is not None
        old, loading = self.model_path, False
        try:
            model_path, _ = resolve_model(model)
            tokenizer_dir = self._fetch(model_path, report)
            loading = True
            self._load(model_path, report)
            tokenizer = load_tokenizer(tokenizer_dir or model_path)
            self.speculate = self._speculation(tokenizer, model_path, report)
        except (BadInput, BackendError):
            if loading:  # some ranks may hold the new model already
                try:
                    self._load(old, report)
                except (BadInput, BackendError) as e:
                    raise BackendError(f"the ranks could not go back to {old}: {e}") from None
            raise
        self.model_path, self.tokenizer_dir, self.tokenizer = model_path, tokenizer_dir, tokenizer

    def take_notes(self) -> list[str]:
        """The lines kept since the last call. Emptied in place: `say` appends to this same list."""
        notes = list(self.notes)
        self.notes.clear()
        return notes

    def session_for(self, messages: list[Message], raw: bool = False) -> Session:
        """The session on the current ranks: a new one, with `messages`, for a new tokenizer (a new or
        switched model), otherwise the same one. `raw`: turns are not wrapped in the chat template."""
        assert self.cluster is not None and self.tokenizer is not None
        if self.session is None or self.session.tokenizer is not self.tokenizer:
            s = self.settings
            sampling = SamplingOptions(s.max_tokens, s.temp, s.top_p, s.seed)
            self.session = Session(self.cluster, self.tokenizer, raw=raw, algorithm=s.algorithm,
                                   sampling=sampling, prefix_cache=s.cache, shares=s.shares,
                                   speculate=self.speculate, draft_tokens=s.draft_tokens)
            self.session.messages = list(messages)
        return self.session

    def close(self, generating: bool) -> None:
        """Stop a generation under way and the ranks launched here (attached ones keep running)."""
        self.closing.set()
        if generating and self.session is not None:
            self.session.cancel()
        if self.own_cluster and self.cluster is not None:
            self.cluster.close()

    def _auto_stages(self, directory: str) -> Stages:
        """--stages auto: the fewest stages whose ranks hold the model's weights (read from the files
        here), an even split where it fits, else each stage the layers its ranks' memory holds."""
        cluster = self.cluster
        assert cluster is not None
        parts = weight_parts(Path(directory))
        if not parts.layers:
            self.say("--stages auto: the model's weights are not on this machine to measure; one stage")
            return ONE_STAGE
        free = cluster.free_memory()
        for stages in (p for p in range(1, cluster.size + 1) if cluster.size % p == 0):
            ring = cluster.size // stages
            counts = memory_split(parts, [min(free[s * ring:(s + 1) * ring]) for s in range(stages)])
            if counts is not None:
                even = counts == even_split(len(parts.layers), stages)
                return Stages(stages) if even else Stages(stages, tuple(counts))
        return ONE_STAGE  # no split holds it: the ranks refuse it by name

    def _stages_by_speed(self, stages: Stages, directory: str) -> Stages | None:
        """After a load of P stages split evenly on ranks of unequal speeds: layers per stage in
        proportion to the stages' measured speeds (a stage's layers over the time its ranks take for a
        token's worth of them, its ranks together), where that split differs and its weights fit the
        memory the ranks had before the load (None: keep the split loaded)."""
        cluster = self.cluster
        assert cluster is not None
        costs, groups = cluster.rank_costs, [cluster.stage_ranks(s) for s in range(stages.count)]
        unmeasured = not all(c.per_token_s for c in costs)
        if stages.count == 1 or stages.layers or cluster.equally_fast or unmeasured:
            return None
        counts = [end - first for first, end in (cluster.ranks[ranks[0]].layers for ranks in groups)]
        speeds = [n * sum(1 / costs[r].per_token_s for r in ranks)  # layers a second
                  for n, ranks in zip(counts, groups, strict=True)]
        split = speed_split(counts, speeds)
        parts = weight_parts(Path(directory))
        if split == counts or not parts.layers:
            return None
        free = [f + r.weight_bytes for f, r in zip(cluster.free_memory(), cluster.ranks, strict=True)]
        fits = parts.fits(split, [min(free[r] for r in ranks) for ranks in groups])
        return Stages(stages.count, tuple(split)) if fits else None

    def _speculation(self, tokenizer, model_path: str, report: Report) -> str:
        return resolve_speculation(self.settings.speculate, tokenizer, model_path,
                                   whole_model=not self.options.attached, report=report, say=self.say)

    def _fetch(self, model_path: str, report: Report) -> str | None:
        """A hub model's files (or a GGUF's conversion) for the front end: the whole model when the
        ranks are ours."""
        return front_end_copy(model_path, whole_model=not self.options.attached, report=report, say=self.say)

    def _load(self, model_path: str, report: Report) -> None:
        assert self.cluster is not None
        report("load", 0, self.cluster.size)
        stages = self.settings.stage_split
        if stages.auto:
            stages = self._auto_stages(self.tokenizer_dir or model_path)
        self.cluster.load(model_path, on_progress=lambda done, total: report("load", done, total),
                          kv_format=self.settings.kv_format, stages=stages)
        by_speed = self._stages_by_speed(stages, self.tokenizer_dir or model_path)
        if by_speed is not None:
            self.say(f"--stages {by_speed.count}: layers {','.join(map(str, by_speed.layers))}, by the "
                     "stages' measured speeds")
            self.cluster.load(model_path, on_progress=lambda done, total: report("load", done, total),
                              kv_format=self.settings.kv_format, stages=by_speed)
        if self.session is not None:
            self.session.attach(self.cluster)  # a load empties the ranks' KV: the next turn re-reads all
