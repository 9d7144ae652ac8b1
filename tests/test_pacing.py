"""REALTIME speech is consumed no faster than real time plus a burst; silence and BATCH audio are not paced.

The bucket on its own with a fake clock; the session counting the speech it forwards, per encoding; then
over real gRPC on loopback: a REALTIME client sending as fast as it can is slowed (by flow control, not an
error, and every byte is transcribed), a BATCH client sending the same is not.
"""

from __future__ import annotations

import math
import time

import grpc
import numpy as np
import pytest

from cosystream.audio.codecs import AudioEncoding
from cosystream.audio.endpointing import EndpointingConfig
from cosystream.decoding.greedy import CtcDecoder
from cosystream.frontend.host import StreamOptions
from cosystream.frontend.session import REALTIME_BURST_S, AudioPacer, Session, SessionConfig
from cosystream.priority import Priority
from cosystream.v1 import cosystream_pb2 as pb
from cosystream.v1.client import encode_mulaw
from tests.conftest import speech_like
from tests.servers import local_server
from tests.test_session import Clock, FakeEngine


def test_bucket_lets_a_burst_through_then_paces_at_real_time():
    clock = Clock()
    pacer = AudioPacer(burst_s=2.0, clock=clock)
    assert pacer.consume(2.0) == 0.0  # the burst: at once
    assert pacer.consume(0.5) == pytest.approx(0.5)  # past it: wait for the clock
    clock.now += 0.5
    assert pacer.consume(0.1) == pytest.approx(0.1)
    clock.now += 0.1
    # A sender at real time from here on never waits.
    for _ in range(100):
        assert pacer.consume(0.02) == pytest.approx(0.02)
        clock.now += 0.02
    for _ in range(100):
        clock.now += 0.02
        assert pacer.consume(0.02) == pytest.approx(0.0, abs=1e-9)


def test_credit_never_exceeds_the_burst():
    clock = Clock()
    pacer = AudioPacer(burst_s=2.0, clock=clock)
    clock.now += 600.0  # ten minutes of silence earn no more than the burst
    assert pacer.consume(2.0) == 0.0
    assert pacer.consume(3.0) == pytest.approx(3.0)


def test_a_client_catching_up_after_a_hiccup_is_not_slowed():
    clock = Clock()
    pacer = AudioPacer(burst_s=2.0, clock=clock)
    for _ in range(50):  # 1 s at real time
        clock.now += 0.02
        assert pacer.consume(0.02) == 0.0
    clock.now += 1.5  # the network held 1.5 s of audio, which then comes at once
    assert pacer.consume(1.5) == 0.0


def test_an_infinite_burst_never_paces_and_a_negative_one_is_refused():
    pacer = AudioPacer(burst_s=math.inf, clock=Clock())
    assert pacer.consume(1e6) == 0.0
    with pytest.raises(ValueError, match="burst_s"):
        AudioPacer(burst_s=-1.0)
    with pytest.raises(ValueError, match="realtime_burst_s"):
        StreamOptions(realtime_burst_s=-1.0)


def _session(encoding: str, rate_hz: int, clock: Clock, pacer: AudioPacer | None) -> Session:
    config = SessionConfig(
        encoding=AudioEncoding[encoding],
        sample_rate_hz=rate_hz,
        priority=Priority.REALTIME,
        interim_results=False,
        endpointing=EndpointingConfig(),
        word_time_offsets=False,
    )
    engine = FakeEngine()
    session = Session(1, "s", config, CtcDecoder(["_", "a"]), engine, lambda r: None, clock=clock, pacer=pacer)
    engine.session = session
    return session


@pytest.mark.parametrize(("encoding", "rate_hz"), [("LINEAR16", 16000), ("MULAW", 8000)])
def test_session_paces_the_speech_it_forwards_in_seconds_of_its_encoding(encoding, rate_hz):
    clock = Clock()
    session = _session(encoding, rate_hz, clock, AudioPacer(2.0, clock))
    audio = speech_like(3.0, seed=5, rate_hz=rate_hz)
    data = encode_mulaw(audio) if encoding == "MULAW" else _linear16(audio)
    # 3 s of speech at once: the VAD forwards nearly all of it (with its pre-roll), 1 s past the burst.
    assert session.feed_audio(data, clock.now) == pytest.approx(1.0, abs=0.2)
    unpaced = _session(encoding, rate_hz, clock, None)
    assert unpaced.feed_audio(data * 3, clock.now) == 0.0


def test_silence_is_not_paced():
    """The engine never steps silence: a client may send it as fast as it likes."""
    clock = Clock()
    session = _session("LINEAR16", 16000, clock, AudioPacer(2.0, clock))
    assert session.feed_audio(bytes(32000 * 60), clock.now) == 0.0  # a minute of silence at once


def _linear16(audio: np.ndarray) -> bytes:
    return (np.clip(audio, -1, 1 - 1 / 32768) * 32768).astype("<i2").tobytes()


# --- over gRPC ---------------------------------------------------------------------------------------

AUDIO_S = 9.0


@pytest.fixture(scope="module")
def server():
    with local_server(max_sessions=4) as srv:
        yield srv


def _send_fast(stub, priority: int, chunk_bytes: int) -> tuple[float, list[pb.StreamingRecognizeResponse]]:
    """AUDIO_S of speech-like audio sent as fast as the stream takes it; (seconds to the last response,
    responses)."""
    data = _linear16(speech_like(AUDIO_S, seed=3))

    def requests():
        yield pb.StreamingRecognizeRequest(
            config=pb.StreamingConfig(encoding=pb.LINEAR16, sample_rate_hz=16000, priority=priority)
        )
        for offset in range(0, len(data), chunk_bytes):
            yield pb.StreamingRecognizeRequest(audio=data[offset : offset + chunk_bytes])

    started = time.monotonic()
    responses = list(stub.StreamingRecognize(requests(), timeout=120))
    return time.monotonic() - started, responses


def _audio_processed_ms(responses) -> int:
    return max(r.latency.audio_processed_ms for r in responses)


@pytest.mark.parametrize("chunk_bytes", [3200, 1 << 20], ids=["100ms-chunks", "one-message"])
def test_realtime_sender_is_paced_and_batch_is_not(stub, chunk_bytes):
    realtime_s, realtime = _send_fast(stub, pb.REALTIME, chunk_bytes)
    batch_s, batch = _send_fast(stub, pb.BATCH, chunk_bytes)
    # Nothing is an error, and both streams transcribed all of the audio.
    for responses in (realtime, batch):
        assert not any(r.HasField("error") for r in responses)
        assert any(res.is_final for r in responses for res in r.results)
        assert _audio_processed_ms(responses) >= (AUDIO_S - 0.05) * 1000
    # REALTIME: the audio past the burst was read at real time (bounds generous for a loaded machine).
    assert realtime_s >= AUDIO_S - REALTIME_BURST_S - 0.5, realtime_s
    assert realtime_s < AUDIO_S + 30
    # BATCH: as fast as the engine steps it (many times real time), well under the paced time.
    assert batch_s < AUDIO_S - REALTIME_BURST_S - 1.0, batch_s


def test_cancel_while_paced_frees_the_slot(stub):
    """A client that hangs up while its stream is held back by pacing leaves no slot behind."""
    data = _linear16(speech_like(AUDIO_S, seed=4))

    def requests():
        yield pb.StreamingRecognizeRequest(
            config=pb.StreamingConfig(encoding=pb.LINEAR16, sample_rate_hz=16000, priority=pb.REALTIME)
        )
        for offset in range(0, len(data), 3200):
            yield pb.StreamingRecognizeRequest(audio=data[offset : offset + 3200])

    call = stub.StreamingRecognize(requests(), timeout=2.0 + REALTIME_BURST_S)
    with pytest.raises(grpc.RpcError) as err:
        list(call)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    deadline = time.monotonic() + 10
    while stub.GetServerInfo(pb.GetServerInfoRequest()).active_sessions and time.monotonic() < deadline:
        time.sleep(0.05)
    assert stub.GetServerInfo(pb.GetServerInfoRequest()).active_sessions == 0
