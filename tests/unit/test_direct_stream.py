"""The gateway's direct path (gateway/direct.py) and shared routing state (gateway/peers.py):
a middle chunk from the byte template is the bytes the ASGI path sends; a delta the direct
path cannot stream (a stop string) leaves the choice as it was; gateways count each other's
synced load in place of the heartbeats' older figure."""

from __future__ import annotations

import random
import time

import orjson
import pytest

from evenflow import models
from evenflow.gateway.choice import ChoiceOutput
from evenflow.gateway.jobs import Job
from evenflow.gateway.peers import PeerGateways
from evenflow.gateway.render import ChunkTemplate, chunk_body
from evenflow.gateway.router import WorkerRegistry, current_load
from evenflow.proto.messages import Role, RouterSync, TokenDelta, WorkerHeartbeat
from evenflow.proto.sampling import SamplingParams
from evenflow.proto.tokenizer import IncrementalDetokenizer, Tokenizer


@pytest.mark.parametrize("kind", ["completion", "chat"])
@pytest.mark.parametrize("text", [" 5", "\"quoted\" \\ back", "line\nbreak", "é ✓ 🙂", "\x01"])
def test_template_chunk_is_the_asgi_paths_bytes(kind, text):
    template = ChunkTemplate(kind, "cmpl-abc", "tiny-moe", 1764950000)
    expected = b"data: " + orjson.dumps(chunk_body(kind, "cmpl-abc", "tiny-moe", 0, text, None,
                                                   False, None, created=1764950000)) + b"\n\n"
    assert template.event(text) == expected


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer(models.resolve_model("tiny-moe"))


def _output(tokenizer, stop: list[str]) -> ChoiceOutput:
    prompt = tokenizer.encode("count from 5 :")
    job = Job("completion", "cmpl-x", "tiny-moe", prompt,
              SamplingParams(max_tokens=64, stop=stop), True, False, time.monotonic() + 60)
    detok = IncrementalDetokenizer(tokenizer, prompt, stop)
    return ChoiceOutput(job, detok, tokenizer.vocab_size, time.monotonic())


def test_a_stop_string_is_left_to_the_task_with_nothing_changed(tokenizer):
    ids = tokenizer.encode(" 6 7 8 9", add_special_tokens=False)
    direct, task = _output(tokenizer, ["8"]), _output(tokenizer, ["8"])
    first = TokenDelta(request_id="r", token_ids=ids[:1], first_index=0)
    for output in (direct, task):
        output.take(first, time.monotonic())
    streamed = ""
    for i in range(1, len(ids)):
        delta = TokenDelta(request_id="r", token_ids=ids[i:i + 1], first_index=i)
        text = direct.plain_text(delta, time.monotonic())
        if text is None:  # the task takes it, from the state the direct path left
            piece = direct.take(delta, time.monotonic())
            assert piece is not None and piece.finish == "stop"
            streamed += piece.text
            break
        streamed += text
    else:
        raise AssertionError("the stop string was never seen")
    whole = ""
    for i in range(1, len(ids)):
        piece = task.take(TokenDelta(request_id="r", token_ids=ids[i:i + 1], first_index=i),
                          time.monotonic())
        whole += piece.text if piece else ""
        if piece and piece.finish:
            break
    assert streamed == whole == " 7 "
    assert direct.job.usage.completion_tokens == task.job.usage.completion_tokens


def _heartbeat(worker: str, by_gateway: dict[str, int]) -> WorkerHeartbeat:
    return WorkerHeartbeat(worker_id=worker, role=Role.DECODE, model="m", running=sum(
        by_gateway.values()), load_by_gateway=by_gateway, free_kv_blocks=100)


def test_the_first_event_is_the_tasks_even_when_the_first_token_has_no_text(tokenizer):
    """A first token of no text (a special token skipped, half a character) gives the task no
    piece: the next delta must still go to the task, which renders the first event (a chat
    stream's role; the first-chunk timing), not to the direct path's template."""
    output = _output(tokenizer, [])
    silent = next(i for i in range(tokenizer.vocab_size) if not tokenizer.decode([i]))
    assert output.take(TokenDelta(request_id="r", token_ids=[silent], first_index=0),
                       time.monotonic()) is None
    ids = tokenizer.encode(" 6", add_special_tokens=False)
    second = TokenDelta(request_id="r", token_ids=ids, first_index=1)
    assert output.plain_text(second, time.monotonic()) is None  # not the direct path's
    piece = output.take(second, time.monotonic())
    assert piece is not None and piece.text  # the task's first event
    third = TokenDelta(request_id="r", token_ids=ids, first_index=1 + len(ids))
    assert output.plain_text(third, time.monotonic()) == " 6"  # from now on, direct


def test_a_peers_synced_load_replaces_its_heartbeat_figure():
    hb = _heartbeat("d0", {"gw.a": 3, "gw.b": 5})
    assert current_load(hb, "gw.a", 2, 8) == 2 + 5  # heartbeats only
    assert current_load(hb, "gw.a", 2, 8, peers={"gw.b": 9}) == 2 + 9  # b synced since
    assert current_load(_heartbeat("d0", {}), "gw.a", 0, 0, peers={"gw.b": 4}) == 4


def test_gateways_see_each_others_load_through_their_syncs():
    a, b = WorkerRegistry(10.0, own_subject="gw.a"), WorkerRegistry(10.0, own_subject="gw.b")
    for registry in (a, b):
        registry.observe(_heartbeat("d0", {}))
        registry.observe(_heartbeat("d1", {}))
    sync_a, sync_b = PeerGateways("gw.a", a, None, 0.05), PeerGateways("gw.b", b, None, 0.05)
    assert sync_a.next_sync(time.monotonic()) is None  # nothing in flight, nothing to say
    for _ in range(3):  # gateway a sends three requests to d0
        a.acquire(a.workers["d0"], None, 0)
    sync = sync_a.next_sync(time.monotonic())
    assert isinstance(sync, RouterSync) and sync.inflight == {"d0": 3}
    sync_b.on_sync(sync, None)
    sync_a.on_sync(sync, None)
    assert not a.peers  # its own sync (NATS echoes it back): not a peer's
    assert b.pick_decode(1, {}, set()).worker_id == "d1"  # b sees a's three on d0
    assert sync_a.next_sync(time.monotonic()) is None  # unchanged since
    a.release("d0", None, 0)
    assert sync_a.next_sync(time.monotonic()).inflight == {"d0": 2}


def test_tokenizers_stream_decoder_gives_the_same_text(tokenizer):
    """Without stop strings the detokenizer uses tokenizers' DecodeStream; with one, its own
    prefix/read offsets: the same text either way, special and partial-UTF-8 tokens included."""
    rng = random.Random(0)
    vocab = tokenizer.vocab_size
    for _ in range(200):
        prompt = [rng.randrange(3, vocab) for _ in range(8)]
        output = [rng.randrange(0, vocab) for _ in range(24)]
        streamed = IncrementalDetokenizer(tokenizer, prompt)
        classic = IncrementalDetokenizer(tokenizer, prompt, ["\x00never"])
        assert streamed._step is not None and classic._step is None
        got = "".join(streamed.add([t]) for t in output) + streamed.flush()
        assert got == classic.add(output) + classic.flush()
