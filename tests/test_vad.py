"""Vad on real webrtcvad, FrameRing, EndpointingConfig checks and the Endpointer contract."""

from __future__ import annotations

import shutil
import subprocess
import wave
from pathlib import Path

import numpy as np
import pytest

from cosystream.audio.codecs import AudioEncoding, PcmDecoder
from cosystream.audio.endpointing import Decision, Endpointer, EndpointingConfig, EndReason
from cosystream.audio.framing import Framer, FrameRing
from cosystream.audio.resample import Resampler
from cosystream.audio.vad import Vad
from cosystream.frames import FRAME_SAMPLES

# 20 pre-roll frames, 3 frames to start, 50 frames of silence to end, 100 frames max.
CFG = EndpointingConfig(silence_ms=500, max_utterance_ms=1000, preroll_ms=200, speech_start_ms=30)


def _feed(ep: Endpointer, pattern: list[tuple[bool, int]]) -> list[Decision]:
    return [ep.feed(speech) for speech, count in pattern for _ in range(count)]


def _events(decisions: list[Decision]) -> list[tuple]:
    out = []
    for d in decisions:
        if d.started:
            out.append(("start", d.frame_index, d.start_frame, d.forward_frames))
        if d.ended:
            out.append(("end", d.frame_index, d.end_frame, str(d.end_reason)))
    return out


# --- Vad -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def speech_16k(tmp_path_factory: pytest.TempPathFactory) -> np.ndarray:
    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng is not installed (apt-get install espeak-ng) so there is no speech to test on")
    path = Path(tmp_path_factory.mktemp("tts")) / "speech.wav"
    subprocess.run(
        ["espeak-ng", "-w", str(path), "the quick brown fox jumps over the lazy dog"], check=True, timeout=30
    )
    with wave.open(str(path)) as w:
        assert w.getnchannels() == 1 and w.getsampwidth() == 2
        rate_hz, data = w.getframerate(), w.readframes(w.getnframes())
    resampler = Resampler(rate_hz)
    x = PcmDecoder(AudioEncoding.LINEAR16).decode(data)
    return np.concatenate([resampler.process(x), resampler.flush()])


def test_silence_is_never_speech() -> None:
    for aggressiveness in range(4):
        vad = Vad(aggressiveness)
        assert not any(vad.is_speech(np.zeros(FRAME_SAMPLES, dtype=np.float32)) for _ in range(200))


def test_vad_finds_speech_in_tts(speech_16k: np.ndarray) -> None:
    frames = Framer().push(speech_16k)
    vad = Vad(2)
    flags = [vad.is_speech(f) for f in frames]
    assert sum(flags) > 0.3 * len(flags), f"{sum(flags)} of {len(flags)} frames marked speech"


def test_vad_input_checks() -> None:
    vad = Vad()
    with pytest.raises(ValueError, match="shape"):
        vad.is_speech(np.zeros(320, dtype=np.float32))
    with pytest.raises(ValueError):
        Vad(4)
    # Full-scale and clipped input convert without overflow.
    assert isinstance(vad.is_speech(np.full(FRAME_SAMPLES, 3.0, dtype=np.float32)), bool)


def test_decoded_pcm_and_g711_reach_webrtcvad_as_the_same_bytes_without_the_clip(speech_16k: np.ndarray) -> None:
    # int16_levels skips the clip: for every int16 level (full scale both ways included), for G.711's, and
    # for speech, the bytes webrtcvad reads and its decisions equal the clipping path's.
    levels = np.arange(-32768, 32768, dtype=np.int32).astype("<i2").tobytes()
    decoded = [PcmDecoder(AudioEncoding.LINEAR16).decode(levels)]
    decoded += [PcmDecoder(e).decode(bytes(range(256)) * 5) for e in (AudioEncoding.MULAW, AudioEncoding.ALAW)]
    whole = len(speech_16k) // FRAME_SAMPLES * FRAME_SAMPLES
    pcm = np.round(speech_16k[:whole] * 32767).astype("<i2").tobytes()
    decoded.append(PcmDecoder(AudioEncoding.LINEAR16).decode(pcm))
    for aggressiveness in (0, 3):
        clipping, direct = Vad(aggressiveness), Vad(aggressiveness, int16_levels=True)
        for samples in decoded:
            for frame in Framer().push(samples):
                assert clipping.is_speech(frame) == direct.is_speech(frame)
                assert clipping._pcm_bytes == direct._pcm_bytes
    assert np.array_equal(np.frombuffer(direct._pcm_bytes, "<i2"), np.frombuffer(pcm, "<i2")[-FRAME_SAMPLES:])


def test_pipeline_finds_one_utterance_in_padded_tts(speech_16k: np.ndarray) -> None:
    """Decode -> resample -> frame -> VAD -> endpointing over 1 s silence, speech, 1 s silence."""
    silence = np.zeros(16000, dtype=np.float32)
    audio = np.concatenate([silence, speech_16k, silence])
    pcm = (audio * 32767).astype("<i2").tobytes()
    decoder, resampler, framer = PcmDecoder(AudioEncoding.LINEAR16), Resampler(16000), Framer()
    vad, ep = Vad(2), Endpointer(EndpointingConfig())
    ring = FrameRing(ep.max_forward_frames)
    forwarded: list[np.ndarray] = []
    decisions = []
    for i in range(0, len(pcm), 333):  # odd chunk size: samples split across chunks
        for frame in framer.push(resampler.process(decoder.decode(pcm[i : i + 333]))):
            ring.push(frame)
            d = ep.feed(vad.is_speech(frame))
            decisions.append(d)
            if d.forward_frames:
                forwarded.append(ring.last(d.forward_frames))
    decisions.append(ep.finalize())
    events = _events(decisions)
    starts = [e for e in events if e[0] == "start"]
    ends = [e for e in events if e[0] == "end"]
    assert len(starts) >= 1 and len(ends) == len(starts)
    assert 900 <= starts[0][2] * 10 <= 1300  # speech begins about 1 s in
    assert ends[-1][3] == "silence"
    # Everything forwarded is real audio, in order, and the leading silence was dropped.
    sent = np.concatenate(forwarded)
    assert len(sent) < len(decisions) - 50
    first = decisions[[d.started for d in decisions].index(True)].first_forward_frame
    assert np.array_equal(sent[0], audio[first * 160 : (first + 1) * 160])


# --- FrameRing -------------------------------------------------------------------------


def test_frame_ring_returns_last_frames_in_order() -> None:
    ring = FrameRing(4)
    for i in range(7):
        ring.push(np.full(FRAME_SAMPLES, i, dtype=np.float32))
    assert len(ring) == 4
    assert ring.last(3)[:, 0].tolist() == [4, 5, 6]
    assert ring.last(4)[:, 0].tolist() == [3, 4, 5, 6]
    assert ring.last(1)[:, 0].tolist() == [6]
    assert ring.last(0).shape == (0, FRAME_SAMPLES)
    taken = ring.last(2)
    ring.push(np.zeros(FRAME_SAMPLES, dtype=np.float32))
    assert taken[:, 0].tolist() == [5, 6]  # a copy, not a view of the ring
    with pytest.raises(ValueError):
        ring.last(5)
    ring.clear()
    with pytest.raises(ValueError):
        ring.last(1)


# --- EndpointingConfig -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"silence_ms": 505}, "multiple of 10"),
        ({"silence_ms": 0}, "between"),
        ({"max_utterance_ms": 500}, "between"),
        ({"preroll_ms": -10}, "between"),
        ({"speech_start_ms": 0}, "between"),
        ({"max_utterance_ms": 1000, "preroll_ms": 1000}, "must exceed"),
        ({"vad_aggressiveness": 4}, "0, 1, 2 or 3"),
    ],
)
def test_config_rejects_bad_values(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EndpointingConfig(**kwargs)


def test_default_config_is_valid() -> None:
    cfg = EndpointingConfig()
    assert (cfg.silence_ms, cfg.max_utterance_ms, cfg.preroll_ms, cfg.speech_start_ms) == (500, 15000, 200, 30)
    assert Endpointer(cfg).max_forward_frames == 23


# --- Endpointer ------------------------------------------------------------------------


def test_onset_forwards_preroll_and_speech_run() -> None:
    decisions = _feed(Endpointer(CFG), [(False, 30), (True, 5)])
    assert all(d.forward_frames == 0 for d in decisions[:32])
    onset = decisions[32]
    assert onset.started and onset.start_frame == 30 and onset.start_ms == 300
    assert onset.forward_frames == 23 and onset.first_forward_frame == 10
    assert [d.forward_frames for d in decisions[33:]] == [1, 1]


def test_preroll_is_clipped_at_stream_start() -> None:
    onset = _feed(Endpointer(CFG), [(False, 5), (True, 3)])[-1]
    assert onset.started and onset.start_frame == 5 and onset.first_forward_frame == 0
    assert onset.forward_frames == 8


def test_hangover_is_forwarded_then_silence_ends() -> None:
    decisions = _feed(Endpointer(CFG), [(False, 30), (True, 30), (False, 80)])
    assert _events(decisions) == [("start", 32, 30, 23), ("end", 109, 60, "silence")]
    assert all(d.forward_frames == 1 for d in decisions[33:110])  # speech + 50 frames hangover
    assert all(d.forward_frames == 0 for d in decisions[110:])
    assert decisions[109].end_ms == 600 and decisions[109].end_reason is EndReason.SILENCE


def test_speech_in_hangover_keeps_utterance_open() -> None:
    cfg = EndpointingConfig(silence_ms=500, max_utterance_ms=5000, preroll_ms=200, speech_start_ms=30)
    decisions = _feed(Endpointer(cfg), [(True, 10), (False, 40), (True, 1), (False, 49), (True, 10), (False, 50)])
    assert _events(decisions) == [("start", 2, 0, 3), ("end", 159, 110, "silence")]


def test_clicks_do_not_start_utterances() -> None:
    ep = Endpointer(CFG)
    decisions = _feed(ep, [(False, 10), (True, 1), (False, 10), (True, 2), (False, 10)])
    assert _events(decisions) == [] and not ep.in_utterance
    assert sum(d.forward_frames for d in decisions) == 0
    # With speech_start_ms at one frame, the same click does start one.
    one_frame = EndpointingConfig(silence_ms=500, max_utterance_ms=1000, preroll_ms=200, speech_start_ms=10)
    assert _events(_feed(Endpointer(one_frame), [(False, 10), (True, 1)])) == [("start", 10, 10, 11)]


def test_max_length_forces_end_and_speech_continues_without_preroll() -> None:
    decisions = _feed(Endpointer(CFG), [(False, 30), (True, 300), (False, 60)])
    # First utterance forwards frames 10..109 (pre-roll included): exactly 100 = max_utterance_ms.
    assert _events(decisions) == [
        ("start", 32, 30, 23),
        ("end", 109, 110, "max_length"),
        ("start", 110, 110, 1),
        ("end", 209, 210, "max_length"),
        ("start", 210, 210, 1),
        ("end", 309, 310, "max_length"),
        ("start", 310, 310, 1),
        ("end", 379, 330, "silence"),
    ]
    forwarded = [f for d in decisions for f in range(d.first_forward_frame, d.frame_index + 1)]
    assert forwarded == list(range(10, 380))  # every frame once, none twice


def test_max_length_during_hangover_then_new_onset_uses_no_forwarded_preroll() -> None:
    decisions = _feed(Endpointer(CFG), [(True, 60), (False, 45), (True, 3)])
    events = _events(decisions)
    assert events[:2] == [("start", 2, 0, 3), ("end", 99, 60, "max_length")]
    # Silence 60..104, speech run 105..107: pre-roll reaches back only to frame 100.
    assert events[2] == ("start", 107, 105, 8)
    assert decisions[107].first_forward_frame == 100


def test_finalize() -> None:
    ep = Endpointer(CFG)
    assert not ep.finalize().ended  # nothing open
    _feed(ep, [(False, 5), (True, 10)])
    d = ep.finalize()
    assert d.ended and d.end_reason == "finalize" and d.end_frame == 15 and d.forward_frames == 0
    assert not ep.finalize().ended  # ends exactly once
    # Speech continuing after a mid-speech finalize starts the next utterance at once.
    nxt = ep.feed(True)
    assert nxt.started and nxt.start_frame == 15 and nxt.forward_frames == 1
    # In the hangover, the end is one past the last speech frame.
    _feed(ep, [(False, 10)])
    d = ep.finalize()
    assert d.ended and d.end_frame == 16 and d.frame_index == 25
    # A speech run too short to start an utterance is dropped at finalize.
    _feed(ep, [(True, 2)])
    assert not ep.finalize().ended


def test_contract_holds_on_random_streams() -> None:
    rng = np.random.default_rng(3)
    for trial in range(20):
        cfg = EndpointingConfig(
            silence_ms=int(rng.integers(1, 30)) * 10,
            max_utterance_ms=int(rng.integers(100, 300)) * 10,
            preroll_ms=int(rng.integers(0, 30)) * 10,
            speech_start_ms=int(rng.integers(1, 6)) * 10,
        )
        ep = Endpointer(cfg)
        speech, open_utt, next_frame, utt_frames = False, False, 0, 0
        starts = ends = 0
        for _ in range(3000):
            if rng.random() < (0.05 if speech else 0.03):
                speech = not speech
            ds = [ep.feed(speech)]
            if rng.random() < 0.003:
                ds.append(ep.finalize())
            for d in ds:
                if d.started:
                    assert not open_utt, f"trial {trial}: start while open"
                    open_utt, utt_frames, starts = True, 0, starts + 1
                if d.forward_frames:
                    assert open_utt, "forwarded a frame outside an utterance"
                    assert d.first_forward_frame >= next_frame, "a frame was forwarded twice"
                    assert d.forward_frames <= ep.max_forward_frames
                    next_frame = d.frame_index + 1
                    utt_frames += d.forward_frames
                    assert utt_frames <= cfg.max_utterance_ms // 10
                if d.ended:
                    assert open_utt, "ended an utterance that was not open"
                    assert d.end_frame > 0
                    open_utt, ends = False, ends + 1
        if open_utt:
            assert ep.finalize().ended
            ends += 1
        assert starts == ends > 0
