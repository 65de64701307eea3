"""The gateway's HTTP app: POST /v1/completions and /v1/chat/completions (streamed as SSE or
not), GET /v1/models, /health, /live, /version, /metrics, POST /tokenize and /detokenize, and
POST /admin/profile (a worker's operator profile, when EVENFLOW_PROFILE_DIR is set).
Handlers live at module level with typed request bodies (so /docs and /openapi.json show them);
the per-process state is one `Gateway` (gateway/jobs.py), built at startup and kept in
`app.state.gateway`. Tokenization, the chat template, incremental detokenization and stop
strings happen at the gateway; workers only see token ids."""

from __future__ import annotations

import asyncio
import gc
import inspect
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from typing import Any

import orjson
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from fastapi.routing import APIRoute
from opentelemetry import trace
from starlette.exceptions import HTTPException as StarletteHTTPException

from evenflow import __version__
from evenflow.gateway.admission import DEFAULT_TENANT
from evenflow.gateway.counting import CountResponses, app_routes
from evenflow.gateway.edge import TENANT_KEY, EdgeMiddleware, read_api_keys
from evenflow.gateway.flight import RequestFailed
from evenflow.gateway.jobs import Gateway
from evenflow.gateway.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoRARequest,
    TokenizeRequest,
    UnloadLoRARequest,
    validation_error,
)
from evenflow.gateway.responses import AdmittedStream, complete, json_response, stream
from evenflow.gateway.timings import FirstTokenTimings
from evenflow.proto import errors
from evenflow.proto.messages import WORKER_ROLES
from evenflow.services import tracing
from evenflow.services.bus import EXIT_NATS_AUTH, NatsAuthError
from evenflow.services.config import MeshConfig
from evenflow.services.metrics import render, watch_loop_lag
from evenflow.services.tracing import shutdown_tracing

log = logging.getLogger(__name__)


# -- handlers ---------------------------------------------------------------------------------
class _OrjsonRequest(Request):
    """A request whose JSON body is parsed by orjson (FastAPI's own parse is the stdlib's,
    ~5x slower on a prompt of token ids). A malformed body still raises json.JSONDecodeError
    (orjson's error subclasses it), which FastAPI turns into our 400."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = orjson.loads(await self.body())
        return self._json


class _OrjsonRoute(APIRoute):
    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def parse_with_orjson(request: Request) -> Response:
            return await handler(_OrjsonRequest(request.scope, request.receive))

        return parse_with_orjson


router = APIRouter(route_class=_OrjsonRoute)


def _gateway(request: Request) -> Gateway:
    gateway: Gateway | None = request.app.state.gateway
    if gateway is None:  # before startup finished
        raise APIError(503, "The gateway is starting.", "overloaded_error", code="starting")
    return gateway


@router.get("/health")
async def health(request: Request) -> Response:
    gateway: Gateway | None = request.app.state.gateway
    if gateway is None:
        return json_response({"status": "starting", "workers": {}}, 503)
    workers = {str(role): len(gateway.client.registry.live(role)) for role in WORKER_ROLES}
    if gateway.client.ready():
        return json_response({"status": "ok", "workers": workers})
    return json_response({"status": "starting", "workers": workers}, 503)


@router.get("/metrics")
async def metrics() -> Response:
    body, content_type = render()
    return Response(body, media_type=content_type)


@router.get("/live")
async def live() -> Response:
    """Liveness: the process answers (readiness, with workers, is /health)."""
    return json_response({"status": "alive"})


@router.get("/version")
async def version() -> Response:
    return json_response({"version": __version__})


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> Response:
    """Token ids of a prompt or of chat messages (with the chat template), as vLLM's."""
    gateway = _gateway(request)
    ids = gateway.tokenize(body)
    return json_response({"tokens": ids, "count": len(ids),
                          "max_model_len": gateway.max_model_len})


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> Response:
    gateway = _gateway(request)
    if any(not 0 <= t < gateway.tokenizer.vocab_size for t in body.tokens):
        raise APIError(400, f"tokens must be in [0, {gateway.tokenizer.vocab_size})",
                       param="tokens")
    return json_response({"prompt": gateway.tokenizer.decode(body.tokens)})


@router.post("/admin/profile")
async def admin_profile(request: Request, worker: str, steps: int = 10,
                        timeout: float = 30.0) -> Response:
    """torch.profiler over one worker's next `steps` engine steps (at most `timeout` s): the
    operator table (top operators by self time, component shares, copies) and the Chrome /
    Perfetto trace the worker wrote under its EVENFLOW_PROFILE_DIR. Off (404) unless
    EVENFLOW_PROFILE_DIR is set, as vLLM's profiler; needs an API key when keys are set."""
    gateway = _gateway(request)
    if not gateway.config.profile_dir:
        raise APIError(404, "Profiling is off: set EVENFLOW_PROFILE_DIR.", "not_found_error")
    if not 1 <= steps <= 1000:
        raise APIError(400, "steps must be in [1, 1000]", param="steps")
    if not 0 < timeout <= 300:
        raise APIError(400, "timeout must be in (0, 300] seconds", param="timeout")
    try:
        result = await gateway.client.profile(worker, steps, timeout)
    except RequestFailed as exc:
        if exc.code == errors.BAD_REQUEST:
            raise APIError(404, exc.description, "not_found_error", param="worker") from None
        raise APIError(504, exc.description, "timeout_error") from None
    if result.error:
        raise APIError(409, result.error, "conflict_error")
    return json_response({"worker": result.worker_id, "steps": result.steps,
                          "trace_file": result.trace_file, "report": result.lines})


@router.get("/v1/models")
async def list_models(request: Request) -> Response:
    """vLLM's model card (id, root, max_model_len, ...), and what each live engine worker
    runs: its weights' form, KV cache dtype and kernels (from its heartbeats)."""
    gateway = _gateway(request)
    registry = gateway.client.registry
    workers = [{"id": state.heartbeat.worker_id, "role": str(role),
                "weights": state.heartbeat.weights,
                "kv_cache_dtype": state.heartbeat.kv_cache_dtype,
                "kernels": state.heartbeat.kernels}
               for role in WORKER_ROLES for state in registry.live(role)]
    adapters = [{"id": name, "object": "model", "created": 0, "owned_by": "evenflow",
                 "root": path, "parent": gateway.config.model_name,
                 "max_model_len": gateway.max_model_len, "permission": []}
                for name, path in sorted(gateway.adapters.paths.items())]
    return json_response({"object": "list", "data": [{
        "id": gateway.config.model_name, "object": "model", "created": 0,
        "owned_by": "evenflow", "root": gateway.config.model, "parent": None,
        "max_model_len": gateway.max_model_len, "permission": [],
        "workers": sorted(workers, key=lambda w: w["id"])}, *adapters]})


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoRARequest, request: Request) -> Response:
    """vLLM's: serve a PEFT LoRA checkpoint under a name (gateway/lora.py)."""
    _gateway(request).adapters.load(body.lora_name, body.lora_path)
    return Response(f"Success: LoRA adapter '{body.lora_name}' added successfully.",
                    media_type="text/plain")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoRARequest, request: Request) -> Response:
    _gateway(request).adapters.unload(body.lora_name)
    return Response(f"Success: LoRA adapter '{body.lora_name}' removed successfully.",
                    media_type="text/plain")


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    return await handle(_gateway(request), "completion", body,
                        request.scope.get(TENANT_KEY, DEFAULT_TENANT))


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    return await handle(_gateway(request), "chat", body,
                        request.scope.get(TENANT_KEY, DEFAULT_TENANT))


async def handle(gateway: Gateway, kind: str, body: CompletionRequest | ChatCompletionRequest,
                 tenant: str = DEFAULT_TENANT) -> Response:
    received = time.perf_counter()
    if gateway.draining:
        raise APIError(503, "The gateway is shutting down.", "overloaded_error",
                       code="draining", headers={"Retry-After": "1"})
    job = gateway.build_job(kind, body)
    await gateway.attach_guide(job, body)
    tokenized = time.perf_counter()
    # The slot is released exactly once, by whoever ends the response: _complete's finally,
    # or the streaming response once it is done.
    job.slot = slot = await gateway.admission.acquire(tenant, job.spec.priority)
    if job.stream and job.n == 1:
        job.timings = FirstTokenTimings(received, tokenized, time.perf_counter())
    span = gateway.tracer.start_span(  # ended when the response is complete
        "gateway.request", kind=trace.SpanKind.SERVER,
        attributes={"gen_ai.operation.name": kind, "gen_ai.request.model": job.model,
                    "gen_ai.request.id": job.request_id,
                    "gen_ai.usage.input_tokens": len(job.prompt_ids)})
    ctx = tracing.span_context(span)
    if job.stream:
        return AdmittedStream(stream(gateway, job, ctx, span), slot.release, job)
    return await complete(gateway, job, ctx, span)


# -- the app ----------------------------------------------------------------------------------
def _without_native_telemetry() -> dict:
    """FastAPI's own OpenTelemetry (from 0.165: on whenever a tracer provider is set, as ours
    is) off: it added a server span, metrics and logs to every request and wrapped every SSE
    chunk's send, on the one event loop, beside the gateway's own request span and metrics."""
    if "telemetry" not in inspect.signature(FastAPI.__init__).parameters:
        return {}
    return {"telemetry": {"tracing": False, "metrics": False, "logs": False}}


def create_app(config: MeshConfig) -> FastAPI:
    """The app; its Gateway is built at startup, not here: the app object may be pickled to
    another process first (Ray Serve), and the tokenizer does not pickle."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        gateway = Gateway(config)
        try:
            await gateway.client.start()
        except NatsAuthError as exc:  # said once; no traceback, no retry: it would be refused
            log.error("%s", exc)
            logging.shutdown()
            os._exit(EXIT_NATS_AUTH)
        app.state.gateway = gateway
        # What start-up built (the tokenizer, the app, the modules) lives as long as the
        # process: out of the collector's sight, a full collection during a request scans only
        # what requests made. (Not measured apart: the routing bench showed no change.)
        gc.collect()
        gc.freeze()
        lag = asyncio.create_task(watch_loop_lag(), name="loop lag")
        yield
        lag.cancel()
        app.state.gateway = None
        await gateway.client.close()
        shutdown_tracing()

    app = FastAPI(title="evenflow", version=__version__, lifespan=lifespan,
                  **_without_native_telemetry())
    app.state.gateway = None
    app.include_router(router)
    app.add_middleware(EdgeMiddleware, config=config, api_keys=read_api_keys(config))
    # (added last: outermost, it sees the edge's refusals too)
    app.add_middleware(CountResponses, routes=app_routes(router))

    @app.exception_handler(APIError)
    async def _api_error(_request: Request, exc: APIError) -> Response:
        return json_response(exc.body(), exc.status, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> Response:
        route = request.scope.get("route")
        field = getattr(route, "body_field", None)  # the endpoint's request model
        model = getattr(getattr(field, "field_info", None), "annotation", None)
        return json_response(validation_error(
            exc, model if isinstance(model, type) else None).body(), 400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        """Starlette's own refusals (no such route, a method the route does not take) in
        OpenAI's shape, as OpenAI answers an unknown URL."""
        error = http_error(request.method, request.url.path, exc.status_code, exc.detail,
                           dict(exc.headers or {}))
        return json_response(error.body(), error.status, error.headers)

    @app.exception_handler(Exception)
    async def _server_error(_request: Request, exc: Exception) -> Response:
        # (Starlette logs the traceback and re-raises after this answer goes out)
        return json_response(APIError(
            500, "The server had an error while processing your request.", "server_error",
            code="internal_error").body(), 500)

    return app


def http_error(method: str, path: str, status: int, detail: str,
               headers: dict[str, str]) -> APIError:
    """An HTTP refusal from the router, said as OpenAI says it (its headers kept: Allow)."""
    if status == 404:
        return APIError(404, f"Invalid URL ({method} {path}): no such route.",
                        code="unknown_url", headers=headers)
    if status == 405:
        return APIError(405, f"Method {method} is not allowed for {path} (allowed: "
                        f"{headers.get('Allow', '')}).", code="method_not_allowed",
                        headers=headers)
    return APIError(status, str(detail), headers=headers)

