"""The sessions of one frontend process, whatever carries them: admission, opening, resume, drain.

:class:`SessionHost` holds the frontend's engine channel, options, metrics, quotas, decoders and second pass,
and every live session (``live.py``): it admits a validated config (:meth:`~SessionHost.admit`), opens a
session (:meth:`~SessionHost.start`), holds a resumable one whose connection dropped
(:meth:`~SessionHost.park`) and gives it to the connection that resumes it (:meth:`~SessionHost.take`),
goes on from another server's snapshot (:meth:`~SessionHost.resumed_from`), and drains. A transport (the
gRPC servicer) maps its messages and status codes onto it; nothing here knows one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import secrets
import time
from dataclasses import dataclass, field

from cosystream.audio.endpointing import EndpointingConfig
from cosystream.decoding.config import DecoderConfig
from cosystream.decoding.phrases import Phrase, PhraseError
from cosystream.engine.headroom import RETRY_AFTER_S, THIN_INTERIM_MS
from cosystream.engine.ipc import EngineInfo, ModelInfo
from cosystream.frontend.cpu import ADMIT_CPU, CpuHeadroom
from cosystream.frontend.engine_client import Engine
from cosystream.frontend.lateness import ADMIT_LATE_S, BATCH_SLOW_LATE_S, CHECK_S, median_late_s
from cosystream.frontend.live import RESUME_REPLAY, TAKEN, LiveSession, StreamState
from cosystream.frontend.loop_lag import ADMIT_LAG_S, LoopLag
from cosystream.frontend.model_decoders import ModelDecoders
from cosystream.frontend.quota import Token, TokenSessions
from cosystream.frontend.responses import DEFAULT_MAX_ITEMS
from cosystream.frontend.session import MAX_IN_FLIGHT_FRAMES, REALTIME_BURST_S, SessionConfig
from cosystream.frontend.snapshot import Snapshot, SnapshotError
from cosystream.frontend.status import Ended, Refused, Status, draining
from cosystream.frontend.tracing import TracingConfig, UtteranceTracer
from cosystream.metrics import FrontendMetrics
from cosystream.priority import Priority
from cosystream.secondpass.worker import SecondPass, SecondPassConfig

log = logging.getLogger(__name__)

BATCH_FULL_PACE = 64.0
"""A BATCH pace (x real time) raised past this is full speed again (``SessionHost._pace_batch``)."""

RESUME_WINDOW_S = 30.0
"""How long a resumable session is held after its connection drops (``serve --resume-window-s``)."""

HANDED_OVER = (
    "the server is draining: this session goes on on another server from the resume_snapshot sent "
    "(StreamingConfig.resume_snapshot, with the audio from its consumed_samples)"
)


@dataclass(frozen=True, slots=True)
class StreamOptions:
    idle_timeout_s: float = 30.0
    max_in_flight_frames: int = MAX_IN_FLIGHT_FRAMES
    # Responses queued for a client that does not read them, before its requests stop being read.
    max_queued_responses: int = DEFAULT_MAX_ITEMS
    # A REALTIME stream's speech is read at most at real time plus this much ahead (inf: unpaced).
    realtime_burst_s: float = REALTIME_BURST_S
    default_endpointing: EndpointingConfig = field(default_factory=EndpointingConfig)
    frontends: int = 1
    # The decoder asked for; the app resolve()s it against each model: ``decoders`` holds the result per model
    # name. A model not in ``decoders`` gets ``decoder`` resolved against its directory here.
    decoder: DecoderConfig = field(default_factory=DecoderConfig)
    decoders: tuple[tuple[str, DecoderConfig], ...] = ()
    # Finals from a second-pass Whisper model (serve --final-model, --final-deadline-ms); None: off.
    second_pass: SecondPassConfig | None = None
    # New REALTIME sessions refused while this frontend's event loop runs later than this (loop_lag.py); 0: off.
    admit_lag_s: float = ADMIT_LAG_S
    # New REALTIME sessions refused while its REALTIME streams' audio is read later than this, the median
    # (lateness.py); 0: off.
    admit_late_s: float = ADMIT_LATE_S
    # New REALTIME sessions refused while one more would take the host's projected CPU past this share of its
    # cores (cpu.py); 0: off.
    admit_cpu: float = ADMIT_CPU
    # Named vocabularies (serve --vocabulary NAME=FILE): name -> its phrases (decoding.phrases.read_vocabulary).
    vocabularies: tuple[tuple[str, tuple[Phrase, ...]], ...] = ()
    # Per-utterance traces over OTLP (serve --otlp-endpoint, --trace-sample; tracing.py); None: off.
    tracing: TracingConfig | None = None
    # How long a resumable session whose connection dropped is held for its client to resume it.
    resume_window_s: float = RESUME_WINDOW_S
    # With several frontends: each one's own socket (index-ordered; server/forward.py), on which a resume that
    # landed on another frontend is passed to the one holding its session; and this frontend's index.
    peers: tuple[str, ...] = ()
    frontend_index: int = 0
    # The key replicas share to sign session snapshots (serve --resume-key-file; snapshot.py): a drain hands
    # resumable sessions over to another replica, and Control.SNAPSHOT asks for it. None: neither.
    resume_key: bytes | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not 0 <= self.admit_lag_s < math.inf:
            raise ValueError(f"--admit-lag-ms must be >= 0 (0: off), got {self.admit_lag_s * 1000:g}")
        if not 0 <= self.admit_late_s < math.inf:
            raise ValueError(f"--admit-late-ms must be >= 0 (0: off), got {self.admit_late_s * 1000:g}")
        if not 0 <= self.admit_cpu < math.inf:
            raise ValueError(f"--admit-cpu must be >= 0 (0: off), got {self.admit_cpu:g}")
        if not 0 < self.resume_window_s < math.inf:
            raise ValueError(f"--resume-window-s must be > 0, got {self.resume_window_s:g}")
        if not self.realtime_burst_s >= 0:
            raise ValueError(
                f"realtime_burst_s must be >= 0 (inf: REALTIME audio unpaced), got {self.realtime_burst_s}"
            )


class SessionHost:
    """The live sessions of one frontend process and what they share."""

    def __init__(
        self,
        engine: Engine,
        options: StreamOptions,
        metrics: FrontendMetrics | None = None,
        token_sessions: TokenSessions | None = None,
        second_pass: SecondPass | None = None,
        tracer: UtteranceTracer | None = None,
    ):
        """``token_sessions``: the per-token session counts shared by the server's frontends;
        ``second_pass``: the frontend's second-pass worker (finals from it), None: off; ``tracer``: utterances
        are traced (``tracing.py``), None: off."""
        self.engine = engine
        self.token_sessions = token_sessions or TokenSessions()
        self.options = options
        self.second_pass = second_pass
        self.tracer = tracer
        self.thin_interims = False  # (thin_interims_now)
        self.metrics = metrics or FrontendMetrics()
        self.vocabularies = dict(options.vocabularies)
        self.lag = LoopLag()  # (sampling from the first stream on)
        # (sampling from the frontend's start)
        self.cpu = CpuHeadroom(realtime_sessions=self.realtime_streams, batch_sessions=self.batch_streams)
        self.batch_pace = math.inf  # each BATCH stream read at most this fast (x real time): _pace_batch
        self._paced_at = 0  # the CPU sample the pace last moved on
        self._late_checked_s = 0.0
        self.draining = False
        self._streams: set[LiveSession] = set()
        self._resumable: dict[str, LiveSession] = {}  # resume token -> its stream, held or attached
        self.models = ModelDecoders(
            engine, options.decoder, options.decoders, options.vocabularies, self._phrase_lists
        )

    def new_resume_token(self) -> str:
        """Unguessable; with several frontends, prefixed with this one's index (``server/forward.py``)."""
        token = secrets.token_urlsafe(18)
        return f"{self.options.frontend_index}.{token}" if self.options.peers else token

    def forget(self, stream: LiveSession) -> None:
        """A resumable stream was released: its resume token names nothing any more."""
        self._resumable.pop(stream.resume_token, None)

    def thin_interims_now(self, thin: bool) -> None:
        """Thin every stream's interims (an engine sheds them, ``engine/headroom.py``), or no longer."""
        if thin == self.thin_interims:
            return
        self.thin_interims = thin
        log.log(
            logging.WARNING if thin else logging.INFO,
            "interims %s for %d stream(s) of this frontend",
            f"thinned to one per {THIN_INTERIM_MS} ms of audio" if thin else "no longer thinned",
            len(self._streams),
        )
        for stream in self._streams:
            stream.session.thin_interims = thin

    def vocabulary(self, name: str) -> tuple[str, tuple[Phrase, ...]] | None:
        """The named vocabulary ``name`` as (name, phrases); None for "" (none asked)."""
        return (name, self.vocabularies[name]) if name else None

    def _phrase_lists(self, model: str) -> list[tuple[tuple[Phrase, ...], str]]:
        """The phrases and named vocabularies ("": none) of the live streams on ``model`` (by name), to build
        for its next version before their streams move to it."""
        lists = {
            (stream.phrases, stream.vocabulary[0] if stream.vocabulary else "")
            for stream in self._streams
            if (stream.phrases or stream.vocabulary) and stream.model_name == model
        }
        return list(lists)

    @property
    def info(self) -> EngineInfo:
        """The engine's models and capacity, as of its last word (models change when one is loaded)."""
        return self.engine.info

    @property
    def active_streams(self) -> int:
        return len(self._streams)

    def _live_clocks(self):
        return (
            stream.clock
            for stream in self._streams
            if stream.clock is not None and stream.state == StreamState.STREAMING and not stream.detached.is_set()
        )

    def realtime_streams(self) -> int:
        """The REALTIME streams this frontend reads now (held for a resume, or no longer sending: left out)."""
        return sum(1 for _ in self._live_clocks())

    def batch_streams(self) -> int:
        """The BATCH streams this frontend reads now."""
        return sum(1 for s in self._streams if s.priority == Priority.BATCH and s.state == StreamState.STREAMING)

    @property
    def audio_late_s(self) -> float:
        """How far behind real time this frontend reads its REALTIME streams' audio, the median
        (``lateness.py``; streams held for a resume, or no longer sending, left out)."""
        return median_late_s(self._live_clocks(), time.monotonic())

    async def batch_turn(self, audio_s: float) -> bool:
        """A BATCH stream just read ``audio_s`` seconds of audio: wait as its pace says (:meth:`_pace_batch`;
        none at full speed); True if it waited."""
        now = time.monotonic()
        if now - self._late_checked_s >= CHECK_S:
            self._late_checked_s = now
            self._pace_batch()
        if self.batch_pace == math.inf or audio_s <= 0:
            return False
        await asyncio.sleep(audio_s / self.batch_pace)
        return True

    def _pace_batch(self) -> None:
        """How fast each BATCH stream is read (x real time): at real time while this frontend reads its
        REALTIME audio late; with ``admit_cpu``, while REALTIME streams are here, at real time from a sample
        of the host's CPU over the limit on, and raised by half on each sample a tenth of the cores under it
        (full speed again past :data:`BATCH_FULL_PACE`), so BATCH takes what the calls leave; at full speed
        otherwise."""
        pace, late_s = self.batch_pace, self.audio_late_s
        cores, limit = self.cpu.host.cores, self.options.admit_cpu * self.cpu.host.cores
        if late_s > BATCH_SLOW_LATE_S:
            pace = 1.0
        elif not limit or not self.realtime_streams():
            pace = math.inf
        elif self.cpu.sampled != self._paced_at:
            self._paced_at = self.cpu.sampled
            busy = self.cpu.busy_now
            if busy > limit:
                pace = 1.0
            elif busy < limit - 0.1 * cores and pace < math.inf:
                pace = pace * 1.5 if pace < BATCH_FULL_PACE else math.inf
        if (pace < math.inf) != (self.batch_pace < math.inf):
            log.log(
                logging.WARNING if pace < math.inf else logging.INFO,
                "BATCH streams of this frontend %s: its realtime audio is read %.0f ms behind real time, "
                "its host's CPU %.2f of %g cores busy",
                "read slower" if pace < math.inf else "read at full speed again",
                late_s * 1000,
                self.cpu.busy_now,
                cores,
            )
        self.batch_pace = pace

    def model_by_id(self, model: int) -> ModelInfo | None:
        return self.engine.model_by_id(model)

    # --- opening a session ---

    async def admit(self, config: SessionConfig, token: Token | None) -> SessionConfig:
        """``config`` (validated) with its phrases built, if this server takes a new session of it now for
        ``token`` (None: authentication is off); raises :class:`~.status.Refused` saying why not."""
        if self.draining:
            raise draining()
        if config.phrases or config.vocabulary:
            factory = self.models.decoder(self.info.models[config.model])
            vocabulary = self.vocabulary(config.vocabulary)
            try:  # (the G2P and the session's lexicon: milliseconds per new word, off the event loop)
                boosting = factory.cached(config.phrases, vocabulary) or await asyncio.to_thread(
                    factory.boosting, config.phrases, vocabulary
                )
            except PhraseError as err:
                raise Refused(Status.INVALID_ARGUMENT, f"phrases: {err}") from None
            config = dataclasses.replace(config, boosting=boosting)
        if token is not None and not token.allows(config.priority.name):
            allowed = ", ".join(sorted(token.priorities))
            raise Refused(
                Status.PERMISSION_DENIED,
                f"token {token.name!r} may not use priority {config.priority.name} (allowed: {allowed})",
                "permission_denied",
            )
        if not self.engine.connected:
            raise Refused(Status.UNAVAILABLE, "the engine is restarting; retry in a moment", None)
        self.lag.start()
        if config.priority == Priority.REALTIME and (behind := self._behind()):
            raise Refused(
                Status.RESOURCE_EXHAUSTED,
                f"the server is at capacity for realtime sessions ({behind}); retry in {RETRY_AFTER_S:g} s or on "
                "another server",
                "overloaded",
                RETRY_AFTER_S,
            )
        return config

    def _behind(self) -> str | None:
        """How this frontend runs past a limit set for new REALTIME sessions (its event loop's lag, or how
        late it reads its realtime audio); None: within them."""
        options = self.options
        if options.admit_lag_s and (lag_s := self.lag.median_s) > options.admit_lag_s:
            return f"its frontend runs {lag_s * 1000:.0f} ms behind, limit {options.admit_lag_s * 1000:g} ms"
        if options.admit_late_s and (late_s := self.audio_late_s) > options.admit_late_s:
            return (
                f"its frontend reads their audio {late_s * 1000:.0f} ms behind real time, "
                f"limit {options.admit_late_s * 1000:g} ms"
            )
        if options.admit_cpu and (window := self.cpu.window) is not None:
            projected = window.projected(self.realtime_streams())
            if projected > options.admit_cpu * window.cores:
                return (
                    f"one more would take its host's CPU to {projected:.2f} of {window.cores:g} cores, "
                    f"limit {options.admit_cpu:g}"
                )
        return None

    def start(self, stream: LiveSession) -> None:
        """Open a new ``stream`` (made for an admitted config): held from here until :meth:`close`, its token's
        quota claimed (raises :class:`~.status.Refused` past it), its engine slot asked for."""
        self._streams.add(stream)
        stream.claim_quota()
        config = stream.session.config
        log.info(
            "session %s opened: %s %d Hz %s, model %s%s%s",
            stream.session_id,
            config.encoding.name,
            config.sample_rate_hz,
            config.priority.name,
            stream.model_name,
            "" if stream.token is None else f" token {stream.token.name}",
            ", resumable" if stream.resume_token else "",
            extra={"session_id": stream.session_id},
        )
        if stream.resume_token:
            self._resumable[stream.resume_token] = stream
        self.engine.open(stream.key, config.priority, stream, stream.model_id)

    def count_refusal(self, refused: Refused, token: Token | None) -> None:
        """Count a stream refused for ``token`` (None: authentication is off) by its reason (none: not counted)."""
        if refused.reason:
            self.metrics.rejected(refused.reason, None if token is None else token.name)

    def close(self, stream: LiveSession) -> None:
        """The stream is over (every exit path but a park): its slot, quota and timers given back."""
        stream.release()
        self._streams.discard(stream)
        log.info(
            "session %s closed: %s", stream.session_id, stream.outcome, extra={"session_id": stream.session_id}
        )

    # --- resume ---

    def park(self, stream: LiveSession) -> bool:
        """Hold a resumable stream whose connection went away for the resume window; False: not resumable."""
        if not stream.resume_token or stream.state >= StreamState.RELEASED:
            return False
        stream.let_go()
        window_s = self.options.resume_window_s
        stream.expiry = asyncio.get_running_loop().call_later(window_s, self._expire, stream)
        stream.detached.set()
        log.info(
            "session %s: its connection went away; held %g s for a resume after %d samples and %d responses",
            stream.session_id,
            window_s,
            stream.consumed_samples,
            stream.response_index,
            extra={"session_id": stream.session_id},
        )
        return True

    def _expire(self, stream: LiveSession, why: str = "no resume within the window") -> None:
        if stream.detached.is_set() and stream.state < StreamState.RELEASED:
            self.metrics.expired()
            stream.outcome = why
            self.close(stream)

    def open_snapshot(self, blob: bytes, token: Token | None) -> Snapshot:
        """The snapshot a resume from another server brings, checked for ``token``; raises
        :class:`~.status.Refused` saying why it cannot be used here."""
        if self.options.resume_key is None:
            raise Refused(
                Status.FAILED_PRECONDITION,
                "resume_snapshot: this server has no --resume-key-file (it cannot check a snapshot); open a new "
                "stream, or resume on a server that shares the key",
                "resume_refused",
            )
        try:
            snapshot = Snapshot.open(blob, self.options.resume_key)
        except SnapshotError as err:
            status = Status.INVALID_ARGUMENT if err.tampered else Status.FAILED_PRECONDITION
            raise Refused(status, str(err), "resume_refused") from None
        if snapshot.token != (token.name if token is not None else None):
            raise Refused(
                Status.FAILED_PRECONDITION,
                "resume_snapshot: the session was opened with another token; resume it with that token",
                "resume_refused",
            )
        return snapshot

    def resumed_from(self, snapshot: Snapshot, config: SessionConfig, offset: int) -> SessionConfig:
        """``config`` (the snapshot's, validated here) going on where the snapshot says."""
        model = self.info.models[config.model]
        if (model.name, model.version) != (snapshot.model, snapshot.model_version):
            raise Refused(
                Status.FAILED_PRECONDITION,
                f"resume_snapshot: the session ran {snapshot.model} version {snapshot.model_version}; this server "
                f"serves {model.name} version {model.version}: open a new stream",
                "resume_refused",
            )
        if not 0 <= offset <= snapshot.offset_samples:
            raise Refused(
                Status.FAILED_PRECONDITION,
                f"resume_offset_samples={offset}: the snapshot goes on from sample {snapshot.offset_samples}; send "
                "the audio from there (or earlier)",
                "resume_refused",
            )
        self.metrics.resumed()
        return dataclasses.replace(
            config,
            first_frame=snapshot.frame,
            first_utterance=snapshot.utterances,
            first_response=snapshot.responses,
            skip_samples=snapshot.offset_samples - offset,
        )

    async def take(self, resume_token: str, offset: int, after: int, caller: Token | None) -> LiveSession:
        """The held session ``resume_token`` names, attached to the calling connection (its old one, if it
        still holds it, is let go: :data:`~.live.TAKEN`), going on from input sample ``offset`` with the
        responses after ``after`` to send again in ``replay``; raises :class:`~.status.Refused` saying why not
        (the session stays held)."""
        stream = self._resumable.get(resume_token)
        if (
            stream is not None
            and stream.token is not None
            and (caller is None or caller.name != stream.token.name)
        ):
            stream = None  # (another token's session: as if unknown, so a token reveals nothing of it)
        if stream is None or stream.state >= StreamState.RELEASED:
            raise Refused(
                Status.NOT_FOUND,
                "no session to resume with this resume_token: it ended, its resume window passed, or it was never "
                "issued here (a session is resumed on the server that holds it); open a new one",
                "resume_not_found",
            )
        if not stream.detached.is_set():  # its old connection still holds it (the server has not seen it drop)
            # Its handler ends that call (CANCELLED) once it takes the marker; one stuck sending to a dead
            # connection is cancelled instead (the old call then ends when its transport does).
            stream.taking = True
            stream.responses.put(TAKEN)
            try:
                await asyncio.wait_for(stream.detached.wait(), 1.0)
            except TimeoutError:
                if stream.handler is not None:
                    stream.handler.cancel()
                try:
                    await asyncio.wait_for(stream.detached.wait(), 4.0)
                except TimeoutError:
                    raise Refused(
                        Status.UNAVAILABLE, "the session's old connection did not let it go; retry", None
                    ) from None
            finally:
                stream.taking = False
            if stream.state >= StreamState.RELEASED:
                raise Refused(Status.NOT_FOUND, "the session ended while it was taken over", None)
        if offset < 0:
            raise Refused(Status.INVALID_ARGUMENT, f"resume_offset_samples={offset} is negative")
        skip = stream.consumed_bytes - offset * stream.bytes_per_sample
        if skip < 0:
            raise Refused(
                Status.FAILED_PRECONDITION,
                f"resume_offset_samples={offset} is past the {stream.consumed_samples} samples this session has "
                f"consumed: send the audio from sample {stream.consumed_samples} (or earlier) on",
            )
        if after > stream.response_index:
            raise Refused(
                Status.INVALID_ARGUMENT,
                f"resume_after_response={after}: this session has sent {stream.response_index} responses",
            )
        if after < stream.response_index and stream.sent[0][0] > after + 1:
            raise Refused(
                Status.FAILED_PRECONDITION,
                f"the responses after {after} are no longer held (the last {RESUME_REPLAY} are, from "
                f"{stream.sent[0][0]}): open a new session",
            )
        # Taken: no await from here on, so no other resume can take it meanwhile.
        stream.detached.clear()
        if stream.expiry is not None:
            stream.expiry.cancel()
            stream.expiry = None
        stream.skip_bytes = skip
        stream.replay = [response for index, response in stream.sent if index > after]
        self.metrics.resumed()
        log.info(
            "session %s resumed at sample %d (skipping %d bytes), after response %d: %d sent again",
            stream.session_id,
            offset,
            skip,
            after,
            len(stream.replay),
            extra={"session_id": stream.session_id},
        )
        return stream

    # --- drain ---

    async def drain(self, grace_s: float, final_wait_s: float = 5.0) -> None:
        """Refuse new streams; serve the open ones for ``grace_s``; then cut those still open (their final
        for the audio received, then UNAVAILABLE) and wait up to ``final_wait_s`` for those finals."""
        self.draining = True
        if self.options.resume_key is not None:  # (handed over at their next utterance boundary)
            for stream in list(self._streams):
                if stream.resume_token and not stream.detached.is_set():
                    stream.hand_over(Ended(Status.UNAVAILABLE, HANDED_OVER))
        ended = await self._streams_ended_within(grace_s)
        self._expire_held("the server drained")
        if ended:
            return
        log.info("drain grace over: cutting %d open sessions after their finals", len(self._streams))
        if self.second_pass is not None:  # (finals that wait for it come before the wait below ends)
            self.second_pass.hurry(max(0.0, final_wait_s - 1.0))
        for stream in list(self._streams):
            stream.cut(
                Status.UNAVAILABLE,
                "the server is shutting down: the final above covers the audio received; retry the rest on "
                "another server",
            )
        await self._streams_ended_within(final_wait_s)
        self._expire_held("the server drained")

    def _expire_held(self, why: str) -> None:
        """Free every held (resumable, disconnected) session now."""
        for stream in list(self._streams):
            self._expire(stream, why)

    def _attached(self) -> bool:
        return any(not stream.detached.is_set() for stream in self._streams)

    async def _streams_ended_within(self, seconds: float) -> bool:
        """Wait up to ``seconds`` for every open stream with a connection to end (a held one is resumed
        within its window or not at all); True if they all did."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        while self._attached() and loop.time() < deadline:
            await asyncio.sleep(0.02)
        return not self._attached()
