import msgpack
import pytest

from evenflow.proto.messages import (
    MAX_MESSAGE_BYTES,
    Cancel,
    DecodeError,
    KVBlockChunk,
    PrefillRequest,
    SamplingSpec,
    TokenDelta,
    TokenDeltas,
    WorkerHeartbeat,
    decode,
    encode,
)


def test_round_trip_keeps_every_field():
    msgs = [
        PrefillRequest("r1", [1, 2, 3], SamplingSpec(temperature=0.5, seed=3, stop_token_ids=[7]),
                       "evenflow.gateway.g", "d0", 12.5),
        KVBlockChunk("r1", 0, 0, 2, b"\x00\x01" * 100),
        TokenDeltas("w", [TokenDelta("r1", [5], None, 3, 0), TokenDelta("r2", [], "stop", 4, 2)]),
        Cancel("r1"),
        WorkerHeartbeat("d0", "decode", "m", 3, 0, 10, 20, 0, 1.5, "e", 7, 0.25,
                        {"evenflow.gateway.a": 2, "evenflow.gateway.b": 1}),
    ]
    for m in msgs:
        assert decode(encode(m)) == m


@pytest.mark.parametrize("payload", [
    b"", b"\xc1garbage", msgpack.packb([1, 2]), msgpack.packb({"t": "nope", "v": 1, "d": []}),
    msgpack.packb({"t": "cancel", "v": 99, "d": ["r"]}),
    msgpack.packb({"t": "cancel", "v": 1, "d": [5]}),
    msgpack.packb({"t": "cancel", "v": 1, "d": ["a", "b"]}),
    msgpack.packb({"t": "prefill_request", "v": 1, "d": ["r", ["x"], [], "s", "d", 1.0]}),
    msgpack.packb({"t": "heartbeat", "v": 2,
                   "d": ["d0", "decode", "m", 3, 0, 10, 20, 0, 1.5, "e", 7, 0.25, {"g": "x"}]}),
])
def test_garbage_is_an_error_value_not_an_exception(payload):
    assert isinstance(decode(payload), DecodeError)


def test_oversized_payload_is_rejected_before_parsing():
    assert "exceeds" in decode(b"\x00" * (MAX_MESSAGE_BYTES + 1)).reason
