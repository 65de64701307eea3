"""The gateway's admission (gateway/admission.py): who waits, who goes next and who is refused,
by tenant weight and priority; and where a request's tenant comes from (gateway/edge.py)."""

from __future__ import annotations

import asyncio

import pytest

from evenflow.gateway.admission import Admission
from evenflow.gateway.edge import TENANT_KEY, EdgeMiddleware, read_api_keys
from evenflow.gateway.protocol import APIError, CompletionRequest
from evenflow.services.config import ConfigError, MeshConfig


async def _queue(admission: Admission, tenant: str, priority: int = 0) -> asyncio.Task:
    task = asyncio.ensure_future(admission.acquire(tenant, priority))
    await asyncio.sleep(0)  # (queued now)
    return task


async def _granted_order(admission: Admission, held, tasks: dict[str, asyncio.Task]) -> list[str]:
    """Release the held slots one by one; the names of the waiters in the order they got one."""
    order: list[str] = []
    pending = dict(tasks)
    held = list(held)
    while pending:
        held.pop(0).release()
        await asyncio.sleep(0)
        for name, task in list(pending.items()):
            if task.done():
                order.append(name)
                held.append(task.result())
                del pending[name]
    return order


def test_waiters_get_slots_best_priority_first_then_in_arrival_order():
    async def main():
        admission = Admission(1, 10, aging_s=0)
        held = [await admission.acquire()]
        tasks = {name: await _queue(admission, "t", priority)
                 for name, priority in (("low", 5), ("first-normal", 0), ("high", -2),
                                        ("second-normal", 0))}
        return await _granted_order(admission, held, tasks)

    assert asyncio.run(main()) == ["high", "first-normal", "second-normal", "low"]


def test_a_waiter_ages_ahead_of_better_priorities_that_came_much_later(monkeypatch):
    import evenflow.gateway.admission as module

    now = [100.0]
    monkeypatch.setattr(module.time, "monotonic", lambda: now[0])

    async def main():
        admission = Admission(1, 10, aging_s=1.0)
        held = [await admission.acquire()]
        tasks = {"old-low": await _queue(admission, "t", 3)}
        now[0] += 10  # 10 s later: 3 - 10 ranks before a fresh 0
        tasks["new-normal"] = await _queue(admission, "t", 0)
        return await _granted_order(admission, held, tasks)

    assert asyncio.run(main()) == ["old-low", "new-normal"]


def test_slots_go_to_the_tenant_furthest_under_its_weighted_share():
    async def main():
        admission = Admission(4, 100, weights={"gold": 3.0}, aging_s=0)
        held = [await admission.acquire("free") for _ in range(4)]  # free holds every slot
        tasks = {f"free{i}": await _queue(admission, "free") for i in range(4)}
        tasks.update({f"gold{i}": await _queue(admission, "gold") for i in range(4)})
        return await _granted_order(admission, held, tasks)

    order = asyncio.run(main())
    # gold (weight 3) takes freed slots until it runs 3 for free's 1, then they alternate
    assert order[:3] == ["gold0", "gold1", "gold2"]
    assert sorted(order) == sorted([f"free{i}" for i in range(4)] + [f"gold{i}" for i in range(4)])


def test_a_flooding_tenant_is_pushed_out_of_the_queue_for_one_under_its_share():
    async def main():
        admission = Admission(1, 4, aging_s=0)
        held = await admission.acquire("a")
        flood = [await _queue(admission, "a", priority) for priority in (0, 0, 0, 7)]
        b = await _queue(admission, "b")  # the queue is full, but b holds none of it
        await asyncio.sleep(0)
        pushed = flood[3]  # a's lowest priority, newest
        assert pushed.done()
        with pytest.raises(APIError) as refused:
            pushed.result()
        assert refused.value.status == 429
        assert refused.value.body()["error"]["code"] == "tenant_over_share"
        assert "'a'" in refused.value.body()["error"]["message"]
        assert not b.done() and admission.queued == 4
        held.release()
        await asyncio.sleep(0)
        assert b.done()  # b is furthest under its share of the running slots
        for task in flood[:3]:
            task.cancel()
        await asyncio.gather(*flood[:3], return_exceptions=True)
        b.result().release()

    asyncio.run(main())


def test_a_full_queue_refuses_with_the_limit_that_was_hit():
    async def main():
        admission = Admission(1, 2, aging_s=0)
        held = await admission.acquire("a")
        waiting = [await _queue(admission, "a"), await _queue(admission, "b")]
        with pytest.raises(APIError) as over_share:  # a holds its half already
            await admission.acquire("a")
        single = Admission(1, 1, aging_s=0)
        single_held = await single.acquire("a")
        single_waiting = await _queue(single, "a")
        with pytest.raises(APIError) as full:  # one tenant, queue full
            await single.acquire("a")
        for task in (*waiting, single_waiting):
            task.cancel()
        await asyncio.gather(*waiting, single_waiting, return_exceptions=True)
        held.release()
        single_held.release()
        return over_share.value, full.value, admission, single

    over_share, full, admission, single = asyncio.run(main())
    assert over_share.status == 429 and over_share.headers == {"Retry-After": "1"}
    assert over_share.body()["error"]["code"] == "tenant_over_share"
    assert full.status == 429 and full.body()["error"]["code"] == "overloaded"
    assert "queued at this gateway" in full.body()["error"]["message"]
    # cancelled waiters left the queue and the slots came back
    assert (admission.queued, admission.running, single.queued, single.running) == (0, 0, 0, 0)


def test_a_cancelled_waiter_leaves_the_queue_and_a_slot_is_released_once():
    async def main():
        admission = Admission(1, 10)
        slot = await admission.acquire()
        gone = await _queue(admission, "t")
        gone.cancel()
        await asyncio.gather(gone, return_exceptions=True)
        assert admission.queued == 0
        next_one = await _queue(admission, "t")
        slot.release()
        slot.release()  # (twice: still one slot back)
        await asyncio.sleep(0)
        assert next_one.done() and admission.running == 1
        next_one.result().release()
        assert admission.running == 0

    asyncio.run(main())


def test_priority_is_a_request_field_and_reaches_the_sampling_params():
    request = CompletionRequest.model_validate({"model": "m", "prompt": "x", "priority": -5})
    assert request.to_sampling_params(8).priority == -5
    with pytest.raises(ValueError):
        CompletionRequest.model_validate({"model": "m", "prompt": "x", "priority": "high"})


def test_tenant_weights_are_checked_when_the_config_is_made():
    assert MeshConfig(tenant_weights="gold=4, free=1").tenant_weight_map() == {
        "gold": 4.0, "free": 1.0}
    with pytest.raises(ConfigError, match="'gold'"):
        MeshConfig(tenant_weights="gold")
    with pytest.raises(ConfigError, match="free=0"):
        MeshConfig(tenant_weights="free=0")


def _tenant_of(edge: EdgeMiddleware, headers: list[tuple[bytes, bytes]]) -> str | None:
    seen: dict[str, str] = {}

    async def app(scope, receive, send):
        seen["tenant"] = scope[TENANT_KEY]

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        seen.setdefault("status", message.get("status"))

    edge.app = app
    asyncio.run(edge({"type": "http", "method": "GET", "path": "/v1/models",
                      "headers": headers}, receive, send))
    return seen.get("tenant")


def test_a_request_is_its_api_keys_tenant_or_the_operators_header(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("sk-team-a team-a\nsk-anon\n")
    config = MeshConfig(api_key_file=str(keys))
    assert read_api_keys(config) == {"sk-team-a": "team-a", "sk-anon": ""}
    edge = EdgeMiddleware(None, config, read_api_keys(config))  # type: ignore[arg-type]
    assert _tenant_of(edge, [(b"authorization", b"Bearer sk-team-a")]) == "team-a"
    anonymous = _tenant_of(edge, [(b"authorization", b"Bearer sk-anon")])
    assert anonymous is not None and anonymous.startswith("key-") and "sk-anon" not in anonymous
    assert _tenant_of(edge, [(b"authorization", b"Bearer wrong")]) is None  # 401
    by_header = EdgeMiddleware(None, MeshConfig(tenant_header="X-Tenant"), {})  # type: ignore
    assert _tenant_of(by_header, [(b"x-tenant", b"batch")]) == "batch"
    assert _tenant_of(by_header, []) == "default"


def test_a_better_priority_starts_past_the_limit_while_a_worse_one_runs():
    async def main():
        admission = Admission(4, 10, aging_s=0)  # headroom: a quarter more, 1
        low = [await admission.acquire("t", 3) for _ in range(4)]
        high = await asyncio.wait_for(admission.acquire("t", -1), 1)  # (the engine preempts)
        queued = await _queue(admission, "t", -1)  # the headroom is used up: it waits
        same = await _queue(admission, "t", 3)
        assert admission.running == 5 and not queued.done() and not same.done()
        high.release()
        for slot in low:
            slot.release()
        await asyncio.sleep(0)
        assert queued.done() and same.done()
        queued.result().release()
        same.result().release()
        return admission

    admission = asyncio.run(main())
    assert admission.running == 0 and admission._priorities == {}


def test_priority_does_not_start_a_tenant_past_its_share():
    async def main():
        admission = Admission(4, 10, aging_s=0)
        mine = [await admission.acquire("a", 3) for _ in range(2)]
        theirs = [await admission.acquire("b", 3) for _ in range(2)]
        jump = await _queue(admission, "a", -9)  # a runs its half already: it waits
        assert not jump.done() and admission.running == 4
        jump.cancel()
        await asyncio.gather(jump, return_exceptions=True)
        for slot in mine + theirs:
            slot.release()

    asyncio.run(main())
