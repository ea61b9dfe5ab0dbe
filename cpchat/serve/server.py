"""`cpchat serve`: the ranks behind an OpenAI-compatible HTTP API.

Starlette routes on uvicorn: the ASGI pair most Python services of this kind stand on (FastAPI is
Starlette underneath), small, with server-sent events and no compiled parts. The routes stay thin:
requests are read by cpchat.serve.openai_api and run by cpchat.serve.generation.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import signal
import socket
import sys
from collections.abc import AsyncIterator, Awaitable, Callable

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from cpchat import EXIT_BACKEND, EXIT_OK, EXIT_USAGE
from cpchat.checkpoints.resolve import DownloadLines
from cpchat.client.cluster import Cluster
from cpchat.client.connect import ClusterOptions, is_loopback
from cpchat.client.events import Progress, Token
from cpchat.client.frontend import Frontend
from cpchat.client.held import HeldConversations
from cpchat.client.session import Session
from cpchat.client.settings import resolve_settings
from cpchat.errors import BackendError, BadInput
from cpchat.serve.generation import Generation, Piece, RankQueue, api_error_of
from cpchat.serve.metrics import ServerMetrics
from cpchat.serve.openai_api import (
    ApiError,
    GenerationParams,
    TokenLogprob,
    chat_chunk,
    chat_response,
    completion_chunk,
    completion_response,
    new_id,
    parse_chat,
    parse_completion,
    prompt_progress,
)
from cpchat.serve.scheduler import Scheduler

MAX_REQUEST_BYTES = 64 << 20  # a request body past this is refused (413)
DRAIN_FACTOR = 4  # a body up to this many times the bound is read (and dropped) before its 413
SHUTDOWN_GRACE_S = 5  # on SIGTERM, answers under way get this long to finish
HELD_CONVERSATIONS = 64  # conversations the ranks keep at most (besides --kv-cache-bytes)


def say(line: str) -> None:
    print(f"cpchat serve: {line}", file=sys.stderr, flush=True)


class Service:
    """What the routes delegate to: the model's name, the session on the ranks and their queue."""

    def __init__(self, session: Session, model_id: str, defaults: GenerationParams, max_queue: int,
                 max_request_bytes: int = MAX_REQUEST_BYTES, reconnect: Callable[[], None] | None = None,
                 max_batch: int = 1, prefill_chunk: int = 0) -> None:
        self.session, self.model_id, self.defaults = session, model_id, defaults
        self.reconnect = reconnect  # ranks that stopped answering: start or reach them again
        self.max_request_bytes = max_request_bytes
        self.metrics = ServerMetrics()
        self.queue = RankQueue(max_queue, Scheduler(session, max_batch, self.ranks_answer, prefill_chunk,
                                                    self.metrics.step_rows.observe))

    # ---- requests

    async def read_json(self, request: Request) -> object:
        """The body as JSON. One past the bound is read to its end (up to DRAIN_FACTOR times the bound)
        before the 413: a client sends its whole body before it reads, and one cut off mid-send sees a
        broken pipe, not the refusal."""
        drain = DRAIN_FACTOR * self.max_request_bytes
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > drain:
            raise self._too_large()
        body, seen = bytearray(), 0
        async for chunk in request.stream():
            seen += len(chunk)
            if seen > drain:
                raise self._too_large()
            if seen <= self.max_request_bytes:
                body += chunk
        if seen > self.max_request_bytes:
            raise self._too_large()
        try:
            return json.loads(body)
        except ValueError as e:
            raise ApiError(400, f"the request body is not valid JSON: {e}") from None

    def _too_large(self) -> ApiError:
        return ApiError(413, f"the request body is larger than {self.max_request_bytes:,} bytes",
                        code="request_too_large")

    def fit(self, tokens: list[int], params: GenerationParams) -> GenerationParams:
        """Refuse a prompt past the model's context; an answer gets at most the tokens left in it."""
        limit = self.session.context_limit
        if limit and len(tokens) >= limit:
            raise ApiError(400, f"This model's maximum context length is {limit:,} tokens. However, your "
                                f"prompt is {len(tokens):,} tokens.", param="messages",
                           code="context_length_exceeded")
        if limit:
            params.max_tokens = min(params.max_tokens, limit - len(tokens))
        return params

    async def start(self, tokens: list[int], params: GenerationParams) -> Generation:
        """Wait for the ranks (or be refused) and start the generation: the scheduler checks that the
        ranks answer and have the memory for it first."""
        generation = Generation(tokens, self.fit(tokens, params))
        await self.queue.start(generation)
        return generation

    def ranks_answer(self) -> None:
        """Before a request: ranks that stopped answering (one died mid-answer, or since) are started or
        reached again, the model loaded; BackendError, as 503, while they cannot be."""
        silent = self.session.cluster.unanswering()
        if silent and self.reconnect is not None:
            names = ", ".join(f"rank {r.rank} ({r.address})" for r, _ in silent)
            say(f"{names} stopped answering; starting the ranks again")
            try:
                self.reconnect()
            except (BackendError, BadInput) as e:
                raise BackendError(f"{names} stopped answering, and the ranks could not be started again: "
                                   f"{e}") from None
            say("the ranks answer again; the model is loaded")

    async def answer(self, request: Request, tokens: list[int], params: GenerationParams, chat: bool
                     ) -> Response:
        """Run the generation and answer with it: chunk by chunk as events, or whole."""
        generation = await self.start(tokens, params)
        kind = "chat" if chat else "completion"
        rid, model = new_id("chatcmpl" if chat else "cmpl"), self.model_id
        if params.stream:
            def chunk(body, finish=None, logprobs=None, usage=None, offset=0) -> dict:
                if chat:
                    return chat_chunk(rid, model, body, finish, logprobs, usage)
                return completion_chunk(rid, model, body, finish, logprobs, usage, offset)

            first = {"role": "assistant", "content": ""} if chat else None
            return EventStream(stream(self, generation, chunk, first), lambda: self.finish(generation, kind))
        try:
            text, tokens = await self.collect(request, generation)
        finally:
            await self.finish(generation, kind)
        whole = chat_response if chat else completion_response
        logprobs = self.logprobs(tokens) if params.logprobs else None
        return JSONResponse(whole(rid, model, text, generation.outcome, logprobs))

    async def finish(self, generation: Generation, kind: str) -> None:
        await generation.close()
        self.queue.finished(cancelled=not generation.finished)
        self.metrics.finished(kind, generation.outcome, generation.finished)
        o = generation.outcome
        end = f"{o.completion_tokens} generated, TTFT {o.ttft_ms:,.0f} ms, {o.decode_tokens_per_s:.1f} tok/s"
        say(f"{kind}: {o.prompt_tokens:,} prompt tokens ({o.cached_tokens:,} reused), "
            + (end if generation.finished else "stopped: the client went away"))

    def chat_tokens(self, messages: list[dict[str, str]]) -> list[int]:
        """The messages through the model's chat template, as the ranks will read them."""
        try:
            return list(self.session.tokenizer.apply_chat_template(messages, add_generation_prompt=True))
        except Exception as e:  # a template's own refusal (e.g. no system role), in Jinja's words
            raise ApiError(400, f"the model's chat template refused these messages: {e}",
                           param="messages") from None

    def logprobs(self, tokens: list[Token]) -> list[TokenLogprob]:
        """Tokens as the logprobs fields name them: each alternative by its own text."""
        decode = self.session.tokenizer.decode
        return [TokenLogprob(t.text, t.logprob, [(decode([i]), lp) for i, lp in t.top]) for t in tokens]

    async def collect(self, request: Request, generation: Generation) -> tuple[str, list[Token]]:
        """The whole answer, stopping the ranks if the client goes away before it is done."""
        text: list[str] = []
        tokens: list[Token] = []

        async def read() -> None:
            async for piece in generation.pieces():
                if isinstance(piece, Piece):
                    text.append(piece.text)
                    tokens.extend(piece.tokens)

        reader = asyncio.ensure_future(read())
        while not reader.done():
            await asyncio.wait({reader}, timeout=0.25)
            if not reader.done() and await request.is_disconnected():
                reader.cancel()
                raise ApiError(499, "the client went away")
        reader.result()
        return "".join(text), tokens

    # ---- what the ranks hold

    async def health(self) -> dict:
        cluster, state, held = self.session.cluster, self.queue.state, self.session.conversations
        stats = await asyncio.to_thread(cluster.stats_once)
        return {"status": "ok", "model": self.model_id, "running": self.queue.running,
                "waiting": self.queue.waiting,
                "served": state.served, "cancelled": state.cancelled, "held_tokens": held.tokens,
                "held_conversations": len(held.by_name),
                "ranks": [{"rank": s.rank, "address": s.address, "state": s.state, "kv_tokens": s.kv_tokens,
                           "kv_bytes": s.kv_bytes, "state_bytes": s.state_bytes, "conversations": s.sequences,
                           "rss_bytes": s.rss_bytes} for s in stats]}

    async def metrics_text(self) -> bytes:
        """The metrics, with what the ranks hold now (none where some rank does not answer)."""
        try:
            stats = await asyncio.to_thread(self.session.cluster.stats_once)
        except BackendError:
            stats = []
        held = len(self.session.conversations.by_name)
        return self.metrics.text(self.queue.waiting, self.queue.running, held, stats)


class EventStream(StreamingResponse):
    """Server-sent events, and `on_close` however the stream ends: done, or the client gone."""

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], Awaitable[None]]) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.on_close()


def sse(data: object) -> str:
    return f"data: {json.dumps(data)}\n\n"


async def stream(service: Service, generation: Generation, chunk: Callable[..., dict], first: dict | None
                 ) -> AsyncIterator[str]:
    """A generation as server-sent events: `chunk(text or delta, finish, logprobs, usage, offset)` shapes
    each. Prefill progress goes as comments (clients skip them; a client gone shows the sooner), or
    where the request asks (`return_progress`) as chunks with llama.cpp's `prompt_progress`."""
    params, offset = generation.params, 0
    if first is not None:
        yield sse(chunk(first))
    try:
        async for piece in generation.pieces():
            if isinstance(piece, Progress):
                if params.return_progress:
                    progress = prompt_progress(piece.total, piece.cached, piece.processed, piece.ms)
                    yield sse(chunk({} if first is not None else "") | progress)
                else:
                    yield f": prefill {piece.processed}/{piece.total - piece.cached}\n\n"
                continue
            body = {"content": piece.text} if first is not None else piece.text
            logprobs = service.logprobs(piece.tokens) if params.logprobs else None
            yield sse(chunk(body, logprobs=logprobs, offset=offset))
            offset += len(piece.text)
    except ApiError as e:
        yield sse(e.body())
        return
    yield sse(chunk({} if first is not None else "", finish=generation.outcome.finish_reason))
    if params.include_usage:
        yield sse(chunk({} if first is not None else "", usage=generation.outcome.usage()))
    yield "data: [DONE]\n\n"


def make_app(service: Service, api_key: str | None) -> Starlette:
    """The routes; with `api_key`, every request must carry it as a bearer token."""

    def authorised(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise ApiError(401, "a valid API key is required: Authorization: Bearer <key>",
                           code="invalid_api_key")

    async def chat(request: Request) -> Response:
        authorised(request)
        req = parse_chat(await service.read_json(request), service.model_id, service.defaults)
        return await service.answer(request, service.chat_tokens(req.messages), req.params, chat=True)

    async def completions(request: Request) -> Response:
        authorised(request)
        req = parse_completion(await service.read_json(request), service.model_id, service.defaults)
        prompt = req.prompt
        tokens = list(prompt) if isinstance(prompt, list) else list(service.session.tokenizer.encode(prompt))
        return await service.answer(request, tokens, req.params, chat=False)

    async def models(request: Request) -> Response:
        authorised(request)
        return JSONResponse({"object": "list", "data": [
            {"id": service.model_id, "object": "model", "created": 0, "owned_by": "cpchat",
             "max_model_len": service.session.context_limit}]})  # vLLM's name for the context

    async def health(request: Request) -> Response:
        authorised(request)
        return JSONResponse(await service.health())

    async def metrics(request: Request) -> Response:
        authorised(request)
        return Response(await service.metrics_text(), media_type=CONTENT_TYPE_LATEST)

    async def api_error(request: Request, error: Exception) -> Response:
        assert isinstance(error, ApiError)
        service.metrics.refused.labels(str(error.status)).inc()
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    async def backend_error(request: Request, error: Exception) -> Response:
        """The ranks failed (one died, or stopped answering) before or while a request ran: 503."""
        return await api_error(request, api_error_of(error))

    async def internal_error(request: Request, error: Exception) -> Response:
        say(f"internal error on {request.url.path}: {type(error).__name__}: {error}")
        body = ApiError(500, f"internal error: {type(error).__name__}", kind="server_error").body()
        return JSONResponse(body, status_code=500)

    async def http_error(request: Request, error: Exception) -> Response:
        assert isinstance(error, HTTPException)
        body = ApiError(error.status_code, str(error.detail)).body()
        return JSONResponse(body, status_code=error.status_code)

    return Starlette(routes=[
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ], exception_handlers={ApiError: api_error, BackendError: backend_error, HTTPException: http_error,
                           Exception: internal_error})


class Shutdown(Exception):
    """SIGTERM or Ctrl+C: uvicorn has finished its requests and hands the signal on to us."""


def _shutdown(signum, frame) -> None:
    raise Shutdown


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise BadInput(f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.listen(128)
    return sock


def batch_size(asked: int, cluster: Cluster) -> int:
    """--max-batch, or 1 where a batched step cannot run (it says why)."""
    if asked > 1 and cluster.stages > 1:
        say("answers decode one at a time: pipeline stages run one request at a time")
        return 1
    return asked


def run_serve(args: argparse.Namespace, options: ClusterOptions) -> int:
    """0 after a clean shutdown (Ctrl+C, SIGTERM), 2 on bad input, 3 when the ranks fail at startup."""
    import uvicorn

    api_key = args.api_key or os.environ.get("CPCHAT_API_KEY") or None
    front, sock, service = None, None, None
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _shutdown)
    try:
        if not is_loopback(args.host) and api_key is None and not args.insecure:
            raise BadInput(f"--host {args.host} reaches beyond this machine: give --api-key (or "
                           "CPCHAT_API_KEY), or --insecure to serve anyone who can connect")
        settings = resolve_settings(args)
        sock = bind(args.host, args.port)
        front = Frontend(settings, options, say=say)
        front.start(DownloadLines())
        cluster = front.cluster
        assert cluster is not None
        session = front.session_for([], raw=True)
        session.conversations = HeldConversations(HELD_CONVERSATIONS, args.kv_cache_bytes)
        model_id = settings.model or "demo"
        defaults = GenerationParams(settings.max_tokens, settings.temp, settings.top_p, settings.seed)
        max_batch = batch_size(args.max_batch, cluster)
        service = Service(session, model_id, defaults, args.max_queue, args.max_request_bytes,
                          reconnect=lambda: front.reconnect(DownloadLines()), max_batch=max_batch,
                          prefill_chunk=args.prefill_chunk)
        host, port = sock.getsockname()[:2]
        shown = f"[{host}]" if ":" in host else host
        stages = f" as {cluster.stages} pipeline stages" if cluster.stages > 1 else ""
        say(f"{model_id} on {cluster.size} ranks ({', '.join(r.address for r in cluster.ranks)}){stages}; "
            f"listening on http://{shown}:{port}/v1" + ("" if api_key is None else " (API key required)"))
        config = uvicorn.Config(make_app(service, api_key), log_level="warning", access_log=False,
                                lifespan="off", timeout_graceful_shutdown=SHUTDOWN_GRACE_S)
        uvicorn.Server(config).run(sockets=[sock])
        return EXIT_OK
    except Shutdown:
        say("stopped")
        return EXIT_OK
    except BadInput as e:
        say(str(e))
        return EXIT_USAGE
    except BackendError as e:
        say(str(e))
        return EXIT_BACKEND
    finally:
        if sock is not None:
            sock.close()
        if service is not None:
            service.queue.stop()
        if front is not None:
            front.close(generating=True)
