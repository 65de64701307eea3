"""The gateway's HTTP app: POST /v1/completions and /v1/chat/completions (streamed as SSE or
not), GET /v1/models, /health, /metrics. Handlers live at module level with typed request
bodies (so /docs and /openapi.json show them); the per-process state is one `Gateway`, built
at startup and kept in `app.state.gateway`. Tokenization, the chat template, incremental
detokenization and stop strings happen here; workers only see token ids."""

from __future__ import annotations

import dataclasses
import functools
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
from evenflow.gateway.fanout import merged
from evenflow.gateway.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    validation_error,
)
from evenflow.gateway.render import (
    LogprobRenderer,
    Piece,
    TokenLogprob,
    Usage,
    choice_body,
    chunk_body,
    completion_body,
    usage_chunk,
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
class Job:
    """One validated request, ready to run (with n > 1, one per choice: `choices()`)."""

    kind: str  # "completion" | "chat"
    request_id: str
    model: str
    prompt_ids: list[int]
    spec: SamplingSpec
    stop: list[str]
    stream: bool
    include_usage: bool
    deadline: float  # time.monotonic() by which the request must be done
    n: int = 1
    logprobs: int | None = None  # top logprobs per token wanted (0: the chosen's only)
    include_stop: bool = False
    continuous_usage: bool = False
    usage: Usage = field(init=False)

    def __post_init__(self) -> None:
        self.usage = Usage(len(self.prompt_ids))

    def choices(self) -> list[Job]:
        """One job per choice: its own id and usage; a seed offset by the choice's index."""
        if self.n == 1:
            return [self]
        return [dataclasses.replace(
            self, request_id=f"{self.request_id}-{i}", n=1,
            spec=dataclasses.replace(self.spec, seed=None if self.spec.seed is None
                                     else (self.spec.seed + i) % (1 << 63)))
            for i in range(self.n)]

    def total_usage(self, choices: list[Job]) -> Usage:
        return Usage(len(self.prompt_ids), sum(c.usage.completion_tokens for c in choices),
                     choices[0].usage.cached_tokens)


class Gateway:
    """This process's gateway: tokenizer, tracer and the client of the worker fleet."""

    def __init__(self, config: MeshConfig) -> None:
        self.config = config
        model_dir = models.resolve_model(config.model)
        if model_dir is None:
            raise ValueError(f"model {config.model!r} is neither built in nor a directory")
        self.tokenizer = Tokenizer(model_dir)
        self.logprob_renderer = LogprobRenderer(self.tokenizer)
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
                prompt_ids = self.tokenizer.encode(self.tokenizer.apply_chat_template(
                    [{"role": m.role, "content": m.text()} for m in req.messages],
                    req.add_generation_prompt), add_special_tokens=req.add_special_tokens)
            elif isinstance(req.prompt, str):
                prompt_ids = self.tokenizer.encode(req.prompt, req.add_special_tokens)
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
        if any(t >= vocab for t, _ in req.bias_pairs):
            raise APIError(400, f"logit_bias keys must be token ids in [0, {vocab})",
                           param="logit_bias")
        if any(t >= vocab for t in req.allowed_token_ids or ()):
            raise APIError(400, f"allowed_token_ids must be in [0, {vocab})",
                           param="allowed_token_ids")
        room = self.max_model_len - len(prompt_ids)
        max_tokens = req.requested_max_tokens or (16 if kind == "completion" else room)
        if room < 1 or max_tokens > room:
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} "
                           f"tokens. However, you requested {len(prompt_ids) + max_tokens} "
                           f"tokens ({len(prompt_ids)} in the prompt, {max_tokens} for the "
                           "completion).", param="messages" if kind == "chat" else "prompt",
                           code="context_length_exceeded")
        if req.min_tokens > max_tokens:
            raise APIError(400, "min_tokens must not exceed max_tokens", param="min_tokens")
        logprobs = req.top_logprobs_wanted
        spec = SamplingSpec(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                            seed=req.seed, max_tokens=max_tokens,
                            stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos,
                            min_p=req.min_p, presence_penalty=req.presence_penalty,
                            frequency_penalty=req.frequency_penalty,
                            repetition_penalty=req.repetition_penalty,
                            min_tokens=req.min_tokens, logit_bias=req.bias_pairs,
                            allowed_token_ids=list(req.allowed_token_ids or ()),
                            logprobs=-1 if logprobs is None else logprobs)
        prefix = "cmpl-" if kind == "completion" else "chatcmpl-"
        budget = min(req.timeout or self.config.request_timeout_s, self.config.request_timeout_s)
        options = req.stream_options
        return Job(kind, prefix + uuid.uuid4().hex, req.model, prompt_ids, spec,
                   req.stop_strings, req.stream, bool(options and options.include_usage),
                   time.monotonic() + budget, n=req.n, logprobs=logprobs,
                   include_stop=req.include_stop_str_in_output,
                   continuous_usage=bool(options and options.continuous_usage_stats))

    async def run(self, job: Job) -> AsyncIterator[Piece]:
        """Yield the choice's pieces (text, finish reason, logprobs); job.usage follows along."""
        detok = IncrementalDetokenizer(self.tokenizer, job.prompt_ids, job.stop,
                                       job.include_stop)
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
                      started: float) -> AsyncGenerator[Piece]:
        first, previous = True, job.prompt_ids[-1]
        with self.tracer.start_as_current_span("stream") as span:
            async for delta in self.client.generate(job.prompt_ids, job.spec, job.request_id,
                                                    min(job.deadline, self.drain_deadline)):
                if first:
                    TTFT.observe(time.monotonic() - started)
                    job.usage.cached_tokens = delta.num_cached_tokens
                    first = False
                job.usage.completion_tokens += len(delta.token_ids)
                logprobs = []
                if job.logprobs is not None:
                    for item in zip(delta.token_ids, delta.logprobs, delta.top_logprob_ids,
                                    delta.top_logprobs, strict=False):
                        logprobs.append(TokenLogprob(*item, previous_id=previous))
                        previous = item[0]
                text = detok.add(delta.token_ids)
                if detok.stopped:  # a stop string: cut here; client.generate cancels downstream
                    yield Piece(text, "stop", logprobs)
                    return
                finish = delta.finish_reason
                if finish is not None:
                    text += detok.flush()
                    yield Piece(text, "stop" if finish == "abort" else finish, logprobs)
                    span.set_attribute("gen_ai.usage.output_tokens", job.usage.completion_tokens)
                    return
                if text or logprobs:
                    yield Piece(text, None, logprobs)


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


def _runs(gateway: Gateway, choices: list[Job]) -> list[Callable[[], AsyncIterator[Piece]]]:
    return [functools.partial(gateway.run, c) for c in choices]


def _rendered_logprobs(gateway: Gateway, job: Job, piece: Piece,
                       offset: int) -> dict[str, Any] | None:
    if job.logprobs is None:
        return None
    render = gateway.logprob_renderer
    return (render.chat(piece.logprobs) if job.kind == "chat"
            else render.completion(piece.logprobs, offset))


async def _complete(gateway: Gateway, job: Job, ctx: Context, span: trace.Span) -> Response:
    choices = job.choices()
    texts, finishes = [""] * job.n, [None] * job.n  # type: list[str], list[str | None]
    logprobs: list[list[TokenLogprob]] = [[] for _ in range(job.n)]
    token = otel_context.attach(ctx)
    INFLIGHT.inc()
    try:
        async for index, piece in merged(_runs(gateway, choices)):
            texts[index] += piece.text
            logprobs[index] += piece.logprobs
            finishes[index] = piece.finish or finishes[index]
    except RequestFailed as exc:
        REQUESTS.labels(job.kind, "error").inc()
        raise _error_from_failure(exc) from None
    finally:
        INFLIGHT.dec()
        otel_context.detach(token)
        span.end()
        gateway.admission.release()
    REQUESTS.labels(job.kind, "ok").inc()
    body = [choice_body(job.kind, i, texts[i], finishes[i], _rendered_logprobs(
        gateway, job, Piece("", None, logprobs[i]), 0)) for i in range(job.n)]
    return _json(completion_body(job.kind, job.request_id, job.model, body,
                                 job.total_usage(choices)))


async def _stream(gateway: Gateway, job: Job, ctx: Context,
                  span: trace.Span) -> AsyncIterator[bytes]:
    token = otel_context.attach(ctx)
    INFLIGHT.inc()
    outcome = "ok"
    choices = job.choices()
    first, offsets = [True] * job.n, [0] * job.n
    try:
        async for index, piece in merged(_runs(gateway, choices)):
            usage = job.total_usage(choices) if job.continuous_usage else None
            yield _sse(chunk_body(job.kind, job.request_id, job.model, index, piece.text,
                                  piece.finish, first[index],
                                  _rendered_logprobs(gateway, job, piece, offsets[index]),
                                  usage))
            first[index] = False
            offsets[index] += len(piece.text)
        if job.include_usage:
            yield _sse(usage_chunk(job.kind, job.request_id, job.model,
                                   job.total_usage(choices)))
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

