"""The gateway's HTTP app: POST /v1/completions and /v1/chat/completions (streamed as SSE or
not), GET /v1/models, /health, /metrics. Handlers live at module level with typed request
bodies (so /docs and /openapi.json show them); the per-process state is one `Gateway`, built
at startup and kept in `app.state.gateway`. Tokenization, the chat template, incremental
detokenization and stop strings happen here; workers only see token ids."""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import orjson
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.context import Context
from starlette.types import Receive, Scope, Send

from evenflow import __version__, models
from evenflow.gateway.client import GatewayClient, RequestFailed
from evenflow.gateway.edge import Admission, EdgeMiddleware, read_api_keys
from evenflow.gateway.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    validation_error,
)
from evenflow.proto import errors
from evenflow.proto.hashing import namespace_salt
from evenflow.proto.messages import WORKER_ROLES, SamplingSpec
from evenflow.proto.tokenizer import IncrementalDetokenizer, Tokenizer, TokenizerError
from evenflow.services.config import MeshConfig
from evenflow.services.metrics import INFLIGHT, REQUESTS, TTFT, render
from evenflow.services.tracing import setup_tracing, shutdown_tracing


def _json(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(data), status_code=status, media_type="application/json",
                    headers=headers)


def _sse(data: Any) -> bytes:
    return b"data: " + (data if isinstance(data, bytes) else orjson.dumps(data)) + b"\n\n"


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int = 0
    cached_tokens: int = 0

    def body(self) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


@dataclass
class Job:
    """One validated request, ready to run."""

    kind: str  # "completion" | "chat"
    request_id: str
    model: str
    prompt_ids: list[int]
    spec: SamplingSpec
    stop: list[str]
    stream: bool
    include_usage: bool
    deadline: float  # time.monotonic() by which the request must be done
    usage: Usage = field(init=False)

    def __post_init__(self) -> None:
        self.usage = Usage(len(self.prompt_ids))


class Gateway:
    """This process's gateway: tokenizer, tracer and the client of the worker fleet."""

    def __init__(self, config: MeshConfig) -> None:
        self.config = config
        model_dir = models.resolve_model(config.model)
        if model_dir is None:
            raise ValueError(f"model {config.model!r} is neither built in nor a directory")
        self.tokenizer = Tokenizer(model_dir)
        self.max_model_len = models.default_max_model_len(  # the same limit as the engine's
            model_dir, config.max_model_len or None)
        self.tracer = setup_tracing("evenflow-gateway")
        # The engine salts block hashes with the checkpoint directory's name; so do we.
        self.client = GatewayClient(config, self.tracer, namespace_salt(model_dir.name))
        self.admission = Admission(config.max_inflight, config.max_queued)
        self.drain_deadline = math.inf  # set on SIGTERM: streams must end by then

    @property
    def draining(self) -> bool:
        return self.drain_deadline < math.inf

    def begin_drain(self) -> None:
        """SIGTERM: refuse new requests (503); running ones get drain_timeout_s to finish,
        then end with an error event."""
        if not self.draining:
            self.drain_deadline = time.monotonic() + self.config.drain_timeout_s

    def build_job(self, kind: str, req: CompletionRequest | ChatCompletionRequest) -> Job:
        """Tokenize and check a request against the model; raises APIError."""
        if req.model != self.config.model_name:
            raise APIError(404, f"The model `{req.model}` does not exist.", "NotFoundError",
                           "model", "model_not_found")
        try:
            if isinstance(req, ChatCompletionRequest):
                prompt_ids = self.tokenizer.encode_chat(
                    [{"role": m.role, "content": m.text()} for m in req.messages])
            elif isinstance(req.prompt, str):
                prompt_ids = self.tokenizer.encode(req.prompt)
            else:
                prompt_ids = [t for t in req.prompt if isinstance(t, int)]
        except TokenizerError as exc:
            raise APIError(400, str(exc), param="messages") from None
        vocab = self.tokenizer.vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
        if not prompt_ids:
            raise APIError(400, "the prompt is empty", param="prompt")
        if any(t >= vocab for t in req.stop_token_ids):
            raise APIError(400, f"stop_token_ids must be in [0, {vocab})", param="stop_token_ids")
        room = self.max_model_len - len(prompt_ids)
        max_tokens = req.requested_max_tokens or (16 if kind == "completion" else room)
        if room < 1 or max_tokens > room:
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} "
                           f"tokens. However, you requested {len(prompt_ids) + max_tokens} "
                           f"tokens ({len(prompt_ids)} in the prompt, {max_tokens} for the "
                           "completion).", param="messages" if kind == "chat" else "prompt",
                           code="context_length_exceeded")
        spec = SamplingSpec(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                            seed=req.seed, max_tokens=max_tokens,
                            stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos)
        prefix = "cmpl-" if kind == "completion" else "chatcmpl-"
        budget = min(req.timeout or self.config.request_timeout_s, self.config.request_timeout_s)
        return Job(kind, prefix + uuid.uuid4().hex, req.model, prompt_ids, spec,
                   req.stop_strings, req.stream,
                   bool(req.stream_options and req.stream_options.include_usage),
                   time.monotonic() + budget)

    async def run(self, job: Job) -> AsyncIterator[tuple[str, str | None]]:
        """Yield (text delta, finish reason or None); job.usage follows along."""
        detok = IncrementalDetokenizer(self.tokenizer, job.prompt_ids, job.stop)
        started = time.monotonic()
        try:
            async with aclosing(self._deltas(job, detok, started)) as deltas:
                async for item in deltas:
                    yield item
        except RequestFailed as exc:
            if exc.code == errors.TIMEOUT and time.monotonic() >= self.drain_deadline:
                raise RequestFailed(errors.DRAINING, "the gateway shut down before the request "
                                    "finished") from None
            raise

    async def _deltas(self, job: Job, detok: IncrementalDetokenizer,
                      started: float) -> AsyncGenerator[tuple[str, str | None]]:
        first = True
        with self.tracer.start_as_current_span("stream") as span:
            async for delta in self.client.generate(job.prompt_ids, job.spec, job.request_id,
                                                    min(job.deadline, self.drain_deadline)):
                if first:
                    TTFT.observe(time.monotonic() - started)
                    job.usage.cached_tokens = delta.num_cached_tokens
                    first = False
                job.usage.completion_tokens += len(delta.token_ids)
                text = detok.add(delta.token_ids)
                if detok.stopped:  # a stop string: cut here; client.generate cancels downstream
                    yield text, "stop"
                    return
                finish = delta.finish_reason
                if finish is not None:
                    text += detok.flush()
                    yield text, ("stop" if finish == "abort" else finish)
                    span.set_attribute("gen_ai.usage.output_tokens", job.usage.completion_tokens)
                    return
                if text:
                    yield text, None


def _error_from_failure(exc: RequestFailed) -> APIError:
    if exc.code == errors.TIMEOUT:
        return APIError(504, f"The request timed out: {exc.description}", "timeout_error",
                        code="timeout")
    if exc.code in (errors.NO_CAPACITY, errors.DRAINING):
        return APIError(503, f"The server is overloaded: {exc.description}", "overloaded_error",
                        code="overloaded", headers={"Retry-After": "1"})
    if exc.code == errors.BAD_REQUEST:
        return APIError(400, exc.description)
    return APIError(500, f"Internal error: {exc.description}", "internal_error", code=exc.code)


# -- handlers ---------------------------------------------------------------------------------
router = APIRouter()


def _gateway(request: Request) -> Gateway:
    gateway: Gateway | None = request.app.state.gateway
    if gateway is None:  # before startup finished
        raise APIError(503, "The gateway is starting.", "overloaded_error", code="starting")
    return gateway


@router.get("/health")
async def health(request: Request) -> Response:
    gateway: Gateway | None = request.app.state.gateway
    if gateway is None:
        return _json({"status": "starting", "workers": {}}, 503)
    workers = {str(role): len(gateway.client.registry.live(role)) for role in WORKER_ROLES}
    if gateway.client.ready():
        return _json({"status": "ok", "workers": workers})
    return _json({"status": "starting", "workers": workers}, 503)


@router.get("/metrics")
async def metrics() -> Response:
    body, content_type = render()
    return Response(body, media_type=content_type)


@router.get("/v1/models")
async def list_models(request: Request) -> Response:
    gateway = _gateway(request)
    return _json({"object": "list", "data": [{
        "id": gateway.config.model_name, "object": "model", "created": 0,
        "owned_by": "evenflow", "max_model_len": gateway.max_model_len}]})


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    return await _handle(_gateway(request), "completion", body)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    return await _handle(_gateway(request), "chat", body)


async def _handle(gateway: Gateway, kind: str,
                  body: CompletionRequest | ChatCompletionRequest) -> Response:
    if gateway.draining:
        raise APIError(503, "The gateway is shutting down.", "overloaded_error",
                       code="draining", headers={"Retry-After": "1"})
    job = gateway.build_job(kind, body)
    # The slot is released exactly once, by whoever ends the response: _complete's finally,
    # or the streaming response once it is done.
    await gateway.admission.acquire()
    span = gateway.tracer.start_span(  # ended when the response is complete
        "gateway.request", kind=trace.SpanKind.SERVER,
        attributes={"gen_ai.operation.name": kind, "gen_ai.request.model": job.model,
                    "gen_ai.request.id": job.request_id,
                    "gen_ai.usage.input_tokens": len(job.prompt_ids)})
    ctx = trace.set_span_in_context(span)
    if job.stream:
        return _AdmittedStream(_stream(gateway, job, ctx, span), gateway.admission.release)
    return await _complete(gateway, job, ctx, span)


async def _complete(gateway: Gateway, job: Job, ctx: Context, span: trace.Span) -> Response:
    text, finish = "", None
    token = otel_context.attach(ctx)
    INFLIGHT.inc()
    try:
        async for delta, finish in gateway.run(job):  # noqa: B007 (the last finish counts)
            text += delta
    except RequestFailed as exc:
        REQUESTS.labels(job.kind, "error").inc()
        raise _error_from_failure(exc) from None
    finally:
        INFLIGHT.dec()
        otel_context.detach(token)
        span.end()
        gateway.admission.release()
    REQUESTS.labels(job.kind, "ok").inc()
    choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish}
    if job.kind == "chat":
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    return _json({"id": job.request_id, "created": int(time.time()), "model": job.model,
                  "object": "chat.completion" if job.kind == "chat" else "text_completion",
                  "choices": [choice], "usage": job.usage.body()})


def _chunk(job: Job, text: str | None, finish: str | None, first: bool) -> dict[str, Any]:
    choice: dict[str, Any]
    if job.kind == "chat":
        delta: dict[str, Any] = {"role": "assistant", "content": text or ""} if first else (
            {"content": text} if text else {})
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        obj = "text_completion"
    return {"id": job.request_id, "object": obj, "created": int(time.time()),
            "model": job.model, "choices": [choice]}


async def _stream(gateway: Gateway, job: Job, ctx: Context,
                  span: trace.Span) -> AsyncIterator[bytes]:
    token = otel_context.attach(ctx)
    INFLIGHT.inc()
    first, outcome = True, "ok"
    try:
        async for delta, finish in gateway.run(job):
            yield _sse(_chunk(job, delta, finish, first))
            first = False
        if job.include_usage:
            yield _sse({"id": job.request_id, "created": int(time.time()), "model": job.model,
                        "object": "chat.completion.chunk" if job.kind == "chat"
                        else "text_completion", "choices": [], "usage": job.usage.body()})
    except RequestFailed as exc:
        outcome = "error"
        yield _sse(_error_from_failure(exc).body())
    except BaseException:
        outcome = "cancelled"  # the client went away: client.generate cancelled downstream
        raise
    finally:
        INFLIGHT.dec()
        REQUESTS.labels(job.kind, outcome).inc()
        span.end()
        otel_context.detach(token)
    yield b"data: [DONE]\n\n"


class _AdmittedStream(StreamingResponse):
    """An SSE response that gives its admission slot back however it ends (finished, failed,
    or the client gone before the first byte, when the body generator never even starts)."""

    def __init__(self, body: AsyncIterator[bytes], release: Callable[[], None]) -> None:
        super().__init__(body, media_type="text/event-stream")
        self._release = release

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._release()


# -- the app ----------------------------------------------------------------------------------
def create_app(config: MeshConfig) -> FastAPI:
    """The app; its Gateway is built at startup, not here: the app object may be pickled to
    another process first (Ray Serve), and the tokenizer does not pickle."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        gateway = Gateway(config)
        await gateway.client.start()
        app.state.gateway = gateway
        yield
        app.state.gateway = None
        await gateway.client.close()
        shutdown_tracing()

    app = FastAPI(title="evenflow", version=__version__, lifespan=lifespan)
    app.state.gateway = None
    app.include_router(router)
    app.add_middleware(EdgeMiddleware, config=config, api_keys=read_api_keys(config))

    @app.exception_handler(APIError)
    async def _api_error(_request: Request, exc: APIError) -> Response:
        return _json(exc.body(), exc.status, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_request: Request, exc: RequestValidationError) -> Response:
        return _json(validation_error(exc).body(), 400)

    return app

