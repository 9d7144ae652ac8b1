"""One stream's frontend work: audio bytes in, frames to the engine; per-frame token ids back, responses out.

Per chunk: decode -> resample to 16 kHz -> exact 10 ms frames -> webrtcvad -> endpointing. Speech frames
(with a short pre-roll) go to the engine; silence goes nowhere. Results come back as one CTC token id per
frame, which the decoder turns into text.

Everything a session emits or sends goes through one ordered queue of actions (START, FRAMES, END), so
the event contract holds by construction: an utterance's frames are sent only after its SPEECH_STARTED,
its final only after the results of all its frames, and the next utterance's SPEECH_STARTED and frames
only after that final and the engine-side reset of the model state.

With a second pass (``serve --final-model``, ``final_pass.py``) an utterance's final is held until the
second pass answers (or its deadline passes), which may replace the streaming text; ``final_pass`` says
which. The stream goes on meanwhile (the next utterance's frames go to the engine and are decoded), and the
responses that come after a held final wait behind it, so the client sees them in the contract's order; on a
REALTIME stream the next utterance's first interim sends the held final at once with the streaming text.
Once an utterance's speech is followed by some silence, it is read early (``final_pass.py``), so that at the
endpoint its final seldom waits at all.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from cosystream.audio.codecs import AudioEncoding
from cosystream.audio.endpointing import Decision, Endpointer, EndpointingConfig
from cosystream.audio.framing import Framer, FrameRing
from cosystream.audio.streams import open_stream_audio
from cosystream.audio.vad import Vad
from cosystream.decoding.beam import BeamCtcDecoder
from cosystream.decoding.greedy import CtcDecoder
from cosystream.engine.headroom import THIN_INTERIM_MS
from cosystream.frames import FRAME_MS, FRAME_SAMPLES
from cosystream.frontend.final_pass import STREAMING, FinalPass, Held
from cosystream.frontend.results import Alternative, EventType, Latency, Response, Result, SpeechEvent, Word
from cosystream.frontend.tracing import UtteranceTrace, UtteranceTracer
from cosystream.priority import Priority

log = logging.getLogger(__name__)

_THIN_INTERIM_FRAMES = THIN_INTERIM_MS // FRAME_MS


@dataclass(frozen=True, slots=True)
class SessionConfig:
    """A validated StreamingConfig."""

    encoding: AudioEncoding
    sample_rate_hz: int
    priority: Priority
    interim_results: bool
    endpointing: EndpointingConfig
    word_time_offsets: bool
    model: int = 0  # which of the engine's models (a position in EngineInfo.models when validated)
    second_pass: bool = False  # finals from the server's second pass (it runs one, and the stream did not opt out)
    punctuation: bool = False  # second-pass finals keep its capitals, punctuation and digits
    max_alternatives: int = 1  # finals carry up to this many n-best alternatives
    phrases: tuple = ()  # phrase boosting (decoding.phrases.Phrase), normalized
    vocabulary: str = ""  # a named vocabulary's (serve --vocabulary), boosted too
    hotwords: str = ""  # the phrases as sent, for the second pass's prompt
    boosting: object = None  # what the phrases made for the session's model (decoding.phrases.Boosting)
    resumable: bool = False  # held for the resume window when its connection drops (StreamingConfig.resumable)
    # Where a session resumed from another server's snapshot (frontend/snapshot.py) goes on: the frame its first
    # audio is in the stream's timeline, the next utterance's index, the responses already sent, and the input
    # samples of the resumed audio the snapshot's offset says to skip. All 0 for a new session.
    first_frame: int = 0
    first_utterance: int = 0
    first_response: int = 0
    skip_samples: int = 0
    wire: bytes = b""  # a resumable stream's StreamingConfig as sent (its resume fields cleared), for a snapshot


MAX_IN_FLIGHT_FRAMES = 128
"""Frames a session may have at the engine without their results (1.28 s of speech): past it, its audio waits
(and its reader with it) rather than queueing without bound at the engine."""

REALTIME_BURST_S = 2.0
"""Speech a REALTIME stream may send ahead of real time (``serve --realtime-burst-s``): a client catching up
after a network hiccup of up to this long is not slowed; past it, its requests are read no faster than
real time (see :class:`AudioPacer`)."""


class AudioPacer:
    """A token bucket over audio time: a REALTIME stream's speech is consumed at most at real time, plus
    ``burst_s`` seconds ahead.

    Why: a REALTIME session is stepped before everything else, so one client sending 19x real time took the
    engine's realtime capacity from every other tenant (288 deadline misses in 30 s; another stream's paced
    p95 18 -> 82 ms). Pacing is backpressure, not loss: the reader stops reading the stream's requests until
    the wall clock catches up, gRPC (or TCP) flow control then slows the sender, and every byte is still
    transcribed. ``burst_s = inf`` turns it off. What counts is the audio forwarded to the engine (speech
    and its pre-roll): silence costs the engine nothing and its frontend ~15 us per 10 ms, so a client may
    send it as fast as it likes (a Google client's 4 MB request of silence is not held for two minutes).
    """

    __slots__ = ("_clock", "_due_s", "burst_s")

    def __init__(self, burst_s: float = REALTIME_BURST_S, clock: Callable[[], float] = time.monotonic):
        if not burst_s >= 0:
            raise ValueError(f"burst_s must be >= 0 (inf: no pacing), got {burst_s}")
        self.burst_s = burst_s
        self._clock = clock
        self._due_s = -math.inf  # when the audio consumed so far is due at real time (a virtual clock)

    def consume(self, audio_s: float) -> float:
        """Count ``audio_s`` seconds of audio consumed now; returns how long to wait before consuming more
        (0 while the stream is within its burst of real time)."""
        now = self._clock()
        # Credit never exceeds the burst: a stream silent for a minute may not then send a minute at once.
        self._due_s = max(self._due_s, now - self.burst_s) + audio_s
        return max(0.0, self._due_s - now)


class EngineLink:
    """What a session needs from the engine channel (``frontend/engine_client.py`` implements it)."""

    def send_frames(self, key: int, frames: np.ndarray) -> None: ...

    def end_utterance(self, key: int) -> None: ...

    def reset(self, key: int) -> None: ...


_START, _FRAMES, _END, _EARLY = 0, 1, 2, 3

END_CONTEXT_FRAMES = 20
"""Audio a causal model needs after an utterance's last speech frame to emit its last word (measured: the
default model drops or garbles the last word of 2 in 3 espeak-ng sentences cut at their last sample, and of
none with 100 ms of silence after them). Utterances that end with less (FINALIZE, half-close, the length
limit) get the rest as silence, plus the model's output delay, within the session's padding budget: over
the whole stream, padding never exceeds the audio sent (a FINALIZE after every 10 ms chunk would otherwise
make the engine step ~20 frames of silence per frame of audio)."""


class _Utterance:
    __slots__ = (
        "end",
        "first_frame",
        "first_result_sent",
        "flushed",
        "index",
        "interim_at",
        "received",
        "sent",
        "start_frame",
        "started_s",
        "text_changed",
        "trace",
    )

    def __init__(self, index: int, start: Decision, started_s: float):
        self.index = index
        self.start_frame = start.start_frame
        self.first_frame = start.first_forward_frame
        self.started_s = started_s
        self.sent = 0
        self.received = 0
        self.end: Decision | None = None
        self.flushed = False  # the end-of-utterance silence sent (or not needed)
        self.first_result_sent = False
        self.text_changed = False
        self.interim_at = 0  # frames received when the last interim was sent
        self.trace: UtteranceTrace | None = None  # when traced (serve --otlp-endpoint, sampled)


class Session:
    """One stream. ``emit`` receives each response (``results.py``: a transport maps it to its messages);
    ``engine`` takes its frames and resets."""

    def __init__(
        self,
        key: int,
        session_id: str,
        config: SessionConfig,
        decoder: CtcDecoder | BeamCtcDecoder,
        engine: EngineLink,
        emit: Callable[[Response], None],
        max_in_flight_frames: int = MAX_IN_FLIGHT_FRAMES,
        on_first_result: Callable[[float], None] | None = None,
        on_result_latency: Callable[[float], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        output_delay_frames: int = 0,
        model_name: str = "",
        model_version: str = "",
        pacer: AudioPacer | None = None,
        final_pass: FinalPass | None = None,
        tracer: UtteranceTracer | None = None,
        trace_parent=None,
    ):
        """``pacer``: paces the speech of a REALTIME stream (``feed_audio`` says how long to wait); None: not
        paced (BATCH streams, which use only what REALTIME leaves). ``final_pass``: each final waits for the
        second pass (call :meth:`resume` when it answers); None: finals from the streaming model. ``tracer``:
        utterances are traced (``tracing.py``; ``trace_parent``: the client's trace, from its metadata)."""
        self.key = key
        self.session_id = session_id
        self.config = config
        self.engine = engine
        self.emit = emit
        self.max_in_flight_frames = max_in_flight_frames
        self.on_first_result = on_first_result
        self.on_result_latency = on_result_latency
        self.clock = clock
        self.pacer = pacer
        self.final_pass = final_pass
        self.tracer, self.trace_parent = tracer, trace_parent
        # Interims at most every THIN_INTERIM_MS of audio (the engine sheds them under load: engine/headroom.py).
        self.thin_interims = False
        self._final_traces: dict[int, UtteranceTrace] = {}  # finals built, not yet sent, by utterance index
        # A model with right context outputs each frame this much later: an utterance's end-of-utterance
        # silence includes that much more, so its last words come out, and word times are moved back by it.
        self.output_delay_frames = output_delay_frames
        self.model_name, self.model_version = model_name, model_version  # named on every result
        self._audio = open_stream_audio(config.encoding, config.sample_rate_hz)
        self._framer = Framer()
        self._vad = Vad(config.endpointing.vad_aggressiveness, int16_levels=self._audio.int16_levels)
        self._endpointer = Endpointer(config.endpointing, config.first_frame)
        self._ring = FrameRing(max(1, self._endpointer.max_forward_frames))
        self._interim_backlog_frames = self._endpointer.max_forward_frames + 5
        self._ctc = decoder
        self._actions: deque[tuple] = deque()
        self._queued_frames = 0  # frames in _actions, not yet sent
        self._forwarded_frames = 0  # over the stream: frames decided for the engine (what pacing counts)
        self.audio_samples = 0  # over the stream: samples received, at 16 kHz (what usage quotas count)
        self.audio_error = ""  # why the end of a compressed stream did not decode (the stream is not OK)
        self._utterance: _Utterance | None = None
        self._utterances = config.first_utterance
        self._arrivals: deque[tuple[int, float]] = deque()  # (frames sent up to, receive time) per send
        self._audio_frames_sent = 0  # over the stream: frames of audio sent to the engine
        self._pad_frames_sent = 0  # and frames of end-of-utterance silence (kept <= the audio)
        self._last_queue_s = 0.0
        self._last_compute_s = 0.0
        # Responses behind a final held for the second pass, in order: (response, receive time, its Held if a
        # held final, else None). Empty without a second pass.
        self._held: deque[tuple[Response, float, Held | None]] = deque()
        self._early_asked = False  # the open utterance (as decided) paused long enough to be read early

    def use_model(
        self, decoder: CtcDecoder | BeamCtcDecoder, name: str, version: str, output_delay_frames: int
    ) -> None:
        """Decode with ``decoder`` from now on, and name ``name``/``version`` on results: the engine moved the
        session to a new version of its model, from an utterance none of whose results has come yet."""
        utterance = self._utterance
        if utterance is not None and utterance.received:
            log.warning("session %s: model changed inside an utterance", self.session_id)
        self._ctc = decoder
        self.model_name, self.model_version = name, version
        self.output_delay_frames = output_delay_frames

    # --- input -----------------------------------------------------------------------------------

    def feed_audio(self, chunk: bytes, received_s: float) -> float:
        """One audio chunk from the client, received at ``received_s`` (monotonic). Returns how many seconds
        the caller waits before feeding more: 0 but for a paced stream whose speech is ahead of real time past
        its burst. Raises :class:`~cosystream.audio.streams.AudioFormatError` for bytes that are not audio
        in the stream's encoding (a compressed stream's container or codec)."""
        forwarded = self._forwarded_frames
        samples = self._audio.decode(chunk)  # a new array: the framer may keep views
        self.audio_samples += len(samples)
        self._frames(self._framer.push(samples, owned=True), received_s)
        self._pump()
        if self.pacer is None:
            return 0.0
        return self.pacer.consume((self._forwarded_frames - forwarded) * FRAME_MS / 1000)

    def finalize(self) -> None:
        """Client FINALIZE: end the current utterance now."""
        self._decide(self._endpointer.finalize(), self.clock())
        self._pump()

    def finish(self) -> None:
        """Client half-close: flush the audio still buffered, then end the open utterance."""
        now = self.clock()
        try:
            tail = self._audio.flush()
        except ValueError as err:  # a compressed stream's last frame did not decode (what came before did)
            self.audio_error = str(err)
            tail = np.zeros(0, dtype=np.float32)
        self._frames(self._framer.push(tail), now)
        if self._framer.pending_samples:
            self._frames(self._framer.flush_padded(), now)
        self._decide(self._endpointer.finalize(), now)
        self._pump()

    @property
    def resume_frame(self) -> int:
        """A frame a new session could start from, if a later snapshot were taken: the audio before it is no
        longer needed by any resume (it only grows)."""
        return self._endpointer.resume_frame

    def boundary(self) -> tuple[int, int] | None:
        """Where a snapshot of this session may be taken now (``frontend/snapshot.py``): the frame a session on
        another server starts from to decide as this one would, and the next utterance's index; None while an
        utterance is under way (or a speech run begins) or a final is still to be sent."""
        if not self.done or not self._endpointer.between_utterances:
            return None
        return self._endpointer.resume_frame, self._utterances

    @property
    def backlog_frames(self) -> int:
        """Frames decided but not yet sent (the reader waits while this is large)."""
        return self._queued_frames

    @property
    def done(self) -> bool:
        """Nothing queued, no utterance waiting for results, no response held for the second pass."""
        return not self._actions and self._utterance is None and not self._held

    def _frames(self, frames: np.ndarray, received_s: float) -> None:
        for i, frame in enumerate(frames):
            self._ring.push(frame)
            speech = self._vad.is_speech(frame)
            self._decide(self._endpointer.feed(speech), received_s, frames[i : i + 1])
            if self.final_pass is not None and self.final_pass.early_ms:
                self._early_read(speech, received_s)

    def _early_read(self, speech: bool, received_s: float) -> None:
        """Ask for the open utterance's early read once its speech is followed by enough silence, and drop it
        when speech comes again (queued as actions: they apply to the frames kept up to here)."""
        endpointer = self._endpointer
        if not endpointer.in_utterance:
            self._early_asked = False
        elif speech and self._early_asked:
            self._early_asked = False
            self._actions.append((_EARLY, False, received_s))
        elif not self._early_asked and endpointer.silence_run:
            after = self.final_pass.early_after_frames(
                endpointer.utterance_frames, endpointer.config.silence_ms // FRAME_MS
            )
            if after is not None and endpointer.silence_run >= after:
                self._early_asked = True
                self._actions.append((_EARLY, True, received_s))

    def _decide(self, decision: Decision, received_s: float, current: np.ndarray | None = None) -> None:
        if decision.started:
            self._actions.append((_START, decision, received_s))
        if decision.forward_frames:
            # In speech, each frame forwards itself: send the framer's frame rather than a copy from the ring.
            one = decision.forward_frames == 1 and current is not None
            frames = current if one else self._ring.last(decision.forward_frames)
            self._actions.append((_FRAMES, frames, received_s))
            self._queued_frames += len(frames)
            self._forwarded_frames += len(frames)
        if decision.ended:
            self._actions.append((_END, decision, received_s))
            self._early_asked = False

    # --- the ordered action queue ------------------------------------------------------------------

    def _pump(self) -> None:
        while self._actions:
            kind, payload, received_s = self._actions[0]
            if kind == _START:
                if self._utterance is not None:
                    return  # the previous utterance's final has not been sent yet
                self._utterance = _Utterance(self._utterances, payload, received_s)
                self._utterances += 1
                if self.tracer is not None:
                    self._utterance.trace = self._start_trace(self._utterance)
                self._event(EventType.SPEECH_STARTED, payload.start_ms, received_s)
            elif kind == _EARLY:
                if payload:
                    self.final_pass.early(self._utterance.index)
                else:
                    self.final_pass.speech_again()
            elif kind == _FRAMES:
                utterance = self._utterance
                room = self.max_in_flight_frames - (utterance.sent - utterance.received)
                if room <= 0:
                    return
                frames = payload if len(payload) <= room else payload[:room]
                self.engine.send_frames(self.key, frames)
                if self.final_pass is not None:
                    self.final_pass.keep(frames)
                utterance.sent += len(frames)
                if utterance.trace is not None:
                    utterance.trace.audio(received_s)
                self._audio_frames_sent += len(frames)
                self._arrivals.append((utterance.sent, received_s))
                self._queued_frames -= len(frames)
                if len(frames) < len(payload):
                    self._actions[0] = (_FRAMES, payload[len(frames) :], received_s)
                    return
            else:
                utterance = self._utterance
                if utterance.end is None:
                    utterance.end = payload
                    if utterance.trace is not None:
                        reason = str(payload.end_reason or "")
                        utterance.trace.endpoint(reason, received_s)
                    self._event(EventType.SPEECH_ENDED, payload.end_ms, received_s)
                if not utterance.flushed and utterance.sent:
                    # The model's last words need context after them: the VAD's silence hangover gives it;
                    # an utterance ended early (FINALIZE, half-close, length limit) gets silence instead.
                    trailing = utterance.first_frame + utterance.sent - utterance.end.end_frame
                    pad = max(0, END_CONTEXT_FRAMES + self.output_delay_frames - trailing)
                    pad = min(pad, self._audio_frames_sent - self._pad_frames_sent)
                    in_flight = utterance.sent - utterance.received
                    if in_flight and pad > self.max_in_flight_frames - in_flight:
                        return  # (sent anyway once nothing is in flight, whatever the in-flight limit)
                    if pad:
                        self.engine.send_frames(self.key, np.zeros((pad, FRAME_SAMPLES), dtype=np.float32))
                        utterance.sent += pad
                        self._pad_frames_sent += pad
                    if utterance.received < utterance.sent:
                        self.engine.end_utterance(self.key)  # what is left to step, stepped now
                    utterance.flushed = True
                if utterance.received < utterance.sent:
                    return  # the final waits for the results of every frame sent
                self._final(utterance)
            self._actions.popleft()

    def resume(self) -> None:
        """The second pass answered: send the final that waited for it, and what queued behind it."""
        while self._held and (self._held[0][2] is None or self._held[0][2].answered):
            response, received_s, _ = self._held.popleft()
            self._send_now(response, received_s)

    def close(self) -> None:
        """The stream is over (every exit path): a second-pass job still waiting is dropped."""
        if self.final_pass is not None:
            self.final_pass.close()
        traces = [*self._final_traces.values()]
        if self._utterance is not None and self._utterance.trace is not None:
            traces.append(self._utterance.trace)
        for trace in traces:
            trace.abandon("the stream ended before this utterance's final was sent", self.clock())
        self._final_traces.clear()
        if self._utterance is not None:
            self._utterance.trace = None

    # --- engine results ----------------------------------------------------------------------------

    def on_results(self, ids: np.ndarray, logprobs: np.ndarray, queue_s: float, compute_s: float) -> None:
        """Per-frame results for this session's frames, in the order they were sent."""
        utterance = self._utterance
        if utterance is None:
            log.warning("session %s: results with no utterance in flight", self.session_id)
            return
        first = utterance.first_frame + utterance.received
        utterance.text_changed |= self._ctc.push(ids, logprobs, first)
        utterance.received += len(ids)
        self._last_queue_s, self._last_compute_s = queue_s, compute_s
        if utterance.trace is not None:
            utterance.trace.step(queue_s, compute_s, self.clock())
        # An interim describes the newest audio: while a burst (an onset's pre-roll, audio sent faster
        # than real time) is being stepped, send one when every frame sent has its result, or at most
        # every ``_interim_backlog_frames`` of audio (a little more than an onset's burst).
        caught_up = utterance.received == utterance.sent
        if (
            utterance.text_changed
            and self.config.interim_results
            and utterance.end is None
            and (caught_up or utterance.received - utterance.interim_at >= self._interim_backlog_frames)
            and (not self.thin_interims or utterance.received - utterance.interim_at >= _THIN_INTERIM_FRAMES)
            and self._ctc.text
        ):
            utterance.text_changed = False
            utterance.interim_at = utterance.received
            self._result(utterance, is_final=False)
        self._pump()

    # --- responses ---------------------------------------------------------------------------------

    def _latency(self, received_s: float) -> Latency:
        utterance = self._utterance
        if utterance is None:
            processed = self._endpointer.frames_seen
        else:  # (the flush's silence is not audio)
            processed = min(utterance.first_frame + utterance.received, self._endpointer.frames_seen)
        return Latency(
            audio_processed_ms=processed * FRAME_MS,
            queue_ms=self._last_queue_s * 1e3,
            compute_ms=self._last_compute_s * 1e3,
            receive_to_send_ms=(self.clock() - received_s) * 1e3,
        )

    def _event(self, kind: EventType, offset_ms: int, received_s: float) -> None:
        event = SpeechEvent(kind, offset_ms)
        self._send(Response(self.session_id, self._latency(received_s), event=event), received_s)

    def _send(self, response: Response, received_s: float, held: Held | None = None) -> None:
        """Send ``response`` now, or queue it behind a final held for the second pass (``held``: this one is).
        An interim of a later utterance gives up the held finals ahead of it, unless they hold the next
        utterance (``FinalPass.holds_next``, and always on a BATCH stream, which is read faster than real time
        for its finals): they go with the streaming text, and the interim with them."""
        result = response.result
        if self._held and result is not None and not result.is_final and not self.final_pass.holds_next:
            index = result.utterance_index
            for _, _, ahead in self._held:
                if ahead is not None and ahead.result.utterance_index < index:
                    self.final_pass.give_up(ahead)
            self._held.append((response, received_s, held))
            self.resume()
        elif self._held or (held is not None and not held.answered):
            self._held.append((response, received_s, held))
        else:
            self._send_now(response, received_s)

    def _send_now(self, response: Response, received_s: float) -> None:
        if response.result is not None:
            response.latency.receive_to_send_ms = (self.clock() - received_s) * 1e3
            if self.on_result_latency is not None:
                self.on_result_latency(response.latency.receive_to_send_ms / 1e3)
            if self._final_traces and response.result.is_final:
                self._send_traced(response)
                return
        self.emit(response)

    # --- traces (tracing.py) -------------------------------------------------------------------------

    def _start_trace(self, utterance: _Utterance) -> UtteranceTrace | None:
        priority = self.config.priority.name.lower()
        attributes = UtteranceTrace.attributes(self.session_id, utterance.index, priority, self.model_name)
        return self.tracer.start(utterance.started_s, attributes, self.trace_parent)

    def _send_traced(self, response: Response) -> None:
        trace = self._final_traces.pop(response.result.utterance_index, None)
        ready_s = self.clock()
        self.emit(response)
        if trace is not None:
            trace.sent(ready_s, self.clock(), response.result)

    def _newest_arrival(self, utterance: _Utterance) -> float:
        """Receive time of the chunk that completed the newest frame with a result."""
        arrival = self._arrivals[0][1] if self._arrivals else self.clock()
        while self._arrivals and self._arrivals[0][0] <= utterance.received:
            arrival = self._arrivals.popleft()[1]
        return arrival

    def _result(
        self, utterance: _Utterance, is_final: bool, trace: UtteranceTrace | None = None, decode_s: float = 0.0
    ) -> None:
        received_s = self._newest_arrival(utterance)
        text = self._ctc.text
        if utterance.end is not None and is_final:
            end_ms = utterance.end.end_ms
        else:
            end_ms = max(utterance.first_frame + utterance.received - self.output_delay_frames, 0) * FRAME_MS
        result = Result(
            transcript=text,
            is_final=is_final,
            # Greedy output only grows; a beam search's best hypothesis may still change.
            stability=1.0 if is_final or self._ctc.stable_interims else 0.5,
            start_ms=utterance.start_frame * FRAME_MS,
            end_ms=end_ms,
            utterance_index=utterance.index,
            confidence=self._ctc.confidence,
            model=self.model_name,
            model_version=self.model_version,
            final_pass=STREAMING if is_final else "",
        )
        if self.config.word_time_offsets:
            result.words = self._words(self._ctc.words())
        if is_final and self.config.max_alternatives > 1:
            result.alternatives = [
                Alternative(
                    alt.text, alt.confidence, self._words(alt.words) if self.config.word_time_offsets else []
                )
                for alt in self._ctc.alternatives(self.config.max_alternatives)
            ]
        response = Response(self.session_id, self._latency(received_s), result=result)
        held = None
        if is_final and self.final_pass is not None:  # (the held result is rewritten in place when answered)
            held = self.final_pass.take(utterance.index, result, utterance.first_frame * FRAME_MS)
        if trace is not None:
            trace.decoded(decode_s, self.clock())
            trace.held = held is not None
        self._send(response, received_s, held)
        if text and not utterance.first_result_sent:
            utterance.first_result_sent = True
            if self.on_first_result is not None:
                self.on_first_result(self.clock() - utterance.started_s)

    def _words(self, words) -> list[Word]:
        """Decoded words as results carry them: moved back by the model's output delay."""
        delay_ms = self.output_delay_frames * FRAME_MS
        return [
            Word(w.word, max(w.start_ms - delay_ms, 0), max(w.end_ms - delay_ms, 0), w.confidence) for w in words
        ]

    def _final(self, utterance: _Utterance) -> None:
        trace, decode_s = utterance.trace, self.clock()
        if trace is not None:  # (_result may send it at once: the trace waits for it from here)
            self._final_traces[utterance.index] = trace
            utterance.trace = None
        self._ctc.finalize()
        self._result(utterance, is_final=True, trace=trace, decode_s=decode_s)
        self._ctc.reset()
        self._arrivals.clear()
        self._utterance = None
        if utterance.sent:
            self.engine.reset(self.key)
