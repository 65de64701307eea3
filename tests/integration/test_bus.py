"""The bus against a real nats-server: typed messages, framing of oversized payloads, garbage."""

from __future__ import annotations

import asyncio

import pytest

from evenflow.proto.messages import Cancel, KVBlockChunk
from evenflow.services.bus import Bus
from evenflow.services.launcher import start_nats, start_redis
from evenflow.services.redis_conn import connect_redis, redis_available


@pytest.fixture(scope="module")
def nats_server():
    server = start_nats()
    yield server
    server.stop()


def test_messages_larger_than_max_payload_arrive_whole(nats_server):
    async def scenario():
        sender, receiver = Bus("sender"), Bus("receiver")
        await sender.connect(nats_server.url)
        await receiver.connect(nats_server.url)
        got: list = []
        arrived = asyncio.Event()

        def on_message(message, _ctx):
            got.append(message)
            if len(got) == 2:
                arrived.set()

        await receiver.subscribe("t.big", on_message)
        await receiver.nc.flush()
        big = KVBlockChunk(request_id="r", seq=0, first_block=0, num_blocks=1,
                           data=bytes(range(256)) * (3 * sender.max_payload // 256))
        await sender.publish("t.big", big)
        await sender.publish("t.big", Cancel(request_id="r"))
        await sender.nc.flush()
        await asyncio.wait_for(arrived.wait(), 10)
        await sender.nc.publish("t.big", b"x", headers={"Evenflow-Frame": "id 0 2"})
        await sender.nc.publish("t.big", b"y", headers={"Evenflow-Frame": "id 0 2"})  # repeat
        await sender.nc.publish("t.big", b"z", headers={"Evenflow-Frame": "nonsense"})
        await sender.nc.flush()
        await asyncio.sleep(0.2)
        await sender.close()
        await receiver.close()
        return got, receiver.dropped

    got, dropped = asyncio.run(scenario())
    assert got[0].data == bytes(range(256)) * (len(got[0].data) // 256)
    assert len(got[0].data) > 2 * 1024 * 1024 and got[1] == Cancel(request_id="r")
    assert dropped == 2


def test_redis_client_fails_fast_when_redis_is_gone():
    async def scenario():
        server = start_redis()
        client = connect_redis(server.url)
        up = await redis_available(client)
        server.stop()
        loop = asyncio.get_running_loop()
        start = loop.time()
        down = await redis_available(client)
        return up, down, loop.time() - start

    up, down, took = asyncio.run(scenario())
    assert up and not down
    assert took < 1.0


def test_a_flood_of_never_finished_frames_stays_inside_the_receivers_budget(nats_server,
                                                                          monkeypatch):
    from evenflow.services import bus as bus_module
    from evenflow.services.reassembly import Reassembly, ReassemblyBudget

    seen = {"frames": 0, "max_held": 0}

    class Watched(Reassembly):  # what the receiver's reassembly took in, and held at most
        def add(self, header: str, data: bytes) -> bytes | None:
            out = super().add(header, data)
            if header.endswith(" rogue"):
                seen["frames"] += 1
                seen["max_held"] = max(seen["max_held"], self.held_by("rogue"))
            return out

    monkeypatch.setattr(bus_module, "Reassembly", Watched)

    async def scenario():
        budget = ReassemblyBudget(peer_bytes=4 * 2**20, total_bytes=8 * 2**20)
        rogue, sender, receiver = Bus("rogue"), Bus("sender"), Bus("receiver", budget)
        for bus in (rogue, sender, receiver):
            await bus.connect(nats_server.url)
        got: list = []
        arrived = asyncio.Event()

        def on_message(message, _ctx):
            got.append(message)
            arrived.set()

        await receiver.subscribe("t.flood", on_message)
        await receiver.nc.flush()
        for i in range(200):  # 200 x 64 KiB announced as 100,000-part messages
            await rogue.nc.publish("t.flood", bytes(64 * 1024),
                                   headers={"Evenflow-Frame": f"f{i} 0 100000 rogue"})
        await rogue.nc.flush()
        big = KVBlockChunk(request_id="r", seq=0, first_block=0, num_blocks=1,
                           data=bytes(3 * sender.max_payload))
        await sender.publish("t.flood", big)
        await asyncio.wait_for(arrived.wait(), 10)
        # the big message comes over another connection: on a loaded machine it may be handled
        # before the rogue's last frames; give those a moment to arrive (and be dropped or held)
        deadline = asyncio.get_running_loop().time() + 5
        while seen["frames"] < 200 and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        for bus in (rogue, sender, receiver):
            await bus.close()
        return got, receiver.dropped

    got, dropped = asyncio.run(scenario())
    assert len(got[0].data) == 3 * 1024 * 1024
    # At most 4 MiB of the rogue's frames held at a time: every frame past 64 was dropped,
    # counted against the frames that reached the receiver (on a loaded 2-core machine CI saw
    # 3 of the 200 still missing after the wait).
    assert seen["max_held"] <= 4 * 2**20
    assert seen["frames"] >= 100 and dropped >= seen["frames"] - 64


def test_a_message_with_an_empty_reply_subject_is_one_drop_line(nats_server, caplog):
    """Nowhere to answer: dropped and counted, one warning, no traceback, handler untouched."""
    from evenflow.proto.messages import PrefillRequest
    from evenflow.proto.sampling import SamplingParams

    async def scenario() -> tuple[int, list]:
        bus = Bus("worker")
        await bus.connect(nats_server.url)
        seen: list = []
        await bus.subscribe("evenflow.prefill.p0", lambda m, _c: seen.append(m))
        sender = Bus("sender")
        await sender.connect(nats_server.url)
        await sender.publish("evenflow.prefill.p0", PrefillRequest(
            request_id="r", prompt_token_ids=[1, 2], sampling=SamplingParams(),
            reply_subject="", decode_worker="d0", enqueued_at=0.0))
        for _ in range(100):
            if bus.dropped:
                break
            await asyncio.sleep(0.02)
        await sender.close()
        await bus.close()
        return bus.dropped, seen

    from evenflow.services.metrics import MESSAGES_DROPPED

    counted = MESSAGES_DROPPED.labels(service="worker", reason="empty_reply")
    before = counted._value.get()
    with caplog.at_level("WARNING"):
        dropped, seen = asyncio.run(scenario())
    assert dropped == 1 and seen == [] and counted._value.get() - before == 1
    lines = [r for r in caplog.records if "empty reply subject" in r.getMessage()]
    assert len(lines) == 1 and lines[0].exc_info is None
    assert not [r for r in caplog.records if r.levelname == "ERROR"]


def test_an_unreachable_nats_is_said_with_its_reason():
    from evenflow.services.bus import unreachable_reason
    from evenflow.services.launcher import free_port

    async def scenario() -> str:
        bus = Bus("gateway")
        try:
            await asyncio.wait_for(bus.connect(f"nats://127.0.0.1:{free_port()}"), 1.5)
        except Exception as exc:
            return unreachable_reason(exc, bus)
        return "connected?"

    reason = asyncio.run(scenario())
    assert reason and "TimeoutError" not in reason and reason != "connected?", reason


def test_one_budget_for_all_subscriptions_and_held_frames_expire_without_new_ones(nats_server):
    """A peer framing into two subjects of one receiver holds one peer budget between them, and
    what it left incomplete is let go at the timeout though nothing else arrives."""
    from evenflow.services.reassembly import ReassemblyBudget

    async def scenario() -> tuple[int, int, int]:
        budget = ReassemblyBudget(peer_bytes=2 * 2**20, total_bytes=8 * 2**20, timeout_s=1.0)
        rogue, receiver = Bus("rogue"), Bus("receiver", budget)
        for bus in (rogue, receiver):
            await bus.connect(nats_server.url)
        for subject in ("t.a", "t.b"):
            await receiver.subscribe(subject, lambda m, _c: None)
        await receiver.nc.flush()
        for i in range(40):  # 40 x 128 KiB, never finished, over two subjects: 5 MiB
            await rogue.nc.publish("t.a" if i % 2 else "t.b", bytes(128 * 1024),
                                   headers={"Evenflow-Frame": f"f{i} 0 9 rogue"})
        await rogue.nc.flush()
        held_max = 0
        for _ in range(40):
            held_max = max(held_max, receiver.frames.held_by("rogue"))
            await asyncio.sleep(0.02)
        await asyncio.sleep(1.0 + budget.timeout_s)  # the timer's round, then nothing held
        held_after = receiver.frames.held_bytes
        for bus in (rogue, receiver):
            await bus.close()
        return held_max, held_after, receiver.dropped

    held_max, held_after, dropped = asyncio.run(scenario())
    assert 0 < held_max <= 2 * 2**20 and held_after == 0 and dropped > 0
