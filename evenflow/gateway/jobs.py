"""A request's life at the gateway, between the HTTP edge and the worker fleet: validated into
a `Job` (tokenized, the chat template applied, checked against the model, its sampling spec
built), then run through the fleet (`GatewayClient`) into `Piece`s of text: incremental
detokenization, stop strings, logprobs. The per-process state is one `Gateway`."""

from __future__ import annotations

import dataclasses
import itertools
import math
import secrets
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

from evenflow import models
from evenflow.gateway.admission import Admission, Slot
from evenflow.gateway.agent_input import output_shape, template_messages, tool_parser_name
from evenflow.gateway.agent_output import OutputShape
from evenflow.gateway.choice import ChoiceOutput
from evenflow.gateway.client import GatewayClient
from evenflow.gateway.direct import DirectStream, DirectWriter, plain
from evenflow.gateway.flight import RequestFailed, Served
from evenflow.gateway.lora import LoRAAdapters
from evenflow.gateway.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    TokenizeRequest,
)
from evenflow.gateway.render import (
    ChunkTemplate,
    LogprobRenderer,
    Piece,
    TokenIdRenderer,
    TokenLogprob,
    Usage,
)
from evenflow.gateway.structured import GuideCompiler, requested_format, requested_tools
from evenflow.gateway.timings import FirstTokenTimings
from evenflow.proto import errors
from evenflow.proto.hashing import namespace_salt
from evenflow.proto.sampling import SamplingParams
from evenflow.proto.tokenizer import IncrementalDetokenizer, Tokenizer, TokenizerError
from evenflow.services.config import MeshConfig
from evenflow.services.metrics import (
    VLLM_E2E,
    VLLM_GENERATION_TOKENS,
    VLLM_PREFIX_HITS,
    VLLM_PREFIX_QUERIES,
    VLLM_PROMPT_TOKENS,
    VLLM_SUCCESS,
    labelled,
)
from evenflow.services.tracing import setup_tracing


@dataclass
class Job:
    """One validated request, ready to run (with n > 1, one per choice: `choices()`)."""

    kind: str  # "completion" | "chat"
    request_id: str
    model: str
    prompt_ids: list[int]
    spec: SamplingParams  # stop strings and include_stop_str_in_output included
    stream: bool
    include_usage: bool
    deadline: float  # time.monotonic() by which the request must be done
    n: int = 1
    logprobs: int | None = None  # top logprobs per token wanted (0: the chosen's only)
    tokens_as_ids: bool = False  # logprobs name tokens "token_id:<id>"
    continuous_usage: bool = False
    usage: Usage = field(init=False)
    served: Served = field(init=False)  # where it ran (each choice its own)
    started: float = field(init=False)  # time.monotonic()
    ttft_s: float | None = field(init=False, default=None)
    echo_text: str | None = None  # completions' echo: the prompt in front of the output
    drop_output: bool = False  # echo with max_tokens 0: the one generated token is dropped
    # echo + logprobs: prompt tokens 1, 2, ... (the first has no logprob), from the first delta
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    # a chat output split into content, reasoning and tool calls (gateway/agent_output.py)
    shape: OutputShape | None = None
    # a streamed single-choice request: its time to first token, split (gateway/timings.py)
    timings: FirstTokenTimings | None = None
    created: int = field(default_factory=lambda: int(time.time()))  # every chunk carries it
    # a streamed response's socket, once its head is sent (gateway/direct.py); None: ASGI only
    writer: DirectWriter | None = None
    # its admission slot, given back once the response is over (gateway/admission.py)
    slot: Slot | None = None

    def __post_init__(self) -> None:
        self.usage = Usage(len(self.prompt_ids))
        self.served = Served()
        self.started = time.monotonic()

    def record(self, choices: list[Job], finishes: list[str | None]) -> None:
        """vLLM-compatible request metrics for a request that finished (once per request)."""
        usage, model = self.total_usage(choices), self.model
        labelled(VLLM_E2E, model).observe(time.monotonic() - self.started)
        for finish in finishes:
            labelled(VLLM_SUCCESS, model, finish or "abort").inc()
        labelled(VLLM_PROMPT_TOKENS, model).inc(usage.prompt_tokens)
        labelled(VLLM_GENERATION_TOKENS, model).inc(usage.completion_tokens)
        labelled(VLLM_PREFIX_QUERIES, model).inc(usage.prompt_tokens)
        labelled(VLLM_PREFIX_HITS, model).inc(usage.cached_tokens)

    def log_line(self, outcome: str, choices: list[Job]) -> str:
        """The request log's line for this request (no prompt text, no key): with the workers
        that served it (the first choice's: prefill->decode) and the cached prompt tokens
        they reported against those the router expected them to hold."""
        usage = self.total_usage(choices)
        ttft = min((c.ttft_s for c in choices if c.ttft_s is not None), default=None)
        served = choices[0].served
        return (f"request {self.request_id} {self.kind} {outcome} on {served.workers()}: "
                f"{usage.prompt_tokens} prompt ({usage.cached_tokens} cached, "
                f"{served.expected_cached_tokens} expected) + {usage.completion_tokens} output "
                f"tokens, n="
                f"{self.n}, TTFT {'-' if ttft is None else f'{ttft * 1e3:.1f} ms'}, "
                f"{(time.monotonic() - self.started) * 1e3:.1f} ms")

    def choices(self) -> list[Job]:
        """One job per choice: its own id and usage; a seed offset by the choice's index."""
        if self.n == 1:
            return [self]
        return [dataclasses.replace(  # (no direct path: a choice's events carry its index)
            self, request_id=f"{self.request_id}-{i}", n=1, writer=None,
            spec=dataclasses.replace(self.spec, seed=None if self.spec.seed is None
                                     else (self.spec.seed + i) % (1 << 63)))
            for i in range(self.n)]

    def total_usage(self, choices: list[Job]) -> Usage:
        return Usage(len(self.prompt_ids), sum(c.usage.completion_tokens for c in choices),
                     choices[0].usage.cached_tokens, sum(c.usage.draft_tokens for c in choices),
                     sum(c.usage.accepted_draft_tokens for c in choices))


class Gateway:
    """This process's gateway: tokenizer, tracer and the client of the worker fleet."""

    def __init__(self, config: MeshConfig) -> None:
        self.config = config
        model_dir = models.resolve_model(config.model)
        if model_dir is None:
            raise ValueError(f"model {config.model!r} is neither built in nor a directory")
        self.tokenizer = Tokenizer(model_dir)
        # token ids a worker may send
        self.output_vocab = max(self.tokenizer.vocab_size, models.output_vocab_size(model_dir))
        eos = self.tokenizer.eos_token_id
        self.guides = GuideCompiler(model_dir, [] if eos is None else [eos])
        # what ends a sequence, kept out of the text when a parser reads special tokens
        self.eos_ids = frozenset(([] if eos is None else [eos]) + models.eos_token_ids(model_dir))
        self.tool_parser = tool_parser_name(config.tool_call_parser, self.tokenizer.chat_template)
        self.adapters = LoRAAdapters(config.lora_modules, config.model_name)
        self.logprob_renderer = LogprobRenderer(self.tokenizer)
        self.token_id_renderer = TokenIdRenderer(self.tokenizer)
        self.max_model_len = models.default_max_model_len(  # the same limit as the engine's
            model_dir, config.max_model_len or None)
        self.tracer = setup_tracing("evenflow-gateway")
        # The engine salts block hashes with the checkpoint directory's name; so do we.
        self.client = GatewayClient(config, self.tracer, namespace_salt(model_dir.name))
        self.admission = Admission(config.max_inflight, config.max_queued,
                                   config.tenant_weight_map())
        self.drain_deadline = math.inf  # set on SIGTERM: streams must end by then

    @property
    def draining(self) -> bool:
        return self.drain_deadline < math.inf

    def begin_drain(self) -> None:
        """SIGTERM: refuse new requests (503); running ones get drain_timeout_s to finish,
        then end with an error event."""
        if not self.draining:
            self.drain_deadline = time.monotonic() + self.config.drain_timeout_s

    def tokenize(self, req: TokenizeRequest) -> list[int]:
        """/tokenize's ids: the prompt's, or the chat messages' through the template."""
        try:
            if req.messages is not None:
                text = self.tokenizer.apply_chat_template(
                    template_messages(req.messages), req.add_generation_prompt)
                return self.tokenizer.encode(text, bool(req.add_special_tokens))
            assert req.prompt is not None
            return self.tokenizer.encode(req.prompt, req.add_special_tokens is not False)
        except TokenizerError as exc:
            raise APIError(400, str(exc), param="messages") from None

    def build_job(self, kind: str, req: CompletionRequest | ChatCompletionRequest) -> Job:
        """Tokenize and check a request against the model; raises APIError."""
        adapter = self.adapters.path_of(req.model)
        if req.model != self.config.model_name and adapter is None:
            raise APIError(404, f"The model `{req.model}` does not exist.", "NotFoundError",
                           "model", "model_not_found")
        prompt_ids = self._prompt_ids(req)
        echo = isinstance(req, CompletionRequest) and req.echo
        asked = req.max_completion_tokens if req.max_completion_tokens is not None \
            else req.max_tokens
        max_tokens = self._max_tokens(kind, req, len(prompt_ids), asked, echo)
        logprobs = req.top_logprobs_wanted
        try:
            spec = req.to_sampling_params(max_tokens, echo)
        except ValueError as exc:
            raise APIError(400, str(exc), param=_param_of(exc)) from None
        if adapter is not None:  # (the workers load it from its path: gateway/lora.py)
            spec = dataclasses.replace(spec, lora_name=req.model, lora_path=adapter)
        prefix = "cmpl-" if kind == "completion" else "chatcmpl-"
        budget = min(req.timeout or self.config.request_timeout_s, self.config.request_timeout_s)
        options = req.stream_options
        job = Job(kind, prefix + request_id(), req.model, prompt_ids, spec, req.stream,
                  bool(options and options.include_usage),
                  time.monotonic() + budget, n=req.n, logprobs=logprobs,
                  tokens_as_ids=req.return_tokens_as_token_ids,
                  continuous_usage=bool(options and options.continuous_usage_stats))
        if isinstance(req, CompletionRequest) and req.echo:
            job.echo_text = req.prompt if isinstance(req.prompt, str) else \
                self.tokenizer.decode(prompt_ids)
            job.drop_output = asked == 0
        return job

    def _prompt_ids(self, req: CompletionRequest | ChatCompletionRequest) -> list[int]:
        """The prompt's token ids (a chat through the model's template), every token id the
        request names checked against the vocabulary; raises APIError."""
        try:
            if isinstance(req, ChatCompletionRequest):
                requested_tools(req)  # (checked before the template renders them)
                prompt_ids = self.tokenizer.encode(self.tokenizer.apply_chat_template(
                    template_messages(req.messages), req.add_generation_prompt,
                    req.tools if req.tool_choice != "none" else None,
                    req.chat_template_kwargs), add_special_tokens=req.add_special_tokens)
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
        return prompt_ids

    def _max_tokens(self, kind: str, req: CompletionRequest | ChatCompletionRequest,
                    prompt_len: int, asked: int | None, echo: bool) -> int:
        """The output tokens the request may generate, checked against the context left after
        its prompt (vLLM's wording for what does not fit); raises APIError."""
        room = self.max_model_len - prompt_len
        if asked == 0 and not echo:
            raise APIError(400, "max_tokens must be at least 1 (0 only with echo)",
                           param="max_tokens")
        # echo with max_tokens 0: one token is generated and dropped (the prompt's logprobs
        # come with the first token)
        max_tokens = 1 if asked == 0 else asked or (16 if kind == "completion" else room)
        # As vLLM words them: a prompt that alone fills the context blames the prompt; one
        # that fits blames the output length asked for (or the completions default of 16).
        if room < 1:
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} "
                           f"tokens. However, your request has {prompt_len} input tokens, "
                           "which leaves no room for output. Please reduce the length of the "
                           f"{'messages' if kind == 'chat' else 'prompt'}.",
                           param="messages" if kind == "chat" else "prompt",
                           code="context_length_exceeded")
        if max_tokens > room:
            field = "max_completion_tokens" if req.max_completion_tokens is not None \
                else "max_tokens"
            default = " (the default)" if asked is None else ""
            raise APIError(400, f"'{field}' is too large: {max_tokens}{default}. This model's "
                           f"maximum context length is {self.max_model_len} tokens and your "
                           f"request has {prompt_len} input tokens ({max_tokens} > "
                           f"{self.max_model_len} - {prompt_len}).", param=field,
                           code="context_length_exceeded")
        if req.min_tokens > max_tokens:
            raise APIError(400, "min_tokens must not exceed max_tokens", param="min_tokens")
        return max_tokens

    async def attach_guide(self, job: Job, req: CompletionRequest | ChatCompletionRequest
                           ) -> None:
        """Structured output or a forced tool call: the job's grammar, compiled and validated
        off the event loop (gateway/structured.py); and a chat job's output shape (tool calls,
        reasoning: gateway/agent_output.py). Raises APIError."""
        fmt = requested_format(req)
        if isinstance(req, ChatCompletionRequest):
            tools = requested_tools(req)
            if tools is not None and tools.schema is not None:
                if fmt is not None:
                    raise APIError(400, f"{fmt[2]} and a forced tool call cannot be combined",
                                   param="tool_choice")
                fmt = ("json_schema", tools.schema, "tools")
            job.shape = output_shape(tools, self.tool_parser, self.config.reasoning_parser)
        if fmt is not None:
            job.spec = dataclasses.replace(job.spec, guide=await self.guides.compile(*fmt))

    async def run(self, job: Job) -> AsyncIterator[Piece]:
        """Yield the choice's pieces (text, finish reason, logprobs); job.usage follows along.
        With job.writer (a streamed plain job), deltas in the middle of the stream may go
        straight from the inbox to the socket instead (gateway/direct.py)."""
        special = job.shape is not None and job.shape.needs_special_tokens
        output = ChoiceOutput(job, IncrementalDetokenizer(
            self.tokenizer, job.prompt_ids, list(job.spec.stop),
            job.spec.include_stop_str_in_output, skip_special_tokens=not special),
            self.output_vocab, time.monotonic(),
            self.eos_ids | set(job.spec.stop_token_ids) if special else frozenset())
        attempts = self.client.attempts(job.prompt_ids, job.spec, job.request_id,
                                        lambda: min(job.deadline, self.drain_deadline),
                                        job.timings, job.served)
        if job.writer is not None and plain(job):
            attempts.direct = DirectStream(output, job.writer, ChunkTemplate(
                job.kind, job.request_id, job.model, job.created))
        try:
            with self.tracer.start_as_current_span("stream") as span:
                async with aclosing(attempts.deltas()) as deltas:
                    async for delta in deltas:
                        piece = output.take(delta, time.monotonic())
                        if piece is None:
                            continue
                        yield piece
                        if piece.finish is not None:  # (a stop string: client.generate
                            # cancels downstream)
                            span.set_attribute("gen_ai.usage.output_tokens",
                                               job.usage.completion_tokens)
                            return
        except RequestFailed as exc:
            if exc.code == errors.TIMEOUT and time.monotonic() >= self.drain_deadline:
                raise RequestFailed(errors.DRAINING, "the gateway shut down before the request "
                                    "finished") from None
            raise


_ID_PREFIX = secrets.token_hex(8)  # this process's; with a count, unique across the fleet
_ID_COUNT = itertools.count()


def request_id() -> str:
    """32 hex digits, unique across processes and restarts (uuid4's syscall was ~2% of the
    gateway's time per request)."""
    return f"{_ID_PREFIX}{next(_ID_COUNT):016x}"


def error_from_failure(exc: RequestFailed) -> APIError:
    if exc.code == errors.TIMEOUT:
        return APIError(504, f"The request timed out: {exc.description}", "timeout_error",
                        code="timeout")
    if exc.code == errors.DRAINING:
        return APIError(503, f"The server is shutting down: {exc.description}",
                        "overloaded_error", code="draining", headers={"Retry-After": "1"})
    if exc.code == errors.NO_CAPACITY:
        return APIError(503, f"The server is overloaded: {exc.description}", "overloaded_error",
                        code="overloaded", headers={"Retry-After": "1"})
    if exc.code == errors.BAD_REQUEST:
        return APIError(400, _clipped(exc.description))
    # Anything else came from a worker (whose answer the gateway only relays, and which a
    # holder of that worker's credentials can forge: README "Security"): a bad gateway, never
    # this gateway's own 500.
    return APIError(502, f"A worker failed the request: {_clipped(exc.description)}",
                    "upstream_error", code=_clipped(exc.code, 64))


def _clipped(text: str, limit: int = 1000) -> str:
    """A worker's words in an error body, at most `limit` characters."""
    text = str(text)
    return text if len(text) <= limit else text[:limit] + "..."


def _param_of(exc: ValueError) -> str | None:
    """The request field a SamplingParams check names ("SamplingParams.top_p must be ...")."""
    head = str(exc).split(" ", 1)[0]
    return head.removeprefix("SamplingParams.") if head.startswith("SamplingParams.") else None
