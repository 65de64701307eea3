"""One bad request, or one failing step, never takes a worker down: it fails that request (an
error reply, its KV blocks and load freed) and the worker keeps serving. Runs a decode worker on
the in-memory bus with the mock engine."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any

import msgpack

from evenflow.decode.service import DecodeWorker
from evenflow.proto import errors, subjects
from evenflow.proto.messages import (
    DecodeRequest,
    ErrorMessage,
    Message,
    Role,
    TokenDeltas,
    WorkerHeartbeat,
    encode,
)
from evenflow.proto.sampling import SamplingParams
from evenflow.services.config import MeshConfig
from evenflow.services.memory_bus import InMemoryBroker, InMemoryBus

INBOX = "evenflow.gateway.faults"
POISON = 13  # a prompt token the fault injector fails on


async def with_decode_worker(scenario: Callable[[DecodeWorker, InMemoryBus, asyncio.Queue],
                                                Awaitable[None]], **settings: Any) -> None:
    config = MeshConfig(nats_url="memory://", engine="mock", num_ep_ranks=0, num_kv_blocks=64,
                        heartbeat_interval_s=0.05, **settings)
    broker = InMemoryBroker()
    worker = DecodeWorker(config, "d0", InMemoryBus(broker, "d0"))
    running = asyncio.create_task(worker.run(install_signals=False))
    gateway = InMemoryBus(broker, "gateway")
    await gateway.connect("memory://")
    inbox: asyncio.Queue[Message] = asyncio.Queue()
    await gateway.subscribe(INBOX, lambda m, _c: inbox.put_nowait(m))
    await gateway.subscribe(subjects.HEARTBEATS, lambda m, _c: inbox.put_nowait(m))
    await asyncio.wait_for(worker.started.wait(), 30)
    try:
        await scenario(worker, gateway, inbox)
    finally:
        worker.request_stop()
        await asyncio.wait_for(running, 30)
        await gateway.close()


async def send(gateway: InMemoryBus, request_id: str, prompt: list[int],
               sampling: SamplingParams) -> None:
    await gateway.publish(subjects.decode_worker("d0"), DecodeRequest(
        request_id=request_id, prompt_token_ids=prompt, sampling=sampling, reply_subject=INBOX,
        enqueued_at=0.0))


_ENDED: dict[str, tuple[str, ErrorMessage | None]] = {}  # request id -> how it ended


async def outcome(inbox: asyncio.Queue, request_id: str) -> tuple[str, ErrorMessage | None]:
    """("finished", None) or ("error", the error), within a bounded time (never a hang). One
    TokenDeltas message may end several requests: every ending seen is remembered."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    while request_id not in _ENDED:
        item = await asyncio.wait_for(inbox.get(), max(0.0, deadline - loop.time()))
        if isinstance(item, ErrorMessage):
            _ENDED[item.request_id] = ("error", item)
        elif isinstance(item, TokenDeltas):
            _ENDED.update((d.request_id, ("finished", None))
                          for d in item.deltas if d.finish_reason)
    return _ENDED.pop(request_id)


async def heartbeat(inbox: asyncio.Queue) -> WorkerHeartbeat:
    while True:
        item = await asyncio.wait_for(inbox.get(), 10)
        if isinstance(item, WorkerHeartbeat):
            return item
        if isinstance(item, TokenDeltas | ErrorMessage):
            inbox.put_nowait(item)  # not ours: leave it for outcome()
            await asyncio.sleep(0.01)


GREEDY = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


def test_invalid_sampling_on_the_wire_is_dropped_and_counted():
    """Values the gateway would refuse (a forged or buggy sender): SamplingParams refuses them
    as the message is decoded, so the worker drops the message, counts it, keeps no block or
    load for it, and serves the next request."""
    async def scenario(worker, gateway, inbox) -> None:
        names = [f.name for f in dataclasses.fields(SamplingParams)]
        bad = [("stop_token_ids", [-1]), ("top_p", 0.0), ("temperature", -1.0),
               ("max_tokens", 0), ("seed", (1 << 64) - 1), ("logprobs", 21)]
        for i, (name, value) in enumerate(bad):
            envelope = msgpack.unpackb(encode(DecodeRequest(
                request_id=f"bad{i}", prompt_token_ids=[5] * 20, sampling=GREEDY,
                reply_subject=INBOX, enqueued_at=0.0)))
            envelope["d"][2][names.index(name)] = value  # (field 2: sampling)
            gateway.broker.publish_raw(subjects.decode_worker("d0"), msgpack.packb(envelope))
        # A huge top_k is legal (all tokens) and is served.
        await send(gateway, "topk", [5] * 20, SamplingParams(top_k=(1 << 31) - 1, max_tokens=3,
                                                              temperature=1.0, seed=1))
        assert (await outcome(inbox, "topk"))[0] == "finished"
        assert worker.bus.dropped == len(bad)
        await asyncio.sleep(0.1)
        hb = await heartbeat(inbox)
        assert hb.free_kv_blocks == hb.total_kv_blocks and not hb.load_by_gateway
        assert not worker.active

    asyncio.run(with_decode_worker(scenario))


def test_a_failing_step_fails_its_requests_and_the_worker_recovers():
    async def scenario(worker, gateway, inbox) -> None:
        runner = worker.engine.runner  # the fault injector reaches inside, as faults do
        run = runner.run

        def run_with_poison(chunks):
            if any(POISON in c.seq.token_ids for c in chunks):
                raise RuntimeError("injected fault")
            return run(chunks)

        runner.run = run_with_poison
        await send(gateway, "poison", [POISON] * 20, GREEDY)
        kind, error = await outcome(inbox, "poison")
        assert kind == "error" and error.code == errors.ENGINE_FAILED and error.retryable
        # Not stuck: the next requests are served, and nothing leaked.
        for i in range(3):
            await send(gateway, f"ok{i}", [5 + i] * 20, GREEDY)
        for i in range(3):
            assert (await outcome(inbox, f"ok{i}"))[0] == "finished"
        await asyncio.sleep(0.1)
        hb = await heartbeat(inbox)
        assert hb.free_kv_blocks == hb.total_kv_blocks and not hb.unhealthy

    asyncio.run(with_decode_worker(scenario))


def test_an_engine_that_keeps_failing_reports_itself_unhealthy():
    async def scenario(worker, gateway, inbox) -> None:
        def always_fail(chunks):
            raise RuntimeError("broken engine")

        worker.engine.runner.run = always_fail
        for i in range(3):
            await send(gateway, f"r{i}", [5] * 20, GREEDY)
            assert (await outcome(inbox, f"r{i}"))[0] == "error"
        deadline = asyncio.get_running_loop().time() + 5
        while not (await heartbeat(inbox)).unhealthy:
            assert asyncio.get_running_loop().time() < deadline
        assert "failed 3 times in a row" in worker.healthy()

    asyncio.run(with_decode_worker(scenario))


def test_requests_of_a_silent_gateway_are_dropped():
    """A gateway that dies leaves no request running to max_tokens on the workers."""
    async def scenario(worker, gateway, inbox) -> None:
        alive = WorkerHeartbeat(worker_id="faults", role=Role.GATEWAY, model="tiny-moe")
        await gateway.publish(subjects.heartbeat(Role.GATEWAY, "faults"), alive)
        await send(gateway, "long", [5] * 20, SamplingParams(temperature=0, max_tokens=450,
                                                            ignore_eos=True))
        await asyncio.sleep(0.3)
        assert "long" in worker.active
        # The gateway goes silent: within the TTL (0.5 s here) the request is dropped.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 5
        while "long" in worker.active:
            assert loop.time() < deadline, "the orphan kept running"
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)
        hb = await heartbeat(inbox)
        assert hb.free_kv_blocks == hb.total_kv_blocks and hb.running == 0

    asyncio.run(with_decode_worker(scenario, orphan_ttl_s=0.5))
