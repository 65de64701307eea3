"""The wire codec: round trips, version interop (N <-> N+1), and garbage as an error value."""

import msgpack
import pytest

from evenflow.proto.messages import (
    MAX_MESSAGE_BYTES,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Cancel,
    DecodeRequest,
    KVBlockChunk,
    KVEvents,
    PrefillRequest,
    Role,
    TokenDelta,
    TokenDeltas,
    WireError,
    WorkerHeartbeat,
    decode,
    encode,
)
from evenflow.proto.sampling import SamplingParams


def test_round_trip_keeps_every_field():
    msgs = [
        PrefillRequest(request_id="r1", prompt_token_ids=[1, 2, 3],
                       sampling=SamplingParams(temperature=0.5, seed=3, stop_token_ids=[7]),
                       reply_subject="evenflow.gateway.g", decode_worker="d0", enqueued_at=12.5),
        KVBlockChunk(request_id="r1", seq=0, first_block=0, num_blocks=2,
                     data=b"\x00\x01" * 100),
        TokenDeltas(worker_id="w", deltas=[
            TokenDelta(request_id="r1", token_ids=[5], num_prompt_tokens=3),
            TokenDelta(request_id="r2", token_ids=[], finish_reason="stop", num_prompt_tokens=4,
                       num_cached_tokens=2)]),
        Cancel(request_id="r1"),
        WorkerHeartbeat(worker_id="d0", role=Role.DECODE, model="m", running=3,
                        free_kv_blocks=10, total_kv_blocks=20, sent_at=1.5, epoch="e",
                        kv_bytes_received=7, kv_transfer_seconds=0.25,
                        load_by_gateway={"evenflow.gateway.a": 2, "evenflow.gateway.b": 1},
                        draining=True),
        KVEvents(worker_id="p0", role=Role.PREFILL, epoch="e", seq=4, events=[
            BlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=[9] * 8,
                        block_size=4),
            BlockRemoved(block_hashes=[3]), AllBlocksCleared()]),
    ]
    for m in msgs:
        assert decode(encode(m)) == m


def test_sampling_params_cross_the_wire_as_the_engine_takes_them():
    """The one sampling type: what the gateway builds is what the engine receives, sequences
    as tuples and unset fields as None; a value out of range is a dropped message."""
    sampling = SamplingParams(temperature=0.7, top_k=5, max_tokens=9, stop_token_ids=[2, 3],
                              logit_bias={4: -1.5}, allowed_token_ids=[4, 5, 6], logprobs=2,
                              guide="start: /a+/", stop=["END"], min_tokens=1)
    message = DecodeRequest(request_id="r", prompt_token_ids=[1], sampling=sampling,
                            reply_subject="s", enqueued_at=0.0)
    got = decode(encode(message))
    assert got == message and got.sampling.logit_bias == ((4, -1.5),)
    assert got.sampling.stop_token_ids == (2, 3) and got.sampling.prompt_logprobs is None
    envelope = msgpack.unpackb(encode(message))
    envelope["d"][2][0] = -0.5  # temperature
    rejected = decode(msgpack.packb(envelope))
    assert isinstance(rejected, WireError) and "temperature" in rejected.reason


def test_kv_events_are_packed_like_vllm_tagged_array_structs():
    event = BlockStored(block_hashes=[7], parent_block_hash=5, token_ids=[1, 2], block_size=2)
    payload = msgpack.unpackb(encode(KVEvents(worker_id="w", role=Role.PREFILL, epoch="e",
                                              seq=1, events=[event])))
    # vLLM's msgspec structs (tag=True, array_like=True): [tag, *fields in declaration order]
    assert payload["d"][4] == [["BlockStored", [7], 5, [1, 2], 2, None, None]]


def test_an_old_heartbeat_decodes_with_defaults_for_fields_it_lacks():
    # Version 2 (before `draining` was its own field): 13 fields, role "decode".
    v2 = msgpack.packb({"t": "heartbeat", "v": 2, "d": [
        "d0", "decode", "m", 3, 0, 10, 20, 0, 1.5, "e", 7, 0.25, {"g": 1}]})
    hb = decode(v2)
    assert isinstance(hb, WorkerHeartbeat)
    assert hb.role is Role.DECODE and hb.load_by_gateway == {"g": 1} and hb.draining is False


def test_a_newer_message_with_unknown_trailing_fields_still_decodes():
    future = msgpack.packb({"t": "cancel", "v": 7, "d": ["r1", "a field from the future", 3]})
    assert decode(future) == Cancel(request_id="r1")


@pytest.mark.parametrize("payload", [
    b"", b"\xc1garbage", msgpack.packb([1, 2]), msgpack.packb({"t": "nope", "v": 1, "d": []}),
    msgpack.packb({"t": "cancel", "v": 0, "d": ["r"]}),  # older than any version we speak
    msgpack.packb({"t": "cancel", "v": 1, "d": [5]}),
    msgpack.packb({"t": "cancel", "v": 1, "d": []}),  # a required field is missing
    msgpack.packb({"t": "cancel", "v": "1", "d": ["r"]}),
    msgpack.packb({"t": "prefill_request", "v": 1, "d": ["r", ["x"], [], "s", "d", 1.0]}),
    msgpack.packb({"t": "prefill_request", "v": 1, "d": ["r", [True], [], "s", "d", 1.0]}),
    msgpack.packb({"t": "heartbeat", "v": 2,
                   "d": ["d0", "decode", "m", 3, 0, 10, 20, 0, 1.5, "e", 7, 0.25, {"g": "x"}]}),
    msgpack.packb({"t": "heartbeat", "v": 3, "d": ["d0", "gateway?", "m"]}),  # unknown role
    msgpack.packb({"t": "kv_events", "v": 2, "d": ["w", "prefill", "e", 1, [["Nope", [1]]]]}),
    msgpack.packb({"t": "kv_events", "v": 1, "d": ["w", "prefill", "e", 1, []]}),  # pre-vLLM
])
def test_garbage_is_an_error_value_not_an_exception(payload):
    assert isinstance(decode(payload), WireError)


def test_oversized_payload_is_rejected_before_parsing():
    result = decode(b"\x00" * (MAX_MESSAGE_BYTES + 1))
    assert isinstance(result, WireError) and "exceeds" in result.reason
