"""A session's plain results as wire messages (``server/messages.py``): every field of the wire's result,
word and latency messages has its plain counterpart, and each maps over."""

from __future__ import annotations

import dataclasses

import pytest

from cosystream.frontend.results import Alternative, EventType, Latency, Response, Result, SpeechEvent, Word
from cosystream.server.messages import response_message
from cosystream.v1 import cosystream_pb2 as pb


@pytest.mark.parametrize(
    ("plain", "message"),
    [(Result, pb.StreamingResult), (Word, pb.WordInfo), (Latency, pb.Latency), (Alternative, pb.Alternative)],
)
def test_every_wire_field_has_a_plain_one(plain, message):
    assert {f.name for f in dataclasses.fields(plain)} == {f.name for f in message.DESCRIPTOR.fields}


def test_a_result_maps_field_for_field():
    words = [Word("call", 100, 300, 0.5), Word("me", 300, 400, 0.25)]
    result = Result(
        "call me",
        True,
        0.5,
        100,
        400,
        3,
        confidence=0.75,
        model="default",
        model_version="v2",
        final_pass="second_pass",
        words=words,
        alternatives=[Alternative("call me", 0.75, words[:1]), Alternative("tall me", 0.125)],
    )
    message = response_message(Response("s1", Latency(420, 1.5, 2.5, 3.5), result=result))
    assert not message.HasField("speech_event") and message.session_id == "s1"
    assert (message.latency.audio_processed_ms, message.latency.queue_ms) == (420, 1.5)
    assert (message.latency.compute_ms, message.latency.receive_to_send_ms) == (2.5, 3.5)
    (wire,) = message.results
    for field in ("transcript", "is_final", "stability", "start_ms", "end_ms", "utterance_index", "confidence"):
        assert getattr(wire, field) == getattr(result, field), field
    assert (wire.model, wire.model_version, wire.final_pass) == ("default", "v2", "second_pass")
    assert [(w.word, w.start_ms, w.end_ms, w.confidence) for w in wire.words] == [
        ("call", 100, 300, 0.5),
        ("me", 300, 400, 0.25),
    ]
    assert [(a.transcript, a.confidence, len(a.words)) for a in wire.alternatives] == [
        ("call me", 0.75, 1),
        ("tall me", 0.125, 0),
    ]


def test_a_speech_event_maps_with_the_wire_enum():
    for kind, wire in ((EventType.SPEECH_STARTED, pb.SpeechEvent.SPEECH_STARTED), (EventType.SPEECH_ENDED, 2)):
        message = response_message(Response("s1", Latency(), event=SpeechEvent(kind, 1230)))
        assert not message.results and message.HasField("speech_event")
        assert (message.speech_event.type, message.speech_event.offset_ms) == (wire, 1230)
