"""`cpchat --headless`: scripted runs with plain text or JSON-lines output."""

from __future__ import annotations

import argparse
import json
import signal
import sys
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

from cpchat import EXIT_BACKEND, EXIT_OK, EXIT_USAGE
from cpchat.checkpoints.resolve import DownloadLines
from cpchat.client.connect import ClusterOptions
from cpchat.client.events import EVENT_NAMES, Error, Progress, RankAddress, Ready, Token
from cpchat.client.frontend import Frontend
from cpchat.client.settings import resolve_settings
from cpchat.errors import BackendError, BadInput
from cpchat.format import human_duration

LONG_PREFILL_S = 30  # a prefill longer than this is announced on stderr, with its estimate


class Output:
    def __init__(self, as_json: bool, progress: bool = False) -> None:
        self.as_json = as_json
        self.progress = progress  # plain mode: prefill progress on stderr

    def event(self, ev: object) -> None:
        name = EVENT_NAMES.get(type(ev))
        if self.as_json:
            if name:
                fields = asdict(ev)
                if isinstance(ev, Token) and not ev.top:
                    del fields["top"]  # only the server asks for alternatives
                print(json.dumps({"event": name, **fields}), flush=True)
        elif isinstance(ev, Token):
            sys.stdout.write(ev.text)
            sys.stdout.flush()
        elif isinstance(ev, Progress) and self.progress:
            new = ev.total - ev.cached
            share = 100 * ev.processed // max(new, 1)
            print(f"cpchat: prefill {ev.processed:,}/{new:,} new tokens ({share} %), {ev.ms / 1000:.1f} s",
                  file=sys.stderr, flush=True)

    def end_turn(self) -> None:
        if not self.as_json:
            print(flush=True)

    def error(self, message: str) -> None:
        if self.as_json:
            self.event(Error(message))
        diagnostic(message)


def diagnostic(line: str) -> None:
    print(f"cpchat: {line}", file=sys.stderr, flush=True)


def read_turns(args: argparse.Namespace) -> Iterator[tuple[str, list[str]]]:
    """(text, docs) per user turn: --prompt, --prompt-file, or stdin lines."""
    if args.prompt is not None or args.prompt_file is not None:
        if args.prompt_file is not None:
            try:
                text = Path(args.prompt_file).read_text(encoding="utf-8")
            except FileNotFoundError:
                raise BadInput(f"prompt file {args.prompt_file} does not exist") from None
            except (OSError, UnicodeDecodeError) as e:
                raise BadInput(f"cannot read prompt file {args.prompt_file}: {e}") from None
        else:
            text = args.prompt
        if not text.strip() and not args.doc:
            raise BadInput("the prompt is empty")
        yield text, list(args.doc)
        return
    docs = list(args.doc)
    for line in sys.stdin:
        line = line.rstrip("\n")
        if not line.strip():
            continue
        text, extra = line, []
        if line.lstrip().startswith("{"):
            try:
                turn = json.loads(line)
            except ValueError:
                raise BadInput(f"stdin line is not valid JSON: {line[:60]}") from None
            if not isinstance(turn, dict) or not isinstance(turn.get("content"), str):
                raise BadInput('a JSON turn needs {"content": "...", "docs": [...]}')
            text, extra = turn["content"], list(turn.get("docs") or [])
        yield text, docs + extra
        docs = []


def _terminate(signum, frame) -> None:
    raise SystemExit(128 + signum)


def run_headless(args: argparse.Namespace, options: ClusterOptions) -> int:
    out = Output(args.json, args.progress)
    signal.signal(signal.SIGTERM, _terminate)
    front = None
    try:
        settings = resolve_settings(args)
        for doc in args.doc:
            if not Path(doc).exists():
                raise BadInput(f"document {doc} does not exist (no such file or folder)")
        if args.prompt_file is not None and not Path(args.prompt_file).is_file():
            raise BadInput(f"prompt file {args.prompt_file} does not exist")
        front = Frontend(settings, options, say=diagnostic)
        description = front.start(DownloadLines())
        if not settings.model:
            diagnostic(f"using {description}")
        cluster = front.cluster
        assert cluster is not None
        out.event(Ready(settings.model or "demo",
                        [RankAddress(r.rank, r.address, r.blas_label, r.blas.threads, round(speed, 1),
                                     r.stage, r.layers, r.weight_bytes, r.products, r.products_note)
                         for r, speed in zip(cluster.ranks, cluster.speeds(), strict=True)],
                        transport=cluster.transport_label, kv_bits=cluster.model.kv_format.bits,
                        shares=settings.shares, stages=cluster.stages))
        if warning := cluster.slow_blas_warning():
            diagnostic(warning)
        session = front.session_for([], raw=args.raw)
        for text, docs in read_turns(args):
            turn = session.prepare(text, docs)
            if session.fits(turn) and (refused := session.turn_shortfall(turn)):
                raise refused  # before its prefill's estimate: it would not run
            estimate = session.prefill_estimate_s(turn) if session.fits(turn) else None
            if estimate is not None and estimate > LONG_PREFILL_S:
                print(f"cpchat: {len(turn.tokens):,} prompt tokens; the prefill should take about "
                      f"{human_duration(estimate)}", file=sys.stderr, flush=True)
            for event in session.run(turn):
                out.event(event)
            out.end_turn()
        return EXIT_OK
    except BadInput as e:
        out.error(str(e))
        return EXIT_USAGE
    except BackendError as e:
        out.error(str(e))
        return EXIT_BACKEND
    except KeyboardInterrupt:
        out.error("interrupted")
        return 130
    finally:
        if front is not None:
            front.close(generating=False)
