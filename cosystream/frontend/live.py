"""One live session's handle, whatever carries it: the glue between a connection, its ``Session`` and the
engine channel.

A transport (the gRPC servicer, and through it HTTP / WebSocket and the Google / Riva adapters) opens a
:class:`LiveSession` with the host (``host.py``), feeds it audio (:meth:`~LiveSession.feed`) and controls
(:meth:`~LiveSession.finalize`, :meth:`~LiveSession.hand_over`), half-closes it
(:meth:`~LiveSession.finish`), and sends what comes out of :attr:`~LiveSession.responses`, mapped to its
messages: the session's :class:`~cosystream.frontend.results.Response`, a :class:`Progress` (a resumable
session's consumed audio), a :class:`Handoff` (its snapshot, ``snapshot``), an :class:`~.status.Ended`
(its end, not OK), :data:`DONE` (OK: everything sent was transcribed) or :data:`TAKEN` (a resume took the
session to another connection). The handle owns the engine slot, the token's quota claim and audio lease,
the idle timer and the drain cut; :meth:`~LiveSession.release` gives every one of them back.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from dataclasses import dataclass
from enum import IntEnum
from typing import Protocol

from cosystream.audio.codecs import AudioEncoding
from cosystream.audio.streams import AudioFormatError
from cosystream.decoding.phrases import PhraseError
from cosystream.engine.ipc import EngineInfo, ModelInfo
from cosystream.frames import FRAME_MS, SAMPLE_RATE_HZ
from cosystream.frontend.cpu import CpuHeadroom
from cosystream.frontend.final_pass import MAX_AUDIO_S, FinalPass
from cosystream.frontend.lateness import AudioClock
from cosystream.frontend.quota import Claim, QuotaExceeded, Token
from cosystream.frontend.responses import ResponseQueue
from cosystream.frontend.session import AudioPacer, Session, SessionConfig
from cosystream.frontend.snapshot import Snapshot
from cosystream.frontend.status import Ended, Refused, Status
from cosystream.frontend.usage import Lease, UsageExceeded
from cosystream.priority import Priority

log = logging.getLogger(__name__)

CUT_TIMEOUT_S = 10.0
"""How long a cut stream (idle timeout, drain) may take to deliver its final before it is cancelled."""

AUDIO_SLICE_BYTES = 16_000
"""A large audio message is processed in slices of this many bytes (0.5 s of 16 kHz LINEAR16) with the event
loop free between them, so one client's 10 MB chunk delays other sessions by a slice's work (~1-2 ms), not
the whole message's."""

RESUME_REPLAY = 1024
"""Responses a resumable stream keeps after sending them, to send again to a client that resumes having
missed them (at one interim per 40-80 ms of speech, a minute or more)."""

RESUME_PROGRESS_S = 1.0
"""A resumable stream gets a response at least every this much of its audio consumed (one with no results
during silence), so its client need keep only about that much audio for a resume."""

RESUMABLE = {AudioEncoding.LINEAR16: 2, AudioEncoding.MULAW: 1, AudioEncoding.ALAW: 1}  # bytes per sample

DONE = object()  # (the session ended OK: every final was sent)
TAKEN = object()  # (a resume on another connection takes the session: its transport lets it go)


@dataclass(frozen=True, slots=True)
class Progress:
    """A resumable session consumed audio and said nothing for a while (silence, say): a response that
    only says how much it consumed."""


@dataclass(frozen=True, slots=True)
class Handoff:
    """Queued at a session's utterance boundary when it is handed over: sent as its snapshot (``snapshot``)."""

    frame: int
    utterances: int


class StreamState(IntEnum):
    """Where a stream is in its life; it only moves forward (a failure may skip FINISHING)."""

    STREAMING = 0  # reading requests
    FINISHING = 1  # no more audio (half-close or a cut): flushing to the last final
    ENDED = 2  # its last response (OK or a status) is queued; nothing more is read or sent
    RELEASED = 3  # its engine slot is freed, its timers stopped


class Host(Protocol):
    """What a session uses of the host that holds it (``host.SessionHost``)."""

    engine: object
    options: object
    metrics: object
    token_sessions: object
    models: object
    second_pass: object
    tracer: object
    cpu: CpuHeadroom
    thin_interims: bool

    @property
    def info(self) -> EngineInfo: ...

    def model_by_id(self, model: int) -> ModelInfo | None: ...

    def vocabulary(self, name: str) -> tuple[str, tuple] | None: ...

    def new_resume_token(self) -> str: ...

    def forget(self, session: LiveSession) -> None: ...

    async def batch_turn(self, audio_s: float) -> bool: ...


class LiveSession:
    """One stream's session, held by ``host``; ``token``: who opened it (None: authentication is off)."""

    def __init__(self, host: Host, config: SessionConfig, token: Token | None = None, trace_parent=None):
        self.host = host
        self.engine = host.engine
        self.key = self.engine.new_key()
        self.session_id = uuid.uuid4().hex[:16]
        self.priority = config.priority
        options = host.options
        self.responses = ResponseQueue(options.max_queued_responses)
        self.progress = asyncio.Event()
        self.state = StreamState.STREAMING
        self.end_status: Ended | None = None  # a cut stream's status, sent after its final
        metrics = host.metrics
        priority_label = config.priority.name.lower()
        model: ModelInfo = host.info.models[config.model]
        self.model_id = model.id  # the engine's id of the model version it runs
        self.model_name = model.name
        self.phrases = config.phrases
        self.vocabulary = host.vocabulary(config.vocabulary)  # (name, phrases), or None
        self.boosting = config.boosting
        self.factory = host.models.decoder(model)
        self._held: list | None = None  # engine events held while a moved stream's decoder is built
        self.session = Session(
            self.key,
            self.session_id,
            config,
            self.factory(config.boosting),
            self.engine,
            self.responses.put,
            max_in_flight_frames=options.max_in_flight_frames,
            on_first_result=metrics.observe_first_result,
            on_result_latency=lambda s: metrics.observe_result(priority_label, s),
            output_delay_frames=model.output_delay_frames,
            model_name=model.name,
            model_version=model.version,
            pacer=AudioPacer(options.realtime_burst_s) if config.priority == Priority.REALTIME else None,
            final_pass=None
            if host.second_pass is None or not config.second_pass
            else FinalPass(
                host.second_pass,
                self.key,
                config.priority == Priority.REALTIME,
                MAX_AUDIO_S * 1000 // FRAME_MS,
                self._second_pass_answered,
                config.punctuation,
                config.word_time_offsets,
                config.hotwords,
                host.second_pass.config.early_ms,
                host.second_pass.config.holds_next,
            ),
            tracer=host.tracer,
            trace_parent=trace_parent,
        )
        self.session.thin_interims = host.thin_interims
        # How far behind real time its audio is read (lateness.py): a REALTIME stream's, for admission.
        self.clock = AudioClock() if config.priority == Priority.REALTIME else None
        self.reader: asyncio.Task | None = None  # the transport's task reading the connection (a cut stops it)
        self.handler: asyncio.Task | None = None  # the transport's task sending (a stuck one is cancelled)
        self.token = token
        self.quota: Claim | None = None  # while set, the stream is counted in its token's quota and gauge
        self.audio: Lease | None = None  # while set, its audio is counted against its token's usage limits
        self._force: asyncio.TimerHandle | None = None
        self.idle_timer: asyncio.TimerHandle | None = None
        self.last_request_s = time.monotonic()
        # Until the engine answers the open, the stream cannot end OK: a refused open (the engine full) must
        # reach the client as RESOURCE_EXHAUSTED even if it half-closed before the answer came.
        self.opened = False
        # Set once the engine has answered the open (a slot: ``opened``) or the stream has ended (a refusal).
        self.answered = asyncio.Event()
        # Resume (config.resumable): the token, the input consumed (bytes; samples for the client), the responses
        # sent (numbered, the last RESUME_REPLAY kept), and while no connection holds it, the expiry timer.
        self.resume_token = host.new_resume_token() if config.resumable else ""
        self.bytes_per_sample = RESUMABLE.get(config.encoding, 1)
        # (a session resumed from a snapshot goes on from its offset, its responses numbered on from it)
        self.frame_samples = config.sample_rate_hz // 100  # input samples per 10 ms frame (every rate: whole)
        self.consumed_bytes = config.first_frame * self.frame_samples * self.bytes_per_sample
        self.skip_bytes = config.skip_samples * self.bytes_per_sample  # (audio the session already has)
        self.response_index = config.first_response
        self.reported_samples = 0  # consumed_samples as of the last response sent
        self.progress_samples = int(RESUME_PROGRESS_S * config.sample_rate_hz)
        self.sent: deque[tuple[int, object]] = deque(maxlen=RESUME_REPLAY)  # (index, the transport's message)
        self.expiry: asyncio.TimerHandle | None = None
        self.detached = asyncio.Event()  # set while held (no connection holds it)
        self.replay: list[object] = []  # (a resume's messages to send again)
        self.outcome = "ok"  # how the stream ended, for the log
        self.taking = False  # a resume is taking it from its connection (TAKEN queued)
        # Hand the session over at its next utterance boundary (a drain, Control.SNAPSHOT): its snapshot, then
        # this end (an Ended, or DONE: OK).
        self.handover: object | None = None

    @property
    def consumed_samples(self) -> int:
        return self.consumed_bytes // self.bytes_per_sample

    @property
    def resume_samples(self) -> int:
        """What a resumable stream reports consumed: the input it has, less what a snapshot taken later may
        start before it (a pre-roll): a client that keeps the audio from here can resume on any server."""
        return min(self.consumed_samples, self.session.resume_frame * self.frame_samples)

    def number(self, consumed_samples: int | None = None) -> tuple[int, int]:
        """A resumable stream's next response: its index, and the input consumed it reports
        (``consumed_samples`` where it says its own: a snapshot's)."""
        self.response_index += 1
        self.reported_samples = self.resume_samples if consumed_samples is None else consumed_samples
        return self.response_index, self.reported_samples

    def keep(self, index: int, message: object) -> None:
        """Keep the response numbered ``index`` (as the transport sent it) to send again after a resume."""
        self.sent.append((index, message))

    # SessionSink, called by the engine client.
    def on_opened(self, model: int) -> None:
        log.debug("session %s has an engine slot", self.session_id)
        self.opened = True
        self.answered.set()
        if model != self.model_id:  # (replaced since the stream was accepted: the engine gave the new version)
            self.on_moved(model)
        self._check_done()

    def on_moved(self, model: int) -> None:
        if self._held is not None:  # (the last move's decoder is still being built)
            self._held.append(lambda: self.on_moved(model))
            return
        info = self.host.model_by_id(model)
        if info is None:  # (the engine announces a model before it names it: a bug)
            log.error(
                "session %s: moved to model id %d, which this frontend was not told of", self.session_id, model
            )
            self.fail(Status.INTERNAL, "the server lost track of its models")
            return
        self.model_id = model
        self.model_name = info.name  # (the same name, or LIGHT for HEAVY under load: serve --adaptive)
        factory = self.host.models.decoder(info)
        if not (self.phrases or self.vocabulary):
            self._use(factory, info, None)
            return
        # A new version sharing the old one's setup keeps what was built for it; otherwise the phrases were
        # built for it while it was prepared (ModelDecoders.prepare: those of the streams on its model).
        boosting = self.boosting if factory is self.factory else factory.cached(self.phrases, self.vocabulary)
        if boosting is not None:
            self._use(factory, info, boosting)
            return
        # Not built yet (another model's, as --adaptive moves the stream; or the stream began while the version
        # was prepared): built off the event loop, the stream's results held until it is (milliseconds per new
        # word; the engine steps on, its audio is read on up to max_in_flight_frames).
        self._held = []
        loop = asyncio.get_running_loop()
        phrases, vocabulary = self.phrases, self.vocabulary

        def build() -> None:
            try:
                built = factory.boosting(phrases, vocabulary)
            except PhraseError as err:
                log.warning("session %s: its phrases are not boosted on %s: %s", self.session_id, info.name, err)
                built = None
            loop.call_soon_threadsafe(self._built, factory, info, built)

        loop.run_in_executor(None, build)

    def _built(self, factory, info: ModelInfo, boosting) -> None:
        if self.state >= StreamState.ENDED:  # (failed meanwhile: nothing more is decoded)
            self._held = None
            return
        self._use(factory, info, boosting)
        held, self._held = self._held, None
        while held:  # (in order; a move among them may hold what follows it again)
            held.pop(0)()
            if self._held is not None:
                self._held.extend(held)
                return

    def _use(self, factory, info: ModelInfo, boosting) -> None:
        self.factory, self.boosting = factory, boosting
        self.session.use_model(factory(boosting), info.name, info.version, info.output_delay_frames)

    def on_refused(self, message: str, shed: bool, retry_after_s: float | None = None) -> None:
        self.host.metrics.rejected("shed" if shed else "overloaded" if retry_after_s is not None else "full")
        self.fail(Status.RESOURCE_EXHAUSTED, message, retry_after_s)

    def on_results(self, ids, logprobs, queue_s: float, compute_s: float) -> None:
        if self._held is not None:  # (its decoder is being built: on_moved)
            self._held.append(lambda: self.on_results(ids, logprobs, queue_s, compute_s))
            return
        self.session.on_results(ids, logprobs, queue_s, compute_s)
        self.progress.set()
        if self.handover is not None:
            self._check_handover()
        self._check_done()

    def _second_pass_answered(self) -> None:
        if self.state < StreamState.ENDED:
            self.session.resume()
            self.progress.set()
            if self.handover is not None:
                self._check_handover()
            self._check_done()

    def on_engine_lost(self) -> None:
        self.fail(Status.UNAVAILABLE, "the engine process stopped; retry on another server")

    # --- handing the session over to another server (snapshot.py) ---

    def hand_over(self, ending: object) -> None:
        """At the session's next utterance boundary (now, if it is at one), send its snapshot, then end:
        ``ending`` an :class:`~.status.Ended` (a drain: UNAVAILABLE), or :data:`DONE` (Control.SNAPSHOT: OK)."""
        if self.state == StreamState.STREAMING and self.handover is None:
            self.handover = ending
            self._check_handover()

    def _check_handover(self) -> None:
        point = self.session.boundary() if self.state == StreamState.STREAMING else None
        if point is None:
            return
        ending, self.handover = self.handover, None
        self.responses.put(Handoff(*point))
        log.info(
            "session %s: handed over at frame %d (utterance %d next)",
            self.session_id,
            *point,
            extra={"session_id": self.session_id},
        )
        if isinstance(ending, Ended):
            self.cut(ending.status, ending.message, ending.retry_after_s)
        else:
            if self.reader is not None and self.reader is not asyncio.current_task():
                self.reader.cancel()
            self.finish()

    def snapshot(self, handoff: Handoff, key: bytes, window_s: float) -> Snapshot:
        """The handed-over session's snapshot, as the next response (whose index it knows) carries it; good
        for ``window_s``. ``key``: the replicas' shared key, which the transport seals it with."""
        return Snapshot(
            config=self.session.config.wire,
            model=self.model_name,
            model_version=self.session.model_version,
            offset_samples=handoff.frame * self.frame_samples,
            frame=handoff.frame,
            utterances=handoff.utterances,
            responses=self.response_index + 1,
            token=self.token.name if self.token is not None else None,
            expires_s=time.time() + window_s,
        )

    # --- the end ---

    def fail(self, status: Status, message: str, retry_after_s: float | None = None) -> None:
        """End now with ``status`` (what is still queued before it is sent first); ``retry_after_s``: a temporary
        refusal's retry delay."""
        if self.state < StreamState.ENDED:
            self.state = StreamState.ENDED
            self.responses.put(Ended(status, message, retry_after_s))
            self.responses.wake()
            self.progress.set()
            self.answered.set()

    def _check_done(self) -> None:
        if self.state == StreamState.FINISHING and self.opened and self.session.done:
            self.state = StreamState.ENDED
            self.responses.put(self.end_status or DONE)
            self.responses.wake()

    def finish(self) -> None:
        """No more audio (half-close, or a cut): flush and end after the last final."""
        if self.state == StreamState.STREAMING:
            self.state = StreamState.FINISHING
            self.session.finish()
            if self.session.audio_error and self.end_status is None:
                self.end_status = Ended(Status.INVALID_ARGUMENT, self.session.audio_error)
            self._check_done()

    def cut(self, status: Status, message: str, retry_after_s: float | None = None) -> None:
        """The server ends the stream: stop reading, flush the audio received, send its final, then end
        with ``status`` (not OK: the client had more to send)."""
        if self.state != StreamState.STREAMING:
            return
        self.end_status = Ended(status, message, retry_after_s)
        if self.reader is not None:
            self.reader.cancel()
        self.progress.set()
        self.finish()
        # A client that reads nothing would keep the stream (and its slot) for ever: end it regardless.
        self._force = asyncio.get_running_loop().call_later(CUT_TIMEOUT_S, self._force_close)

    def _force_close(self) -> None:
        if self.handler is not None and not self.handler.done():
            log.info("session %s: its final was not taken in time; closing it", self.session_id)
            self.handler.cancel()

    # --- the connection ---

    def attach(self, reader: asyncio.Task) -> None:
        """A connection carries the session from now on: the calling task sends its responses, ``reader``
        reads its requests; the idle timer runs."""
        self.handler = asyncio.current_task()
        self.last_request_s = time.monotonic()
        self.reader = reader
        self._watch_idle()

    def claim_quota(self) -> None:
        """Count this stream against its token's ``max_sessions`` and audio limits (``release`` gives them
        back); raises :class:`~.status.Refused` (RESOURCE_EXHAUSTED) when the token has its sessions all open,
        or has used its audio: a REALTIME stream for the minute or the day, a BATCH stream for the day (for the
        minute it is accepted and waits)."""
        token = self.token
        if token is None:
            return
        try:
            self.quota = self.host.token_sessions.claim(token.name, token.max_sessions)
        except QuotaExceeded as err:
            raise Refused(Status.RESOURCE_EXHAUSTED, str(err), "quota") from None
        self.host.metrics.token_session(token.name, opened=True)
        if token.usage.limited:
            self.audio = self.host.token_sessions.audio_lease(token.name, token.usage)
            try:
                self.audio.ensure()
            except UsageExceeded as err:
                if self.priority == Priority.REALTIME or err.per == "day":
                    raise Refused(Status.RESOURCE_EXHAUSTED, str(err), "usage_quota", err.retry_after_s) from None

    async def _audio_allowed(self) -> bool:
        """Whether the token may send more audio now (its usage limits). A REALTIME stream past its token's
        minute, and any stream past its day, is cut (its final, then RESOURCE_EXHAUSTED with when to retry);
        a BATCH stream past the minute waits for it (nothing is read meanwhile, nothing is lost)."""
        audio = self.audio
        while True:
            try:
                audio.ensure()
                return True
            except UsageExceeded as err:
                if self.priority == Priority.REALTIME or err.per == "day":
                    self.host.metrics.rejected("usage_quota", self.token.name)
                    self.cut(Status.RESOURCE_EXHAUSTED, str(err), err.retry_after_s)
                    return False
                await asyncio.sleep(min(max(err.retry_after_s, 0.05), 1.0))
                self.last_request_s = time.monotonic()  # (the server's wait, not the client's idleness)
                if self.state != StreamState.STREAMING:
                    return False

    def release(self) -> None:
        """Every exit path: stop reading, stop the timer, free the engine slot and the token's quota.
        Idempotent."""
        self.state = StreamState.RELEASED
        if self.resume_token:
            self.host.forget(self)
            if self.expiry is not None:
                self.expiry.cancel()
                self.expiry = None
        if self.quota is not None:
            self.quota.release()
            self.quota = None
            self.host.metrics.token_session(self.token.name, opened=False)
        if self.audio is not None:
            self.audio.close()
            self.host.metrics.token_audio(self.token.name, self.audio.spent_s)
            self.audio = None
        self.let_go()
        self.session.close()
        self.engine.close(self.key)

    def let_go(self) -> None:
        """Stop reading the connection's requests and the timers that watch it, and drop its handler (at its
        release, or when a resumable stream's connection goes away)."""
        if self.reader is not None:
            self.reader.cancel()
            self.reader = None
        for timer in (self.idle_timer, self._force):
            if timer is not None:
                timer.cancel()  # a timer holds the stream (session, decoder) until it fires
        self.idle_timer = self._force = None
        self.handler = None  # (the handler's frame holds this stream: no cycle left for the collector)

    def _watch_idle(self) -> None:
        """Close the stream when no request came for the idle timeout (one timer per stream, not per
        request: a ``wait_for`` around every read costs a task and a timer per 10 ms chunk)."""
        if self.state != StreamState.STREAMING:
            return
        timeout_s = self.host.options.idle_timeout_s
        idle_s = time.monotonic() - self.last_request_s
        if idle_s >= timeout_s:
            self.host.metrics.rejected("idle_timeout")
            # What was heard still gets its final, then the status.
            self.cut(Status.DEADLINE_EXCEEDED, f"no request for {timeout_s:g} s: the session was closed")
            return
        self.idle_timer = asyncio.get_running_loop().call_later(timeout_s - idle_s, self._watch_idle)

    # --- what the connection sends ---

    async def wait_for_room(self) -> None:
        """Return once the client has room for more responses (one that does not read them is not read
        either: flow control), or the session ended."""
        while self.responses.full and self.state < StreamState.ENDED:
            await self.responses.wait_for_room()

    def heard(self) -> None:
        """A request came (the idle timer counts from it)."""
        self.last_request_s = time.monotonic()

    async def feed(self, audio: bytes) -> bool:
        """The client's next audio; False once the session reads no more (ended, cut, handed over)."""
        session = self.session
        limit = self.host.options.max_in_flight_frames
        received_s = self.last_request_s
        if self.skip_bytes:  # (resumed: what the session already has)
            skipped = min(self.skip_bytes, len(audio))
            audio, self.skip_bytes = audio[skipped:], self.skip_bytes - skipped
        for offset in range(0, len(audio), AUDIO_SLICE_BYTES):
            if offset:
                await asyncio.sleep(0)  # other sessions run between the slices of a big chunk
                if self.state != StreamState.STREAMING:
                    return False
            if self.audio is not None and not await self._audio_allowed():
                return False
            heard = session.audio_samples
            try:
                wait_s = session.feed_audio(audio[offset : offset + AUDIO_SLICE_BYTES], self.last_request_s)
            except AudioFormatError as err:
                # What decoded before it still gets its final, then the status.
                self.host.metrics.rejected("invalid_argument")
                self.cut(Status.INVALID_ARGUMENT, str(err))
                return False
            self.consumed_bytes += min(AUDIO_SLICE_BYTES, len(audio) - offset)
            read_s = (session.audio_samples - heard) / SAMPLE_RATE_HZ
            self.host.cpu.read_audio(self.priority, read_s)
            if self.clock is not None:
                self.clock.read(received_s, read_s)
            elif self.priority == Priority.BATCH and await self.host.batch_turn(read_s):
                # (realtime audio late: read slower; the wait is the server's, not the client's idleness)
                self.last_request_s = time.monotonic()
                if self.state != StreamState.STREAMING:
                    return False
            if self.audio is not None:
                self.audio.spend(read_s)
            while session.backlog_frames > limit and self.state < StreamState.ENDED:
                self.progress.clear()
                await self.progress.wait()
            if wait_s > 0:
                # Ahead of real time past its burst: nothing more is read until the clock catches up (flow
                # control slows the sender; no audio is dropped). The wait is the server's, not the client's
                # idleness.
                await asyncio.sleep(wait_s)
                self.last_request_s = time.monotonic()
                if self.state != StreamState.STREAMING:
                    return False
        if (
            self.resume_token
            and self.resume_samples - self.reported_samples >= self.progress_samples
            and not len(self.responses)
        ):  # (no response for a while, silence say: one that only says what was consumed)
            self.responses.put(Progress())
            self.reported_samples = self.resume_samples
        return self.went_on()

    def finalize(self) -> bool:
        """Client FINALIZE: end the current utterance now."""
        self.session.finalize()
        return self.went_on()

    def went_on(self) -> bool:
        """After a request: hand over if at a boundary; False once the session reads no more."""
        if self.handover is not None:
            self._check_handover()
        return self.state == StreamState.STREAMING  # (ended, or handed over)
