"""The gateway's HTTP app: POST /v1/completions and /v1/chat/completions (streamed as SSE or
not), GET /v1/models, /health, /metrics. Tokenization, the chat template, incremental
detokenization and stop strings happen here; workers only see token ids."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from opentelemetry import trace
from pydantic import ValidationError

from evenflow import models
from evenflow.gateway.mesh import Mesh, MeshError
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
class _Job:
    """One validated request, ready to run."""

    kind: str  # "completion" | "chat"
    request_id: str
    model: str
    prompt_ids: list[int]
    spec: SamplingSpec
    stop: list[str]
    stream: bool
    include_usage: bool


class Gateway:
    def __init__(self, config: MeshConfig) -> None:
        self.config = config
        model_dir = models.resolve_model(config.model)
        if model_dir is None:
            raise ValueError(f"model {config.model!r} is neither built in nor a directory")
        self.tokenizer = Tokenizer(model_dir)
        self.max_model_len = models.default_max_model_len(model_dir)
        self.tracer = setup_tracing("evenflow-gateway")
        # The engine salts block hashes with the checkpoint directory's name; so do we.
        self.mesh = Mesh(config, self.tracer, namespace_salt(model_dir.name))

    # -- validation -------------------------------------------------------------------------
    def _check_auth(self, request: Request) -> None:
        if not self.config.api_keys:
            return
        header = request.headers.get("authorization", "")
        token = header[7:] if header.lower().startswith("bearer ") else ""
        if token not in self.config.api_keys:
            raise APIError(401, "Incorrect API key provided.", "authentication_error",
                           code="invalid_api_key")

    def build_job(self, kind: str, body: dict[str, Any]) -> _Job:
        try:
            req = (CompletionRequest if kind == "completion" else ChatCompletionRequest
                   ).model_validate(body)
        except ValidationError as exc:
            raise validation_error(exc) from None
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
                prompt_ids = list(req.prompt)
        except TokenizerError as exc:
            raise APIError(400, str(exc), param="messages") from None
        vocab = self.tokenizer.vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
        if not prompt_ids:
            raise APIError(400, "the prompt is empty", param="prompt")
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
        return _Job(kind, prefix + uuid.uuid4().hex, req.model, prompt_ids, spec,
                    req.stop_strings, req.stream,
                    bool(req.stream_options and req.stream_options.include_usage))

    # -- running ----------------------------------------------------------------------------
    async def run(self, job: _Job) -> AsyncIterator[tuple[str, str | None, dict]]:
        """Yield (text delta, finish reason or None, usage so far)."""
        detok = IncrementalDetokenizer(self.tokenizer, job.prompt_ids, job.stop)
        usage = {"prompt_tokens": len(job.prompt_ids), "completion_tokens": 0,
                 "total_tokens": len(job.prompt_ids),
                 "prompt_tokens_details": {"cached_tokens": 0}}
        started = time.monotonic()
        first = True
        with self.tracer.start_as_current_span("stream") as span:
            async for delta in self.mesh.generate(job.prompt_ids, job.spec, job.request_id):
                if first:
                    TTFT.observe(time.monotonic() - started)
                    usage["prompt_tokens_details"]["cached_tokens"] = delta.num_cached_tokens
                    first = False
                usage["completion_tokens"] += len(delta.token_ids)
                usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
                text = detok.add(delta.token_ids)
                if detok.stopped:  # a stop string: cut here; mesh.generate cancels downstream
                    yield text, "stop", usage
                    return
                finish = delta.finish_reason
                if finish is not None:
                    text += detok.flush()
                    yield text, ("stop" if finish == "abort" else finish), usage
                    span.set_attribute("gen_ai.usage.output_tokens", usage["completion_tokens"])
                    return
                if text:
                    yield text, None, usage


def _error_from_mesh(exc: MeshError) -> APIError:
    if exc.code in (errors.NO_CAPACITY, errors.DRAINING):
        return APIError(503, f"The server is overloaded: {exc.description}", "overloaded_error",
                        code="overloaded", headers={"Retry-After": "1"})
    if exc.code == errors.BAD_REQUEST:
        return APIError(400, exc.description)
    return APIError(500, f"Internal error: {exc.description}", "internal_error", code=exc.code)


class _GatewayRef:
    """The app's Gateway, built at startup rather than with the app: the app object may be
    pickled to another process first (Ray Serve), and the tokenizer does not pickle."""

    def __init__(self) -> None:
        self.target: Gateway | None = None

    def __getattr__(self, name: str) -> Any:
        target = self.__dict__.get("target")  # not self.target: unpickling calls us early
        if target is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(target, name)


def create_app(config: MeshConfig) -> FastAPI:
    gw: Any = _GatewayRef()

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        gw.target = Gateway(config)
        await gw.mesh.start()
        yield
        await gw.mesh.close()
        shutdown_tracing()

    app = FastAPI(title="evenflow", lifespan=lifespan)
    app.state.gateway = gw

    @app.exception_handler(APIError)
    async def _api_error(_request: Request, exc: APIError) -> Response:
        return _json(exc.body(), exc.status, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_request: Request, exc: RequestValidationError) -> Response:
        err = validation_error(exc)
        return _json(err.body(), 400)

    @app.get("/health")
    async def health() -> Response:
        workers = {str(role): len(gw.mesh.registry.live(role)) for role in WORKER_ROLES}
        if gw.mesh.ready():
            return _json({"status": "ok", "workers": workers})
        return _json({"status": "starting", "workers": workers}, 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        body, content_type = render()
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def list_models(request: Request) -> Response:
        gw._check_auth(request)
        return _json({"object": "list", "data": [{
            "id": config.model_name, "object": "model", "created": 0, "owned_by": "evenflow",
            "max_model_len": gw.max_model_len}]})

    async def handle(kind: str, request: Request) -> Response:
        gw._check_auth(request)
        try:
            body = orjson.loads(await request.body())
        except orjson.JSONDecodeError as exc:
            raise APIError(400, "We could not parse the JSON body of your request: "
                                f"{exc}") from None
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        job = gw.build_job(kind, body)
        span = gw.tracer.start_span(  # ended when the response is complete
            "gateway.request", kind=trace.SpanKind.SERVER,
            attributes={"gen_ai.operation.name": kind, "gen_ai.request.model": job.model,
                        "gen_ai.request.id": job.request_id,
                        "gen_ai.usage.input_tokens": len(job.prompt_ids)})
        ctx = trace.set_span_in_context(span)
        if job.stream:
            return StreamingResponse(_stream(job, ctx), media_type="text/event-stream")
        return await _complete(job, ctx, span)

    async def _complete(job: _Job, ctx, span) -> Response:
        from opentelemetry import context as otel_context

        token = otel_context.attach(ctx)
        INFLIGHT.inc()
        text, finish, usage = "", None, {}
        try:
            async for delta, finish, usage in gw.run(job):  # noqa: B007 (the last ones count)
                text += delta
        except MeshError as exc:
            REQUESTS.labels(job.kind, "error").inc()
            raise _error_from_mesh(exc) from None
        finally:
            INFLIGHT.dec()
            otel_context.detach(token)
            span.end()
        REQUESTS.labels(job.kind, "ok").inc()
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish}
        if job.kind == "chat":
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return _json({"id": job.request_id, "created": int(time.time()), "model": job.model,
                      "object": "chat.completion" if job.kind == "chat" else "text_completion",
                      "choices": [choice], "usage": usage})

    def _chunk(job: _Job, text: str | None, finish: str | None, first: bool) -> dict:
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

    async def _stream(job: _Job, ctx) -> AsyncIterator[bytes]:
        from opentelemetry import context as otel_context

        token = otel_context.attach(ctx)
        span = trace.get_current_span()
        INFLIGHT.inc()
        first, usage, outcome = True, {}, "ok"
        try:
            async for delta, finish, usage in gw.run(job):  # noqa: B007 (the last usage counts)
                yield _sse(_chunk(job, delta, finish, first))
                first = False
            if job.include_usage:
                yield _sse({"id": job.request_id, "created": int(time.time()), "model": job.model,
                            "object": "chat.completion.chunk" if job.kind == "chat"
                            else "text_completion", "choices": [], "usage": usage})
        except MeshError as exc:
            outcome = "error"
            yield _sse(_error_from_mesh(exc).body())
        except BaseException:
            outcome = "cancelled"  # the client went away: mesh.generate cancelled downstream
            raise
        finally:
            INFLIGHT.dec()
            REQUESTS.labels(job.kind, outcome).inc()
            span.end()
            otel_context.detach(token)
        yield b"data: [DONE]\n\n"

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handle("completion", request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await handle("chat", request)

    return app
