"""Services' message handling on the in-memory bus (no nats-server, no subprocesses): a decode
worker's admission and KV hand-off on the mock engine, a prefill worker's first tokens, and the
gateway's retry elsewhere."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
from opentelemetry import trace

from evenflow.decode.service import DecodeWorker
from evenflow.gateway.client import GatewayClient, RequestFailed
from evenflow.gateway.jobs import Job
from evenflow.prefill.service import PrefillWorker
from evenflow.proto import errors, subjects
from evenflow.proto.messages import (
    Cancel,
    DecodeRequest,
    ErrorMessage,
    KVBlockChunk,
    KVTransferComplete,
    Message,
    PrefillRequest,
    Role,
    TokenDelta,
    TokenDeltas,
    WorkerHeartbeat,
)
from evenflow.proto.sampling import SamplingParams
from evenflow.services.config import MeshConfig
from evenflow.services.memory_bus import InMemoryBroker, InMemoryBus
from evenflow.services.worker import WorkerService

INBOX = "evenflow.gateway.test"
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


class Inbox:
    """A gateway stand-in: collects what arrives on INBOX, per request."""

    def __init__(self, broker: InMemoryBroker) -> None:
        self.bus = InMemoryBus(broker, "gateway")
        self.items: asyncio.Queue[Message] = asyncio.Queue()
        self.heartbeats: list[WorkerHeartbeat] = []

    async def open(self) -> None:
        await self.bus.connect("memory://")
        await self.bus.subscribe(INBOX, lambda m, _c: self.items.put_nowait(m))
        await self.bus.subscribe(subjects.HEARTBEATS,
                                 lambda m, _c: self.heartbeats.append(m))

    async def outcome(self, request_id: str) -> tuple[list[int], str]:
        """Token ids and finish reason of one request, or ([], error code)."""
        tokens: list[int] = []
        while True:
            item = await asyncio.wait_for(self.items.get(), 20)
            if isinstance(item, ErrorMessage) and item.request_id == request_id:
                return [], item.code
            if isinstance(item, TokenDeltas):
                for delta in item.deltas:
                    if delta.request_id == request_id:
                        tokens += delta.token_ids
                        if delta.finish_reason:
                            return tokens, delta.finish_reason


@asynccontextmanager
async def serving(worker: WorkerService, broker: InMemoryBroker) -> AsyncIterator[Inbox]:
    """The worker running and a gateway stand-in on its broker; both stopped afterwards."""
    running = asyncio.create_task(worker.run(install_signals=False))
    gateway = Inbox(broker)
    await gateway.open()
    try:
        await asyncio.wait_for(worker.started.wait(), 30)
        yield gateway
    finally:
        worker.request_stop()
        await asyncio.wait_for(running, 30)
        await gateway.bus.close()


def test_decode_worker_admits_refuses_and_checks_kv_transfers():
    config = MeshConfig(nats_url="memory://", engine="mock", num_ep_ranks=0, num_kv_blocks=8,
                        heartbeat_interval_s=0.05)

    async def scenario() -> None:
        broker = InMemoryBroker()
        worker = DecodeWorker(config, "d0", InMemoryBus(broker, "d0"))
        to_worker = subjects.decode_worker("d0")
        transfer = subjects.kv_transfer("d0")  # prefill workers' subject
        async with serving(worker, broker) as gateway:
            # A short prompt, prefilled here (conditional disaggregation).
            await gateway.bus.publish(to_worker, DecodeRequest(
                request_id="local", prompt_token_ids=[5] * 20, sampling=GREEDY,
                reply_subject=INBOX, enqueued_at=0.0))
            tokens, finish = await gateway.outcome("local")
            assert len(tokens) == 4 and finish == "length"
            # More blocks than the whole cache: a retryable refusal, not a hang.
            await gateway.bus.publish(to_worker, DecodeRequest(
                request_id="huge", prompt_token_ids=[5] * 200, sampling=GREEDY,
                reply_subject=INBOX, enqueued_at=0.0))
            assert await gateway.outcome("huge") == ([], errors.NO_CAPACITY)
            # A prefilled request: its K/V in two chunks (the mock engine's blocks hold no bytes).
            for seq in (0, 1):
                await gateway.bus.publish(transfer, KVBlockChunk(
                    request_id="remote", seq=seq, first_block=seq, num_blocks=1, data=b""))
            await gateway.bus.publish(transfer, complete("remote", num_chunks=2))
            tokens, finish = await gateway.outcome("remote")
            assert tokens and finish == "length"
            # ... or in one message: K/V small enough for one chunk comes inside the completion
            await gateway.bus.publish(transfer, dataclasses.replace(
                complete("inline", num_chunks=1), inline=True))
            tokens, finish = await gateway.outcome("inline")
            assert tokens and finish == "length"
            # The same with a chunk sent twice: the request fails, the worker keeps serving.
            for seq in (0, 0, 1):
                await gateway.bus.publish(transfer, KVBlockChunk(
                    request_id="dup", seq=seq, first_block=0, num_blocks=1, data=b""))
            await gateway.bus.publish(transfer, complete("dup", num_chunks=2))
            assert await gateway.outcome("dup") == ([], errors.KV_TRANSFER_FAILED)
            # Garbage is dropped and counted; the next request is still served.
            broker.publish_raw(to_worker, b"\xc1 not msgpack")
            await gateway.bus.publish(to_worker, DecodeRequest(
                request_id="after", prompt_token_ids=[6] * 10, sampling=GREEDY,
                reply_subject=INBOX, enqueued_at=0.0))
            assert (await gateway.outcome("after"))[1] == "length"
            assert worker.bus.dropped == 1
            # Heartbeats say what it is and that every block came back.
            await asyncio.sleep(0.2)
            last = gateway.heartbeats[-1]
            assert last.role is Role.DECODE and not last.draining
            assert last.free_kv_blocks == last.total_kv_blocks == 8

    asyncio.run(scenario())


def complete(request_id: str, num_chunks: int) -> KVTransferComplete:
    return KVTransferComplete(
        request_id=request_id, num_chunks=num_chunks, num_blocks=2, dtype="uint8",
        prompt_token_ids=[7] * 20, first_token_id=9, sampling=GREEDY, reply_subject=INBOX,
        num_cached_tokens=0, enqueued_at=0.0, export_started_at=0.0)


class FakeDecodeWorker:
    """Answers its first request with NO_CAPACITY if `full`, else with two tokens."""

    def __init__(self, broker: InMemoryBroker, worker_id: str, full: bool) -> None:
        self.worker_id, self.full = worker_id, full
        self.bus = InMemoryBus(broker, worker_id)
        self.requests: list[str] = []
        self.cancels: list[str] = []

    async def open(self) -> None:
        await self.bus.connect("memory://")
        await self.bus.subscribe(subjects.decode_worker(self.worker_id), self._on_message)
        await self.beat()

    async def beat(self) -> None:
        await self.bus.publish(subjects.heartbeat(Role.DECODE, self.worker_id), WorkerHeartbeat(
            worker_id=self.worker_id, role=Role.DECODE, model="tiny-moe", free_kv_blocks=100,
            total_kv_blocks=100, epoch="e"))

    async def _on_message(self, message: Message, _ctx: object) -> None:
        if isinstance(message, Cancel):
            self.cancels.append(message.request_id)
        elif isinstance(message, DecodeRequest):
            self.requests.append(message.request_id)
            reply: Message = ErrorMessage(
                request_id=message.request_id, code=errors.NO_CAPACITY, description="full",
                retryable=True) if self.full else TokenDeltas(worker_id=self.worker_id, deltas=[
                    TokenDelta(request_id=message.request_id, token_ids=[11, 12],
                               finish_reason="length", num_prompt_tokens=3)])
            await self.bus.publish(message.reply_subject, reply)


async def a_gateway_seeing(broker: InMemoryBroker, workers: list[FakeDecodeWorker],
                           config: MeshConfig) -> GatewayClient:
    """A started gateway client on `broker`, once it sees every one of `workers` (opened
    here) live."""
    client = GatewayClient(config, trace.get_tracer("test"), b"", InMemoryBus(broker, "gw"))
    await client.start()
    for w in workers:
        await w.open()
    while len(client.registry.live(Role.DECODE)) < len(workers):
        await asyncio.sleep(0.01)
    return client


def test_a_prefill_step_sends_its_first_tokens_to_a_gateway_in_one_message():
    """Prompts prefilled in the same step: their first tokens reach the gateway together (one
    TokenDeltas message), each with its own request id, and their K/V goes to the decode worker."""
    config = MeshConfig(nats_url="memory://", engine="mock", num_ep_ranks=0,
                        heartbeat_interval_s=0.05, debug_step_delay_ms="300")

    async def scenario() -> None:
        broker = InMemoryBroker()
        worker = PrefillWorker(config, "p0", InMemoryBus(broker, "p0"))
        completes: list[str] = []
        inlined: list[KVTransferComplete] = []

        def on_transfer(m: Message, _c: object) -> None:
            assert isinstance(m, KVTransferComplete), m  # (no separate chunk)
            completes.append(m.request_id)
            inlined.append(m)

        async with serving(worker, broker) as gateway:
            await gateway.bus.subscribe(subjects.kv_transfer("d0"), on_transfer)
            ids = [f"r{i}" for i in range(4)]
            for request_id in ids:  # the first step (300 ms) holds r0; r1-r3 wait for the next
                await gateway.bus.publish(subjects.prefill_worker("p0"), PrefillRequest(
                    request_id=request_id, prompt_token_ids=[5] * 20, sampling=GREEDY,
                    reply_subject=INBOX, decode_worker="d0", enqueued_at=0.0))
            messages: list[TokenDeltas] = []
            while sum(len(m.deltas) for m in messages) < len(ids):
                item = await asyncio.wait_for(gateway.items.get(), 20)
                assert isinstance(item, TokenDeltas), item
                messages.append(item)
            assert sorted(d.request_id for m in messages for d in m.deltas) == ids
            assert all(len(d.token_ids) == 1 and d.first_index == 0
                       for m in messages for d in m.deltas)
            assert max(len(m.deltas) for m in messages) >= 3  # r1-r3: one step, one message
            deadline = time.monotonic() + 20
            while len(completes) < len(ids) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert sorted(completes) == ids
            assert all(m.inline for m in inlined)  # one message each: K/V inside (one chunk)

    asyncio.run(scenario())


async def a_full_worker_and_a_free_one() -> tuple[Any, list[FakeDecodeWorker]]:
    """A gateway (least_load, two tries) seeing d0, which refuses as full, and d1, which
    serves. least_load breaks ties by worker id: a first try goes to d0."""
    config = MeshConfig(nats_url="memory://", router="least_load", num_prefill=0,
                        decode_retries=2)
    broker = InMemoryBroker()
    workers = [FakeDecodeWorker(broker, "d0", full=True),
               FakeDecodeWorker(broker, "d1", full=False)]
    return await a_gateway_seeing(broker, workers, config), workers


def test_gateway_retries_a_full_worker_elsewhere_and_never_picks_it_again():
    # without the exclusion the retry would go back to d0, which just said it is full

    async def scenario() -> None:
        client, workers = await a_full_worker_and_a_free_one()
        deltas = [d async for d in client.generate([1, 2, 3], GREEDY, "r1")]
        assert [t for d in deltas for t in d.token_ids] == [11, 12]
        assert workers[0].requests == ["r1"] and workers[1].requests == ["r1.1"]  # per attempt
        await asyncio.sleep(0.05)
        assert workers[0].cancels == ["r1"]
        assert all(s.inflight == 0 for s in client.registry.workers.values())
        await client.close()
        for w in workers:
            await w.bus.close()

    asyncio.run(scenario())


class DrainingDecodeWorker(FakeDecodeWorker):
    """Shutting down: refuses every request with DRAINING, while its heartbeats (stale, as one
    in flight when it began to drain) still say it takes work."""

    async def _on_message(self, message: Message, _ctx: object) -> None:
        if isinstance(message, DecodeRequest):
            self.requests.append(message.request_id)
            await self.bus.publish(message.reply_subject, ErrorMessage(
                request_id=message.request_id, code=errors.DRAINING, description="draining",
                retryable=True, worker_id=self.worker_id))


def test_draining_workers_are_left_at_once_without_spending_retries():
    # Two workers drain at once (a scale-down) and the gateway has no retry budget: each
    # refusal takes that worker out of routing before its heartbeat says so, and the request
    # still lands on the third; later requests never go to the draining ones.
    config = MeshConfig(nats_url="memory://", router="least_load", num_prefill=0,
                        decode_retries=0)

    async def scenario() -> None:
        broker = InMemoryBroker()
        workers = [DrainingDecodeWorker(broker, "d0", full=False),
                   DrainingDecodeWorker(broker, "d1", full=False),
                   FakeDecodeWorker(broker, "d2", full=False)]
        client = await a_gateway_seeing(broker, workers, config)
        for request_id in ("r1", "r2"):
            deltas = [d async for d in client.generate([1, 2, 3], GREEDY, request_id)]
            assert [t for d in deltas for t in d.token_ids] == [11, 12]
        assert workers[0].requests == ["r1"] and workers[1].requests == ["r1.1"]
        assert workers[2].requests == ["r1.2", "r2"]
        for w in workers[:2]:
            await w.beat()  # a stale heartbeat does not bring a draining worker back
        await asyncio.sleep(0.05)
        assert [s.worker_id for s in client.registry.live(Role.DECODE)] == ["d2"]
        await client.close()
        for w in workers:
            await w.bus.close()

    asyncio.run(scenario())


def test_a_request_waits_for_room_on_a_full_worker_then_runs():
    # One decode worker, full when the request comes: the request is not failed at once (as
    # vLLM's waiting queue) but sent again once the worker heartbeats (with room); a worker
    # that stays full fails it with NO_CAPACITY after queue_timeout_s.
    config = MeshConfig(nats_url="memory://", router="least_load", num_prefill=0,
                        decode_retries=0, queue_timeout_s=1.0)

    async def scenario() -> None:
        worker, client = await one_worker_and_a_gateway(FakeDecodeWorker, config)
        worker.full = True

        async def room_after(delay: float) -> None:
            await asyncio.sleep(delay)
            worker.full = False
            await worker.beat()  # a fresh heartbeat: room again

        later = asyncio.create_task(room_after(0.3))
        deltas = [d async for d in client.generate([1, 2, 3], GREEDY, "r1")]
        await later
        assert [t for d in deltas for t in d.token_ids] == [11, 12]
        assert worker.requests[0] == "r1" and worker.requests[-1].startswith("r1.")
        worker.full = True
        started = time.monotonic()
        with pytest.raises(RequestFailed) as failed:
            async for _ in client.generate([1, 2, 3], GREEDY, "r2"):
                pass
        assert failed.value.code == errors.NO_CAPACITY
        assert 0.9 < time.monotonic() - started < 10
        await client.close()
        await worker.bus.close()

    asyncio.run(scenario())


async def one_worker_and_a_gateway(worker_cls: type[FakeDecodeWorker], config: MeshConfig
                                   ) -> tuple[FakeDecodeWorker, GatewayClient]:
    """A fake decode worker "d0" and a gateway client that sees it live, on one broker."""
    broker = InMemoryBroker()
    worker = worker_cls(broker, "d0", full=False)
    return worker, await a_gateway_seeing(broker, [worker], config)


class GappyDecodeWorker(FakeDecodeWorker):
    """Its first answer loses a delta on the way (as a NATS restart can): tokens 0 and 2 of
    the output arrive, token 1 never does. Later attempts answer whole, continuing from the
    prompt they are given (each output token is the last prompt token + 1)."""

    async def _on_message(self, message: Message, _ctx: object) -> None:
        if not isinstance(message, DecodeRequest):
            return await super()._on_message(message, _ctx)
        self.requests.append(message.request_id)
        start = message.prompt_token_ids[-1] + 1
        n = message.sampling.max_tokens
        tokens = list(range(start, start + n))
        if len(self.requests) == 1:
            sent = [TokenDelta(request_id=message.request_id, token_ids=[tokens[0]],
                               first_index=0),
                    TokenDelta(request_id=message.request_id, token_ids=[tokens[2]],
                               first_index=2)]
        else:
            sent = [TokenDelta(request_id=message.request_id, token_ids=[t], first_index=i,
                               finish_reason="length" if i == n - 1 else None)
                    for i, t in enumerate(tokens)]
        for delta in sent:
            await self.bus.publish(message.reply_subject,
                                   TokenDeltas(worker_id=self.worker_id, deltas=[delta]))


def test_a_lost_delta_is_a_gap_the_gateway_fills_instead_of_skipping_tokens():
    config = MeshConfig(nats_url="memory://", router="least_load", num_prefill=0,
                        decode_retries=2)

    async def scenario() -> None:
        worker, client = await one_worker_and_a_gateway(GappyDecodeWorker, config)
        spec = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        deltas = [d async for d in client.generate([1, 2, 10], spec, "r1")]
        # 11 arrived, 12 was lost, 13 showed the gap: sent again from 11, the stream goes on
        # with 12 and never skips a token.
        assert [t for d in deltas for t in d.token_ids] == [11, 12, 13, 14]
        assert worker.requests == ["r1", "r1.1"]
        await client.close()
        await worker.bus.close()

    asyncio.run(scenario())


class ReorderingDecodeWorker(FakeDecodeWorker):
    """Sends the output's second delta before its first (two workers answer one request: the
    prefill worker's first token may arrive after the decode worker's next one)."""

    async def _on_message(self, message: Message, _ctx: object) -> None:
        if not isinstance(message, DecodeRequest):
            return await super()._on_message(message, _ctx)
        self.requests.append(message.request_id)
        deltas = [TokenDelta(request_id=message.request_id, token_ids=[21], first_index=1),
                  TokenDelta(request_id=message.request_id, token_ids=[20], first_index=0),
                  TokenDelta(request_id=message.request_id, token_ids=[21, 22], first_index=1,
                             finish_reason="length")]  # a repeat of 21: trimmed
        for delta in deltas:
            await self.bus.publish(message.reply_subject,
                                   TokenDeltas(worker_id=self.worker_id, deltas=[delta]))


def test_deltas_out_of_order_are_streamed_in_order_without_a_retry():
    config = MeshConfig(nats_url="memory://", router="least_load", num_prefill=0)

    async def scenario() -> None:
        worker, client = await one_worker_and_a_gateway(ReorderingDecodeWorker, config)
        deltas = [d async for d in client.generate([1, 2, 3], GREEDY, "r1")]
        assert [t for d in deltas for t in d.token_ids] == [20, 21, 22]
        assert worker.requests == ["r1"]
        await client.close()
        await worker.bus.close()

    asyncio.run(scenario())


def test_the_request_log_line_names_the_worker_that_served_it():
    """The worker the first token came from (after a retry elsewhere: the second), with the
    cached prompt tokens it reported and those the router expected, in the request's log line."""

    async def scenario() -> None:
        client, workers = await a_full_worker_and_a_free_one()
        job = Job("chat", "r1", "tiny-moe", [1, 2, 3], GREEDY, False, False, math.inf)
        async for _ in client.generate(job.prompt_ids, job.spec, "r1", served=job.served):
            pass
        assert (job.served.prefill, job.served.decode) == ("", "d1")
        job.served.prefill = "p0"
        assert job.log_line("ok", [job]).startswith(
            "request r1 chat ok on p0->d1: 3 prompt (0 cached, 0 expected) + ")
        await client.close()
        for w in workers:
            await w.bus.close()

    asyncio.run(scenario())


def test_a_prefill_request_that_cannot_finish_is_refused_before_any_token():
    """A decode worker that does not heartbeat: an error at once, no token (before, the first
    token went out and then nothing came); max_tokens 0 does not even decode: dropped and
    counted, nothing sent."""
    config = MeshConfig(nats_url="memory://", engine="mock", num_ep_ranks=0,
                        heartbeat_interval_s=0.05, worker_timeout_s=0.2)

    async def scenario() -> None:
        broker = InMemoryBroker()
        worker = PrefillWorker(config, "p0", InMemoryBus(broker, "p0"))
        async with serving(worker, broker) as gateway:
            decode_bus = InMemoryBus(broker, "d0")
            await decode_bus.connect("memory://")

            async def beats() -> None:
                while True:
                    await decode_bus.publish(subjects.heartbeat(Role.DECODE, "d0"),
                                             WorkerHeartbeat(worker_id="d0", role=Role.DECODE,
                                                             model="tiny-moe"))
                    await asyncio.sleep(0.05)

            beating = asyncio.create_task(beats())
            await asyncio.sleep(0.5)  # past the worker's start-up grace
            zero = dataclasses.replace(GREEDY)
            object.__setattr__(zero, "max_tokens", 0)  # (as a raw wire message could say)
            for request_id, params, decode in (("zero", zero, "d0"), ("nobody", GREEDY, "d9"),
                                               ("fine", GREEDY, "d0")):
                await gateway.bus.publish(subjects.prefill_worker("p0"), PrefillRequest(
                    request_id=request_id, prompt_token_ids=[5] * 8, sampling=params,
                    reply_subject=INBOX, decode_worker=decode, enqueued_at=0.0))
            assert await gateway.outcome("nobody") == ([], errors.NO_CAPACITY)
            first = await asyncio.wait_for(gateway.items.get(), 20)  # (decode continues it)
            assert isinstance(first, TokenDeltas) and first.deltas[0].request_id == "fine"
            assert worker.bus.dropped == 1 and gateway.items.empty()  # nothing for "zero"
            beating.cancel()
            await decode_bus.close()

    asyncio.run(scenario())


def test_with_no_decode_worker_alive_a_request_is_a_clear_503_at_once():
    config = MeshConfig(nats_url="memory://", num_prefill=0)

    async def scenario() -> None:
        client = await a_gateway_seeing(InMemoryBroker(), [], config)
        started = time.monotonic()
        with pytest.raises(RequestFailed) as failed:
            async for _ in client.generate([1, 2, 3], GREEDY, "r1"):
                pass
        assert time.monotonic() - started < 2
        assert failed.value.code == errors.NO_CAPACITY
        assert "no decode worker alive" in str(failed.value)
        await client.close()

    asyncio.run(scenario())
