"""``Session`` on its own: a fake engine that answers when the test says so, a fake clock, real webrtcvad,
no gRPC (its plain results) and no espeak-ng. Pins the event contract and the session's limits."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from cosystream.audio.codecs import AudioEncoding
from cosystream.audio.endpointing import EndpointingConfig
from cosystream.decoding.greedy import CtcDecoder
from cosystream.engine.headroom import THIN_INTERIM_MS
from cosystream.frames import FRAME_SAMPLES
from cosystream.frontend.results import EventType, Response, Result
from cosystream.frontend.session import END_CONTEXT_FRAMES, Session, SessionConfig
from cosystream.priority import Priority
from tests.conftest import speech_like

VOCABULARY = ["_", " ", "a", "b"]


class FakeEngine:
    """Records what the session sends; ``answer()`` returns results for every frame in flight, in order."""

    def __init__(self) -> None:
        self.sent: list[np.ndarray] = []  # runs of frames not yet answered
        self.frames_sent = 0
        self.silence_frames = 0
        self.resets = 0
        self.log: list[str] = []  # "frames N" / "end IN_FLIGHT" / "reset" in order
        self.session: Session | None = None

    def send_frames(self, key: int, frames: np.ndarray) -> None:
        self.sent.append(frames)
        self.frames_sent += len(frames)
        self.silence_frames += int(sum(not frame.any() for frame in frames))
        self.log.append(f"frames {len(frames)}")

    def end_utterance(self, key: int) -> None:
        self.log.append(f"end {self.in_flight}")

    def reset(self, key: int) -> None:
        self.resets += 1
        self.log.append("reset")

    @property
    def in_flight(self) -> int:
        return sum(len(run) for run in self.sent)

    def answer(self) -> None:
        while self.sent:
            run = self.sent.pop(0)
            ids = np.where(np.arange(len(run)) % 3 == 0, 2, 0).astype(np.int32)[:, None]  # "a", blanks
            self.session.on_results(ids, np.full(ids.shape, -0.1, np.float32), 0.001, 0.002)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make_session(**kwargs) -> tuple[Session, FakeEngine, list[Response]]:
    engine, emitted = FakeEngine(), []
    config = SessionConfig(
        encoding=AudioEncoding.LINEAR16,
        sample_rate_hz=16000,
        priority=Priority.REALTIME,
        interim_results=kwargs.pop("interim_results", True),
        endpointing=EndpointingConfig(),
        word_time_offsets=True,
    )
    session = Session(1, "s", config, CtcDecoder(VOCABULARY), engine, emitted.append, clock=Clock(), **kwargs)
    engine.session = session
    return session, engine, emitted


def pcm(audio: np.ndarray) -> bytes:
    return (np.clip(audio, -1, 1 - 1 / 32768) * 32768).astype("<i2").tobytes()


def talk() -> np.ndarray:
    """0.5 s of silence, 1.5 s of speech-like audio, 1 s of silence."""
    return np.concatenate([np.zeros(8000, np.float32), speech_like(1.5, seed=3), np.zeros(16000, np.float32)])


def feed(session: Session, engine: FakeEngine, audio: np.ndarray, answer: bool = True, chunk: int = 160) -> None:
    data = pcm(audio)
    for offset in range(0, len(data), chunk * 2):
        session.clock.now += chunk / 16000
        session.feed_audio(data[offset : offset + chunk * 2], session.clock.now)
        if answer:
            engine.answer()


def kinds(emitted: list[Response]) -> list[str]:
    out = []
    for response in emitted:
        if response.event is not None:
            out.append("started" if response.event.type == EventType.SPEECH_STARTED else "ended")
        if response.result is not None:
            out.append("final" if response.result.is_final else "interim")
    return out


def test_one_utterance_follows_the_event_contract():
    session, engine, emitted = make_session()
    feed(session, engine, talk())
    events = kinds(emitted)
    assert events[0] == "started" and events[-2:] == ["ended", "final"], events
    assert set(events[1:-2]) <= {"interim"} and "interim" in events
    final = emitted[-1].result
    assert final.transcript and final.utterance_index == 0 and final.start_ms >= 400
    assert engine.log[-1] == "reset" and engine.resets == 1  # the model state is reset after the final
    assert session.done
    assert all(r.session_id == "s" for r in emitted)


class TalkingEngine(FakeEngine):
    """Answers "a", blank, blank, ... over the stream's frames (not each run's), so the text grows as it goes."""

    frames = 0

    def answer(self) -> None:
        while self.sent:
            count = len(self.sent.pop(0))
            index = np.arange(self.frames, self.frames + count)
            self.frames += count
            ids = np.where(index % 3 == 0, 2, 0).astype(np.int32)[:, None]
            self.session.on_results(ids, np.full(ids.shape, -0.1, np.float32), 0.001, 0.002)


def test_thinned_interims_come_at_most_every_500_ms_of_audio_and_the_final_is_the_same():
    def results(thin: bool) -> list[Result]:
        session, _, emitted = make_session()
        engine = session.engine = TalkingEngine()
        engine.session = session
        session.thin_interims = thin  # (the engine sheds interims under load: engine/headroom.py)
        feed(session, engine, talk())
        return [response.result for response in emitted if response.result is not None]

    full, thinned = results(False), results(True)
    interims = [r.end_ms for r in thinned if not r.is_final]
    assert 1 <= len(interims) < len([r for r in full if not r.is_final]) / 4, (interims, len(full))
    assert all(b - a >= THIN_INTERIM_MS for a, b in itertools.pairwise(interims)), interims
    assert interims[0] - thinned[-1].start_ms >= THIN_INTERIM_MS - 300  # (the pre-roll counts as audio)
    assert [(r.transcript, r.end_ms) for r in thinned if r.is_final] == [
        (r.transcript, r.end_ms) for r in full if r.is_final
    ]


def test_the_final_waits_for_the_results_of_every_frame_sent():
    session, engine, emitted = make_session(max_in_flight_frames=1000)
    feed(session, engine, talk(), answer=False)
    assert "ended" in kinds(emitted) and "final" not in kinds(emitted)
    assert engine.in_flight > 0 and not session.done
    engine.answer()
    assert kinds(emitted)[-1] == "final" and session.done


def test_no_frame_is_sent_before_speech_started_and_silence_costs_nothing():
    session, engine, emitted = make_session()
    feed(session, engine, np.zeros(16000 * 3, np.float32))
    assert engine.frames_sent == 0 and emitted == []


def test_frames_in_flight_never_exceed_the_limit():
    session, engine, emitted = make_session(max_in_flight_frames=8)
    data = pcm(talk())
    peak = 0
    for offset in range(0, len(data), 3200):  # 100 ms chunks, answered only every other chunk
        session.feed_audio(data[offset : offset + 3200], 0.0)
        peak = max(peak, engine.in_flight)
        if offset // 3200 % 2:
            engine.answer()
    for _ in range(10):
        engine.answer()
    session.finish()
    engine.answer()
    assert peak <= 8
    assert kinds(emitted)[-1] == "final"


def test_half_close_mid_utterance_pads_the_end_and_flushes_the_final():
    session, engine, emitted = make_session()
    feed(session, engine, np.concatenate([np.zeros(8000, np.float32), speech_like(1.0, seed=4)]))
    assert "final" not in kinds(emitted)
    session.finish()
    engine.answer()
    assert kinds(emitted)[-2:] == ["ended", "final"]
    assert engine.silence_frames >= END_CONTEXT_FRAMES  # the model gets context after the last word


def test_finalize_marks_the_end_after_its_silence_so_the_engine_steps_it_at_once():
    """FINALIZE mid-utterance: the end-of-utterance silence goes out, then END with every frame of the
    utterance still in flight (the frames the final waits for), then, once they are answered, the final
    and RESET. An utterance the endpointer ends is marked too, with what it has in flight."""
    session, engine, emitted = make_session(max_in_flight_frames=1000)
    feed(session, engine, np.concatenate([np.zeros(8000, np.float32), speech_like(1.0, seed=4)]), answer=False)
    in_flight, silence = engine.in_flight, engine.silence_frames
    session.finalize()
    pad = engine.silence_frames - silence
    assert pad > 0 and engine.log[-2:] == [f"frames {pad}", f"end {in_flight + pad}"]
    assert "final" not in kinds(emitted)
    engine.answer()
    assert kinds(emitted)[-2:] == ["ended", "final"] and engine.log[-1] == "reset"
    feed(session, engine, talk())  # answered chunk by chunk: the endpointer's end leaves one frame to step
    assert [entry for entry in engine.log if entry.startswith("end")] == [f"end {in_flight + pad}", "end 1"]


@pytest.mark.parametrize("chunk_ms", [10, 20])
def test_finalize_after_every_chunk_costs_at_most_twice_the_audio(chunk_ms):
    session, engine, emitted = make_session()
    data = pcm(speech_like(3.0, seed=5))  # (no leading silence: every all-zero frame sent is padding)
    chunk = 16 * chunk_ms * 2
    for offset in range(0, len(data), chunk):
        session.feed_audio(data[offset : offset + chunk], 0.0)
        session.finalize()
        engine.answer()
    audio_frames = engine.frames_sent - engine.silence_frames
    assert engine.silence_frames <= audio_frames, (engine.silence_frames, audio_frames)
    assert kinds(emitted).count("final") == kinds(emitted).count("started") > 10


def test_every_frame_goes_to_the_engine_at_most_once():
    session, engine, emitted = make_session()
    audio = np.concatenate([speech_like(1.0, seed=6), np.zeros(3200, np.float32), speech_like(1.0, seed=7)])
    feed(session, engine, np.concatenate([np.zeros(8000, np.float32), audio, np.zeros(16000, np.float32)]))
    session.finish()
    engine.answer()
    audio_frames = engine.frames_sent - engine.silence_frames
    assert audio_frames <= len(audio) // FRAME_SAMPLES + 50 + 20  # speech, pre-roll, hangover
    finals = [r.result for r in emitted if r.result is not None and r.result.is_final]
    assert [f.utterance_index for f in finals] == list(range(len(finals)))


class HeldSecondPass:
    """Stands in for the frontend's worker queue: keeps each job until the test answers it."""

    def __init__(self) -> None:
        self.jobs: list = []
        self.given_up: list = []  # the jobs whose finals went without them

    def submit(self, key, index, audio, realtime, on_done, word_times=False, hotwords=""):
        self.jobs.append((index, on_done))
        return f"job {index}"

    def cancel(self, key) -> None:
        self.jobs.clear()

    def give_up(self, job) -> None:
        self.given_up.append(job)


def test_a_final_held_for_the_second_pass_holds_back_the_responses_not_the_stream():
    from cosystream.frontend.final_pass import FinalPass
    from cosystream.secondpass.whisper import SecondPassResult

    second = HeldSecondPass()
    final_pass = FinalPass(
        second, key=1, realtime=True, max_frames=6000, on_answer=lambda: session.resume(), holds_next=True
    )
    session, engine, emitted = make_session(final_pass=final_pass)
    feed(session, engine, talk())
    assert kinds(emitted)[-1] == "ended" and [index for index, _ in second.jobs] == [0]  # the final is held
    sent_before = engine.frames_sent
    feed(session, engine, talk())  # the next utterance, while the first final waits
    assert engine.frames_sent > sent_before + 100  # its frames went to the engine and were decoded...
    assert kinds(emitted)[-1] == "ended" and not session.done  # ...and its responses wait behind the final
    assert [index for index, _ in second.jobs] == [0, 1]
    second.jobs[1][1](SecondPassResult("two", no_speech_prob=0.0, avg_logprob=-0.1))
    assert kinds(emitted)[-1] == "ended"  # (the second's answer cannot pass the first final)
    second.jobs[0][1](SecondPassResult("one", no_speech_prob=0.0, avg_logprob=-0.1))
    events = kinds(emitted)
    assert events.count("final") == 2 and events[-1] == "final" and session.done
    finals = [r.result for r in emitted if r.result is not None and r.result.is_final]
    assert [(f.utterance_index, f.transcript, f.final_pass) for f in finals] == [
        (0, "one", "second_pass"),
        (1, "two", "second_pass"),
    ]
    second_started = next(i for i, e in enumerate(events) if e == "started" and i > events.index("final"))
    assert events.index("final") < second_started  # the contract's order: final 0, then utterance 1's events


@pytest.mark.parametrize("realtime", [True, False])
def test_the_next_utterances_interims_never_wait_for_a_held_final_of_a_realtime_stream(realtime):
    from cosystream.frontend.final_pass import FinalPass

    second = HeldSecondPass()
    final_pass = FinalPass(second, key=1, realtime=realtime, max_frames=6000, on_answer=lambda: session.resume())
    session, engine, emitted = make_session(final_pass=final_pass)
    feed(session, engine, talk())
    assert kinds(emitted)[-1] == "ended" and [index for index, _ in second.jobs] == [0]  # the final is held
    feed(session, engine, talk())  # the next utterance, while the first final waits
    events = kinds(emitted)
    if not realtime:  # a BATCH stream's finals wait for the second pass whatever comes after them
        assert events[-1] == "ended" and second.given_up == []
        return
    # its first interim gave up the held final: sent with the streaming text, then the next utterance's events
    assert second.given_up == ["job 0"] and events.count("final") == 1 and events[-1] == "ended"
    first = next(r.result for r in emitted if r.result is not None and r.result.is_final)
    assert first.utterance_index == 0 and first.final_pass == "streaming" and first.transcript
    assert events.index("final") < [i for i, e in enumerate(events) if e == "started"][1]  # (the contract's order)
    assert "interim" in events[events.index("final") :]
    assert [index for index, _ in second.jobs] == [0, 1]  # the second final waits for its own answer
    second.jobs[1][1](answer("two"))
    assert kinds(emitted)[-1] == "final" and emitted[-1].result.transcript == "two" and session.done


class EarlySecondPass(HeldSecondPass):
    """A worker queue that takes early reads while ``idle``, each read estimated to take ``read_s``."""

    def __init__(self, idle: bool = True, read_s: float = 0.2) -> None:
        super().__init__()
        self.idle, self.read_s = idle, read_s
        self.early: list = []  # (index, samples, on_done) of each early read taken
        self.ended: list[bool] = []  # early reads kept (True) or dropped, in order

    def predict_s(self, audio_s: float) -> float:
        return self.read_s

    def submit(self, key, index, audio, realtime, on_done, word_times=False, hotwords="", early=False):
        if not early:
            return super().submit(key, index, audio, realtime, on_done)
        if not self.idle:
            return None
        self.early.append((index, len(audio), on_done))
        return len(self.early)  # (the job, for early_ended)

    def early_ended(self, job, kept: bool) -> None:
        self.ended.append(kept)


def early_session(second: EarlySecondPass):
    from cosystream.frontend.final_pass import FinalPass

    final_pass = FinalPass(
        second, key=1, realtime=True, max_frames=6000, on_answer=lambda: session.resume(), early_ms=150
    )
    session, engine, emitted = make_session(final_pass=final_pass)
    return session, engine, emitted


def answer(text: str):
    from cosystream.secondpass.whisper import SecondPassResult

    return SecondPassResult(text, no_speech_prob=0.0, avg_logprob=-0.1)


def test_an_utterance_read_early_at_its_pause_has_its_final_at_the_endpoint():
    second = EarlySecondPass(read_s=0.2)  # 500 ms to the endpoint, less 200 ms to read, less 50: read at 250
    session, engine, emitted = early_session(second)
    audio = talk()  # 0.5 s silence, 1.5 s of speech, 1 s of silence
    feed(session, engine, audio[: 16000 * 2 + 16000 * 3 // 10])  # 300 ms into the pause
    assert kinds(emitted)[-1] != "ended" and len(second.early) == 1 and second.jobs == []
    index, samples, on_done = second.early[0]
    assert index == 0 and 16000 * 3 // 2 < samples < 16000 * 2  # the speech and the pause so far
    on_done(answer("one"))  # read while the endpoint's silence runs
    feed(session, engine, audio[16000 * 2 + 16000 * 3 // 10 :])
    events = kinds(emitted)
    assert events[-2:] == ["ended", "final"] and session.done  # sent at the endpoint, not held
    final = emitted[-1].result
    assert (final.transcript, final.final_pass) == ("one", "second_pass")
    assert second.jobs == [] and second.ended == [True]  # no second read at the end


def test_a_final_whose_early_read_is_still_running_waits_for_it_and_no_longer():
    second = EarlySecondPass(read_s=0.2)
    session, engine, emitted = early_session(second)
    feed(session, engine, talk())
    assert kinds(emitted)[-1] == "ended" and len(second.early) == 1 and second.jobs == []
    assert second.ended == [True] and not session.done  # held for the early read
    second.early[0][2](answer("one"))
    assert kinds(emitted)[-1] == "final" and emitted[-1].result.transcript == "one" and session.done


def test_speech_after_the_pause_drops_the_early_read_and_the_whole_utterance_is_read():
    second = EarlySecondPass(read_s=0.2)
    session, engine, emitted = early_session(second)
    pause = np.zeros(16000 * 4 // 10, np.float32)  # 400 ms: under the endpoint's 500, over the early read's 250
    first, then = speech_like(1.0, seed=3), speech_like(1.0, seed=4)
    feed(session, engine, np.concatenate([pause, first, pause, then]))
    assert kinds(emitted).count("started") == 1  # one utterance: the pause did not end it
    assert len(second.early) == 1 and second.ended == [False]  # read at the pause, dropped at the speech
    second.idle = False  # (the worker busy: no early read at the end's pause)
    feed(session, engine, np.zeros(16000, np.float32))
    assert kinds(emitted)[-1] == "ended" and len(second.early) == 1 and len(second.jobs) == 1
    second.jobs[0][1](answer("one two"))
    assert kinds(emitted)[-1] == "final" and emitted[-1].result.transcript == "one two" and session.done


def test_early_reads_are_off_at_zero_and_when_the_read_would_not_end_before_the_endpoint():
    from cosystream.frontend.final_pass import FinalPass

    second = EarlySecondPass(read_s=0.2)
    off = FinalPass(second, key=1, realtime=True, max_frames=6000, on_answer=lambda: None, early_ms=0)
    assert off.early_after_frames(200, 50) is None
    on = FinalPass(second, key=1, realtime=True, max_frames=6000, on_answer=lambda: None, early_ms=150)
    assert on.early_after_frames(200, 50) == 25  # 500 ms - 200 ms to read - 50 ms of slack
    second.read_s = 0.01
    assert on.early_after_frames(200, 50) == 44  # a quick read starts later: fewer reads a pause drops
    second.read_s = 2.0
    assert on.early_after_frames(200, 50) == 15  # never before early_ms: a pause between words is no end
