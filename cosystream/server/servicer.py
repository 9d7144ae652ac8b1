"""The gRPC servicer of ``cosystream.v1.CosyStream``: validation, streams, responses, errors.

Each bidi stream is an async generator that yields the responses its ``Session`` emits, while a task
reads the requests. A client half-close flushes the session and ends the stream with OK after the last
final. A stream that the server ends early (idle timeout, the end of a drain's grace) is *cut*: reading
stops, the audio received is flushed, its final is sent, then the status says why; OK means every byte sent
was transcribed. The stream's engine slot is owned by one ``try`` whose ``finally`` frees it, entered before
the first ``await``: a cancel, a rejection or an error at any point frees it.

A stream runs on the model its config names (the default when it names none), with that model's own decoder
(its vocabulary, lexicon and language model) and output delay; every result names the model and its version.
A model loaded while serving gets its decoder before it serves (``frontend/model_decoders.py``); a session moved to a
new version of its model between utterances decodes the next ones with the new version's decoder.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import secrets
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from enum import IntEnum

import grpc

from cosystream import __version__
from cosystream.audio.codecs import MAX_INPUT_RATE_HZ, MIN_INPUT_RATE_HZ, AudioEncoding
from cosystream.audio.endpointing import EndpointingConfig
from cosystream.audio.streams import COMPRESSED, OPUS_RATES_HZ, AudioFormatError, codecs_available
from cosystream.decoding.config import DecoderConfig
from cosystream.decoding.greedy import MAX_ALTERNATIVES
from cosystream.decoding.phrases import Phrase, PhraseError
from cosystream.decoding.phrases import normalize as normalize_phrases
from cosystream.engine.headroom import RETRY_AFTER_S, THIN_INTERIM_MS, Degradation, LoadReport
from cosystream.engine.ipc import EngineInfo, ModelInfo
from cosystream.engine.scheduler import Priority
from cosystream.frames import FRAME_MS, SAMPLE_RATE_HZ
from cosystream.frontend.engine_client import Engine
from cosystream.frontend.engine_pool import EnginePool
from cosystream.frontend.final_pass import MAX_AUDIO_S, SECOND_PASS, STREAMING, FinalPass
from cosystream.frontend.model_decoders import ModelDecoders
from cosystream.frontend.quota import Claim, QuotaExceeded, TokenSessions
from cosystream.frontend.responses import DEFAULT_MAX_ITEMS, ResponseQueue
from cosystream.frontend.results import Response
from cosystream.frontend.session import REALTIME_BURST_S, AudioPacer, Session, SessionConfig
from cosystream.frontend.snapshot import Snapshot, SnapshotError
from cosystream.frontend.tracing import TracingConfig, UtteranceTracer
from cosystream.frontend.usage import Lease, UsageExceeded
from cosystream.metrics import FrontendMetrics
from cosystream.secondpass.worker import SecondPass, SecondPassConfig
from cosystream.server.auth import current_token
from cosystream.server.forward import Peers, forward, token_frontend
from cosystream.server.loop_lag import ADMIT_LAG_S, LoopLag
from cosystream.server.messages import response_message
from cosystream.server.retry import retry_metadata
from cosystream.v1 import cosystream_pb2 as pb
from cosystream.v1 import cosystream_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


CUT_TIMEOUT_S = 10.0
"""How long a cut stream (idle timeout, drain) may take to deliver its final before it is cancelled."""

AUDIO_SLICE_BYTES = 16_000
"""A large audio message is processed in slices of this many bytes (0.5 s of 16 kHz LINEAR16) with the event
loop free between them, so one client's 10 MB chunk delays other sessions by a slice's work (~1-2 ms), not
the whole message's."""


RESUME_WINDOW_S = 30.0
"""How long a resumable session is held after its connection drops (``serve --resume-window-s``)."""

RESUME_REPLAY = 1024
"""Responses a resumable stream keeps after sending them, to send again to a client that resumes having
missed them (at one interim per 40-80 ms of speech, a minute or more)."""

RESUME_EOF_WAIT_S = 0.1
"""After a resumable stream's requests end, how long the server waits to see whether its connection dropped
(then the session is held) before taking it as a half-close (then its last final is flushed): the price of
resume is up to this much on a half-close's final."""

RESUME_PROGRESS_S = 1.0
"""A resumable stream gets a response at least every this much of its audio consumed (one with no results
during silence), so its client need keep only about that much audio for a resume."""

HANDED_OVER = (
    "the server is draining: this session goes on on another server from the resume_snapshot sent "
    "(StreamingConfig.resume_snapshot, with the audio from its consumed_samples)"
)

RESUMABLE = {AudioEncoding.LINEAR16: 2, AudioEncoding.MULAW: 1, AudioEncoding.ALAW: 1}  # bytes per sample


@dataclass(frozen=True, slots=True)
class StreamOptions:
    idle_timeout_s: float = 30.0
    max_in_flight_frames: int = 128
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
    # Named vocabularies (serve --vocabulary NAME=FILE): name -> its phrases (decoding.phrases.read_vocabulary).
    vocabularies: tuple[tuple[str, tuple[Phrase, ...]], ...] = ()
    # Per-utterance traces over OTLP (serve --otlp-endpoint, --trace-sample; frontend/tracing.py); None: off.
    tracing: TracingConfig | None = None
    # How long a resumable session whose connection dropped is held for its client to resume it.
    resume_window_s: float = RESUME_WINDOW_S
    # With several frontends: each one's own socket (index-ordered; forward.py), on which a resume that
    # landed on another frontend is passed to the one holding its session; and this frontend's index.
    peers: tuple[str, ...] = ()
    frontend_index: int = 0
    # The key replicas share to sign session snapshots (serve --resume-key-file; frontend/snapshot.py): a drain hands
    # resumable sessions over to another replica, and Control.SNAPSHOT asks for it. None: neither.
    resume_key: bytes | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not 0 <= self.admit_lag_s < math.inf:
            raise ValueError(f"--admit-lag-ms must be >= 0 (0: off), got {self.admit_lag_s * 1000:g}")
        if not 0 < self.resume_window_s < math.inf:
            raise ValueError(f"--resume-window-s must be > 0, got {self.resume_window_s:g}")
        if not self.realtime_burst_s >= 0:
            raise ValueError(
                f"realtime_burst_s must be >= 0 (inf: REALTIME audio unpaced), got {self.realtime_burst_s}"
            )


class ConfigError(ValueError):
    """A StreamingConfig the server cannot run; the message says what to fix."""


def stream_encodings() -> list[AudioEncoding]:
    """The encodings a stream may declare here: PCM and G.711, and the compressed ones where PyAV is
    installed (the codecs extra)."""
    pcm = [AudioEncoding.LINEAR16, AudioEncoding.MULAW, AudioEncoding.ALAW]
    return pcm + sorted(COMPRESSED) if codecs_available() else pcm


FINAL_PASSES = ("", STREAMING, SECOND_PASS)


HOTWORD_CHARS = 1000  # of a session's phrases and its named vocabulary's, for the second pass's prompt (which
# holds some 224 tokens: faster-whisper's hotwords limit)


def validate_config(
    config: pb.StreamingConfig,
    info: EngineInfo,
    defaults: EndpointingConfig,
    second_pass: bool = False,
    vocabularies: dict[str, tuple[Phrase, ...]] | None = None,
) -> SessionConfig:
    """``second_pass``: whether the server runs one (a stream that asks for it is refused otherwise);
    ``vocabularies``: the server's named vocabularies, by name."""
    if config.encoding not in AudioEncoding._value2member_map_:
        raise ConfigError(
            f"unknown encoding {config.encoding}: use {', '.join(e.name for e in stream_encodings())}"
        )
    encoding = AudioEncoding(config.encoding or AudioEncoding.LINEAR16)
    rate = config.sample_rate_hz
    if encoding in COMPRESSED:
        if not codecs_available():
            raise ConfigError(
                f"encoding {encoding.name}: this server does not decode compressed audio (install the codecs "
                "extra: pip install 'cosystream[codecs]'); send LINEAR16, MULAW or ALAW"
            )
        is_opus = encoding != AudioEncoding.FLAC
        if is_opus and rate not in (0, *OPUS_RATES_HZ):
            rates = ", ".join(str(r) for r in OPUS_RATES_HZ)
            raise ConfigError(f"sample_rate_hz={rate} is not an Opus rate: use 0 (the header's) or {rates}")
    elif rate == 0:
        raise ConfigError(f"sample_rate_hz is required ({MIN_INPUT_RATE_HZ} to {MAX_INPUT_RATE_HZ})")
    if rate and not MIN_INPUT_RATE_HZ <= rate <= MAX_INPUT_RATE_HZ:
        raise ConfigError(
            f"sample_rate_hz={rate} is not supported: use {MIN_INPUT_RATE_HZ} to {MAX_INPUT_RATE_HZ}"
        )
    if config.resumable and encoding not in RESUMABLE:
        raise ConfigError(
            f"resumable: encoding {encoding.name} cannot be resumed mid-stream; use LINEAR16, MULAW or ALAW"
        )
    if config.priority not in (0, Priority.REALTIME, Priority.BATCH):
        raise ConfigError(f"unknown priority {config.priority}: use REALTIME or BATCH")
    model = info.model_index(config.model)
    if model is None:
        served = ", ".join(repr(m.name) for m in info.models)
        raise ConfigError(
            f"unknown model {config.model!r}: this server runs {served} (empty or 'default': {info.model_name!r})"
        )
    requested = config.endpointing
    try:
        endpointing = EndpointingConfig(
            silence_ms=requested.silence_ms or defaults.silence_ms,
            max_utterance_ms=requested.max_utterance_ms or defaults.max_utterance_ms,
            preroll_ms=defaults.preroll_ms,
            speech_start_ms=defaults.speech_start_ms,
            vad_aggressiveness=requested.vad_aggressiveness or defaults.vad_aggressiveness,
        )
    except ValueError as err:
        raise ConfigError(f"endpointing: {err}") from None
    if config.final_pass not in FINAL_PASSES:
        raise ConfigError(
            f"unknown final_pass {config.final_pass!r}: use streaming, second_pass, or leave it empty"
        )
    if config.final_pass == SECOND_PASS and not second_pass:
        raise ConfigError(
            "final_pass 'second_pass': this server runs no second pass (serve --final-model); leave final_pass "
            "empty for the server's choice"
        )
    if not 0 <= config.max_alternatives <= MAX_ALTERNATIVES:
        raise ConfigError(
            f"max_alternatives={config.max_alternatives} is not supported: use 0 to {MAX_ALTERNATIVES}"
        )
    try:
        phrases = normalize_phrases((phrase.text, phrase.boost) for phrase in config.phrases)
    except PhraseError as err:
        raise ConfigError(f"phrases: {err}") from None
    vocabularies = vocabularies or {}
    if config.vocabulary and config.vocabulary not in vocabularies:
        there = ", ".join(sorted(vocabularies)) or "none (serve --vocabulary NAME=FILE)"
        raise ConfigError(f"unknown vocabulary {config.vocabulary!r}: this server has {there}")
    hotwords = [phrase.text.strip() for phrase in config.phrases]
    if config.vocabulary:  # (the second pass's prompt: the session's own first, then the vocabulary's)
        length = sum(len(word) + 2 for word in hotwords)
        for phrase in vocabularies[config.vocabulary]:
            text = " ".join(phrase.words)
            length += len(text) + 2
            if length > HOTWORD_CHARS:
                break
            hotwords.append(text)
    return SessionConfig(
        encoding=encoding,
        sample_rate_hz=rate,
        priority=Priority(config.priority or Priority.REALTIME),
        interim_results=config.interim_results,
        endpointing=endpointing,
        word_time_offsets=config.enable_word_time_offsets,
        model=model,
        second_pass=second_pass and config.final_pass != STREAMING,
        punctuation=config.enable_automatic_punctuation,
        max_alternatives=max(1, config.max_alternatives),
        phrases=phrases,
        vocabulary=config.vocabulary,
        hotwords=", ".join(hotwords),
        resumable=config.resumable,
        wire=_wire(config) if config.resumable else b"",
    )


def _wire(config: pb.StreamingConfig) -> bytes:
    """``config`` as a snapshot carries it: without the fields that resumed it."""
    wire = pb.StreamingConfig()
    wire.CopyFrom(config)
    for name in ("resume_token", "resume_offset_samples", "resume_after_response", "resume_snapshot"):
        wire.ClearField(name)
    return wire.SerializeToString()


def load_status(loads: list[LoadReport | None], lag_s: float = 0.0) -> pb.LoadStatus:
    """The engines' load reports as GetServerInfo gives them: the most loaded engine's load, counts summed,
    overloaded when every engine reporting is; ``lag_s``: the answering frontend's loop lag."""
    known = [load for load in loads if load is not None]
    if not known:
        return pb.LoadStatus(frontend_lag_ms=lag_s * 1000)
    return pb.LoadStatus(
        frontend_lag_ms=lag_s * 1000,
        engine_load=max(load.load for load in known),
        realtime_sessions=sum(load.realtime for load in known),
        batch_sessions=sum(load.batch for load in known),
        free_slots=sum(load.free_slots for load in known),
        queued_frames=sum(load.queued_frames for load in known),
        overloaded=all(load.overloaded for load in known),
        admit_load=known[0].admit_load,
        refused_for_load=sum(load.refused for load in known),
        degradation=max(load.stage for load in known).name.lower(),
    )


def thinning(loads: list[LoadReport | None]) -> bool:
    """Whether streams' interims are thinned: an engine sheds that much (``engine/headroom.py``)."""
    return any(load is not None and load.stage >= Degradation.INTERIMS_THINNED for load in loads)


def model_message(model: ModelInfo, is_default: bool) -> pb.ModelInfo:
    """A served model as GetServerInfo and Admin.LoadModel describe it."""
    return pb.ModelInfo(
        name=model.name,
        language=model.language,
        sample_rate_hz=SAMPLE_RATE_HZ,
        frame_ms=FRAME_MS,
        parameters=model.parameters,
        vocabulary=model.vocabulary,
        is_default=is_default,
        version=model.version,
        vocabulary_kind=model.vocabulary_kind,
        output_delay_ms=model.output_delay_frames * FRAME_MS,
        precision=model.precision,
    )


@dataclass(slots=True)
class _Abort:
    code: grpc.StatusCode
    message: str
    retry_after_s: float | None = None  # a temporary refusal: when to retry (RetryInfo)


_DONE = object()


@dataclass(frozen=True, slots=True)
class _Handoff:
    """Queued at a session's utterance boundary when it is handed over: sent as its snapshot."""

    frame: int
    utterances: int


@dataclass(frozen=True, slots=True)
class _Forward:
    """A resume of a session another frontend of this server holds: passed on to it (``forward.py``)."""

    first: pb.StreamingRecognizeRequest
    frontend: int


_TAKEN = object()  # (a resume on another connection takes the stream: its handler lets it go)


class _Refused(Exception):
    """A stream refused before it has a session: its status, and the metrics' reject reason (None: none)."""

    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        reason: str | None = "invalid_argument",
        retry_after_s: float | None = None,
    ):
        super().__init__(message)
        self.code, self.message, self.reason, self.retry_after_s = code, message, reason, retry_after_s


def _draining() -> _Refused:
    return _Refused(grpc.StatusCode.UNAVAILABLE, "the server is shutting down; retry on another one", "draining")


def _status_response(
    session_id: str, code: grpc.StatusCode, message: str, retry_after_s: float | None = None
) -> pb.StreamingRecognizeResponse:
    """A stream's error status as its last response (grpcio's asyncio client can lose the status itself)."""
    delay_ms = 0 if retry_after_s is None else math.ceil(retry_after_s * 1000)
    return pb.StreamingRecognizeResponse(
        session_id=session_id,
        error=pb.StreamError(code=code.value[0], message=message, retry_delay_ms=delay_ms),
    )


def _last_response(session_id: str, refusal: _Abort | _Refused) -> pb.StreamingRecognizeResponse:
    return _status_response(session_id, refusal.code, refusal.message, refusal.retry_after_s)


async def _abort(context, refusal: _Abort | _Refused) -> None:
    """End the stream with ``refusal``'s status (with a RetryInfo when it says when to retry)."""
    code, message = refusal.code, refusal.message
    await context.abort(code, message, retry_metadata(code, message, refusal.retry_after_s))


class StreamState(IntEnum):
    """Where a stream is in its life; it only moves forward (a failure may skip FINISHING)."""

    STREAMING = 0  # reading requests
    FINISHING = 1  # no more audio (half-close or a cut): flushing to the last final
    ENDED = 2  # its last response (OK or a status) is queued; nothing more is read or sent
    RELEASED = 3  # its engine slot is freed, its timers stopped


class _Stream:
    """The glue between one gRPC stream, its Session and the engine channel."""

    def __init__(self, servicer: CosyStreamServicer, config: SessionConfig, trace_parent=None):
        self.servicer = servicer
        self.engine = servicer.engine
        self.key = self.engine.new_key()
        self.session_id = uuid.uuid4().hex[:16]
        self.priority = config.priority
        self.responses = ResponseQueue(servicer.options.max_queued_responses)
        self.progress = asyncio.Event()
        self.state = StreamState.STREAMING
        self.end_status: _Abort | None = None  # a cut stream's status, sent after its final
        metrics = servicer.metrics
        priority_label = config.priority.name.lower()
        model: ModelInfo = servicer.info.models[config.model]
        self.model_id = model.id  # the engine's id of the model version it runs
        self.model_name = model.name
        self.phrases = config.phrases
        self.vocabulary = servicer.vocabulary(config.vocabulary)  # (name, phrases), or None
        self.boosting = config.boosting
        self.factory = servicer.models.decoder(model)
        self._held: list | None = None  # engine events held while a moved stream's decoder is built
        self.session = Session(
            self.key,
            self.session_id,
            config,
            self.factory(config.boosting),
            self.engine,
            self.responses.put,
            max_in_flight_frames=servicer.options.max_in_flight_frames,
            on_first_result=metrics.observe_first_result,
            on_result_latency=lambda s: metrics.observe_result(priority_label, s),
            output_delay_frames=model.output_delay_frames,
            model_name=model.name,
            model_version=model.version,
            pacer=AudioPacer(servicer.options.realtime_burst_s) if config.priority == Priority.REALTIME else None,
            final_pass=None
            if servicer.second_pass is None or not config.second_pass
            else FinalPass(
                servicer.second_pass,
                self.key,
                config.priority == Priority.REALTIME,
                MAX_AUDIO_S * 1000 // FRAME_MS,
                self._second_pass_answered,
                config.punctuation,
                config.word_time_offsets,
                config.hotwords,
            ),
            tracer=servicer.tracer,
            trace_parent=trace_parent,
        )
        self.session.thin_interims = servicer.thin_interims
        self.reader: asyncio.Task | None = None
        self.handler: asyncio.Task | None = None  # the gRPC handler's task (a cut may cancel it)
        self.token = current_token()  # who opened it (None: authentication is off)
        self.quota: Claim | None = None  # while set, the stream is counted in its token's quota and gauge
        self.audio: Lease | None = None  # while set, its audio is counted against its token's usage limits
        self._force: asyncio.TimerHandle | None = None
        self.idle_timer: asyncio.TimerHandle | None = None
        self.last_request_s = time.monotonic()
        # Until the engine answers the open, the stream cannot end OK: a refused open (the engine full) must
        # reach the client as RESOURCE_EXHAUSTED even if it half-closed before the answer came.
        self.opened = False
        # Resume (config.resumable): the token, the input consumed (bytes; samples for the client), the responses
        # sent (numbered, the last RESUME_REPLAY kept), and while no connection holds it, the expiry timer.
        self.resume_token = servicer.new_resume_token() if config.resumable else ""
        self.bytes_per_sample = RESUMABLE.get(config.encoding, 1)
        # (a session resumed from a snapshot goes on from its offset, its responses numbered on from it)
        self.frame_samples = config.sample_rate_hz // 100  # input samples per 10 ms frame (every rate: whole)
        self.consumed_bytes = config.first_frame * self.frame_samples * self.bytes_per_sample
        self.skip_bytes = config.skip_samples * self.bytes_per_sample  # (audio the session already has)
        self.response_index = config.first_response
        self.reported_samples = 0  # consumed_samples as of the last response sent
        self.progress_samples = int(RESUME_PROGRESS_S * config.sample_rate_hz)
        self.sent: deque[tuple[int, pb.StreamingRecognizeResponse]] = deque(maxlen=RESUME_REPLAY)
        self.expiry: asyncio.TimerHandle | None = None
        self.detached = asyncio.Event()  # set while held (no connection holds it)
        self.replay: list[pb.StreamingRecognizeResponse] = []  # (a resume's responses to send again)
        self.outcome = "ok"  # how the stream ended, for the log
        self.taking = False  # a resume is taking it from its connection (_TAKEN queued)
        # Hand the session over at its next utterance boundary (a drain, Control.SNAPSHOT): its snapshot, then
        # this end (an _Abort, or _DONE: OK).
        self.handover: object | None = None
        self.context = None  # its connection's gRPC context (start)

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """The stream's initial metadata: its session id, and its resume token if it is resumable."""
        session = (("cosystream-session-id", self.session_id),)
        return (*session, ("cosystream-resume-token", self.resume_token)) if self.resume_token else session

    @property
    def consumed_samples(self) -> int:
        return self.consumed_bytes // self.bytes_per_sample

    @property
    def resume_samples(self) -> int:
        """What a resumable stream reports consumed: the input it has, less what a snapshot taken later may
        start before it (a pre-roll): a client that keeps the audio from here can resume on any server."""
        return min(self.consumed_samples, self.session.resume_frame * self.frame_samples)

    def stamp(self, response: Response | pb.StreamingRecognizeResponse) -> pb.StreamingRecognizeResponse:
        """The message of the session's ``response`` (or one of the stream's own): numbered if the stream is
        resumable, saying how much input it has consumed, and kept to send again."""
        if isinstance(response, Response):
            response = response_message(response)
        if self.resume_token:
            self.response_index += 1
            response.response_index = self.response_index
            if not response.resume_snapshot:  # (a snapshot's says where it resumes)
                response.consumed_samples = self.resume_samples
            self.reported_samples = response.consumed_samples
            response.resume_token = self.resume_token
            self.sent.append((self.response_index, response))
        return response

    # SessionSink, called by the engine client.
    def on_opened(self, model: int) -> None:
        log.debug("session %s has an engine slot", self.session_id)
        self.opened = True
        if model != self.model_id:  # (replaced since the stream was accepted: the engine gave the new version)
            self.on_moved(model)
        self._check_done()

    def on_moved(self, model: int) -> None:
        if self._held is not None:  # (the last move's decoder is still being built)
            self._held.append(lambda: self.on_moved(model))
            return
        info = self.servicer.model_by_id(model)
        if info is None:  # (the engine announces a model before it names it: a bug)
            log.error(
                "session %s: moved to model id %d, which this frontend was not told of", self.session_id, model
            )
            self._fail(grpc.StatusCode.INTERNAL, "the server lost track of its models")
            return
        self.model_id = model
        self.model_name = info.name  # (the same name, or LIGHT for HEAVY under load: serve --adaptive)
        factory = self.servicer.models.decoder(info)
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
        self.servicer.metrics.rejected("shed" if shed else "overloaded" if retry_after_s is not None else "full")
        self._fail(grpc.StatusCode.RESOURCE_EXHAUSTED, message, retry_after_s)

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

    # --- handing the session over to another server (frontend/snapshot.py) ---

    def hand_over(self, ending: object) -> None:
        """At the session's next utterance boundary (now, if it is at one), send its snapshot, then end:
        ``ending`` an :class:`_Abort` (a drain: UNAVAILABLE), or ``_DONE`` (Control.SNAPSHOT: OK)."""
        if self.state == StreamState.STREAMING and self.handover is None:
            self.handover = ending
            self._check_handover()

    def _check_handover(self) -> None:
        point = self.session.boundary() if self.state == StreamState.STREAMING else None
        if point is None:
            return
        ending, self.handover = self.handover, None
        self.responses.put(_Handoff(*point))
        log.info(
            "session %s: handed over at frame %d (utterance %d next)",
            self.session_id,
            *point,
            extra={"session_id": self.session_id},
        )
        if isinstance(ending, _Abort):
            self.cut(ending.code, ending.message, ending.retry_after_s)
        else:
            if self.reader is not None and self.reader is not asyncio.current_task():
                self.reader.cancel()
            self.finish()

    def snapshot_response(self, handoff: _Handoff) -> pb.StreamingRecognizeResponse:
        """The handed-over session's snapshot, sealed as the next response (whose index it knows)."""
        config = self.session.config
        token = self.token.name if self.token is not None else None
        snapshot = Snapshot(
            config=config.wire,
            model=self.model_name,
            model_version=self.session.model_version,
            offset_samples=handoff.frame * self.frame_samples,
            frame=handoff.frame,
            utterances=handoff.utterances,
            responses=self.response_index + 1,
            token=token,
            expires_s=time.time() + self.servicer.options.resume_window_s,
        )
        return pb.StreamingRecognizeResponse(
            session_id=self.session_id,
            consumed_samples=snapshot.offset_samples,
            resume_snapshot=snapshot.seal(self.servicer.options.resume_key),
        )

    def on_engine_lost(self) -> None:
        self._fail(grpc.StatusCode.UNAVAILABLE, "the engine process stopped; retry on another server")

    def _fail(self, code: grpc.StatusCode, message: str, retry_after_s: float | None = None) -> None:
        """End now with ``code`` (what is still queued before it is sent first); ``retry_after_s``: a temporary
        refusal's retry delay (RetryInfo)."""
        if self.state < StreamState.ENDED:
            self.state = StreamState.ENDED
            self.responses.put(_Abort(code, message, retry_after_s))
            self.responses.wake()
            self.progress.set()

    def _check_done(self) -> None:
        if self.state == StreamState.FINISHING and self.opened and self.session.done:
            self.state = StreamState.ENDED
            self.responses.put(self.end_status or _DONE)
            self.responses.wake()

    def finish(self) -> None:
        """No more audio (half-close, or a cut): flush and end after the last final."""
        if self.state == StreamState.STREAMING:
            self.state = StreamState.FINISHING
            self.session.finish()
            if self.session.audio_error and self.end_status is None:
                self.end_status = _Abort(grpc.StatusCode.INVALID_ARGUMENT, self.session.audio_error)
            self._check_done()

    def cut(self, code: grpc.StatusCode, message: str, retry_after_s: float | None = None) -> None:
        """The server ends the stream: stop reading, flush the audio received, send its final, then end
        with ``code`` (not OK: the client had more to send)."""
        if self.state != StreamState.STREAMING:
            return
        self.end_status = _Abort(code, message, retry_after_s)
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

    def start(self, requests: AsyncIterator[pb.StreamingRecognizeRequest], context=None) -> None:
        self.handler = asyncio.current_task()
        self.context = context
        self.last_request_s = time.monotonic()
        self.reader = asyncio.create_task(self.read(requests))
        self._watch_idle()

    async def _dropped(self) -> bool:
        """Whether the end of the requests was a dropped connection rather than a half-close: grpc.aio ends
        the request iterator the same way for both, and marks the call cancelled a moment later when the
        connection is gone (observed within a loop iteration or two; RESUME_EOF_WAIT_S allows for a busy loop)."""
        cancelled = getattr(self.context, "cancelled", None)
        if cancelled is None:
            return False
        deadline = time.monotonic() + RESUME_EOF_WAIT_S
        while not cancelled():
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.005)
        return True

    def claim_quota(self) -> None:
        """Count this stream against its token's ``max_sessions`` and audio limits (``release`` gives them
        back); raises :class:`_Refused` (RESOURCE_EXHAUSTED) when the token has its sessions all open, or
        has used its audio: a REALTIME stream for the minute or the day, a BATCH stream for the day (for the
        minute it is accepted and waits)."""
        token = self.token
        if token is None:
            return
        try:
            self.quota = self.servicer.token_sessions.claim(token.name, token.max_sessions)
        except QuotaExceeded as err:
            raise _Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, str(err), "quota") from None
        self.servicer.metrics.token_session(token.name, opened=True)
        if token.usage.limited:
            self.audio = self.servicer.token_sessions.audio_lease(token.name, token.usage)
            try:
                self.audio.ensure()
            except UsageExceeded as err:
                if self.priority == Priority.REALTIME or err.per == "day":
                    raise _Refused(
                        grpc.StatusCode.RESOURCE_EXHAUSTED, str(err), "usage_quota", err.retry_after_s
                    ) from None

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
                    self.servicer.metrics.rejected("usage_quota", self.token.name)
                    self.cut(grpc.StatusCode.RESOURCE_EXHAUSTED, str(err), err.retry_after_s)
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
            self.servicer._resumable.pop(self.resume_token, None)
            if self.expiry is not None:
                self.expiry.cancel()
                self.expiry = None
        if self.quota is not None:
            self.quota.release()
            self.quota = None
            self.servicer.metrics.token_session(self.token.name, opened=False)
        if self.audio is not None:
            self.audio.close()
            self.servicer.metrics.token_audio(self.token.name, self.audio.spent_s)
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
        timeout_s = self.servicer.options.idle_timeout_s
        idle_s = time.monotonic() - self.last_request_s
        if idle_s >= timeout_s:
            self.servicer.metrics.rejected("idle_timeout")
            # What was heard still gets its final, then the status.
            self.cut(grpc.StatusCode.DEADLINE_EXCEEDED, f"no request for {timeout_s:g} s: the session was closed")
            return
        self.idle_timer = asyncio.get_running_loop().call_later(timeout_s - idle_s, self._watch_idle)

    async def read(self, requests: AsyncIterator[pb.StreamingRecognizeRequest]) -> None:
        session = self.session
        limit = self.servicer.options.max_in_flight_frames
        try:
            while True:
                # A client that does not read its responses is not read either (flow control).
                while self.responses.full and self.state < StreamState.ENDED:
                    await self.responses.wait_for_room()
                try:
                    request = await anext(requests)
                except StopAsyncIteration:
                    if self.resume_token and await self._dropped():
                        return  # (not a half-close: the handler is being cancelled, and the stream held)
                    break
                self.last_request_s = time.monotonic()
                kind = request.WhichOneof("request")
                if kind == "audio":
                    audio = request.audio
                    if self.skip_bytes:  # (resumed: what the session already has)
                        skipped = min(self.skip_bytes, len(audio))
                        audio, self.skip_bytes = audio[skipped:], self.skip_bytes - skipped
                    for offset in range(0, len(audio), AUDIO_SLICE_BYTES):
                        if offset:
                            await asyncio.sleep(0)  # other sessions run between the slices of a big chunk
                            if self.state != StreamState.STREAMING:
                                return
                        if self.audio is not None and not await self._audio_allowed():
                            return
                        heard = session.audio_samples
                        try:
                            wait_s = session.feed_audio(
                                audio[offset : offset + AUDIO_SLICE_BYTES], self.last_request_s
                            )
                        except AudioFormatError as err:
                            # What decoded before it still gets its final, then the status.
                            self.servicer.metrics.rejected("invalid_argument")
                            self.cut(grpc.StatusCode.INVALID_ARGUMENT, str(err))
                            return
                        self.consumed_bytes += min(AUDIO_SLICE_BYTES, len(audio) - offset)
                        if self.audio is not None:
                            self.audio.spend((session.audio_samples - heard) / SAMPLE_RATE_HZ)
                        while session.backlog_frames > limit and self.state < StreamState.ENDED:
                            self.progress.clear()
                            await self.progress.wait()
                        if wait_s > 0:
                            # Ahead of real time past its burst: nothing more is read until the clock
                            # catches up (flow control slows the sender; no audio is dropped). The wait
                            # is the server's, not the client's idleness.
                            await asyncio.sleep(wait_s)
                            self.last_request_s = time.monotonic()
                            if self.state != StreamState.STREAMING:
                                return
                    if (
                        self.resume_token
                        and self.resume_samples - self.reported_samples >= self.progress_samples
                        and not len(self.responses)
                    ):  # (no response for a while, silence say: one that only says what was consumed)
                        self.responses.put(pb.StreamingRecognizeResponse(session_id=self.session_id))
                        self.reported_samples = self.resume_samples
                elif kind == "control":
                    if request.control.type == pb.Control.FINALIZE:
                        session.finalize()
                    elif request.control.type == pb.Control.SNAPSHOT:
                        if not self.resume_token or self.servicer.options.resume_key is None:
                            self._fail(
                                grpc.StatusCode.FAILED_PRECONDITION,
                                "Control.SNAPSHOT needs a resumable stream on a server with --resume-key-file",
                            )
                            return
                        self.hand_over(_DONE)
                    else:
                        self._fail(
                            grpc.StatusCode.INVALID_ARGUMENT, f"unknown control type {request.control.type}"
                        )
                        return
                elif kind == "config":
                    self._fail(grpc.StatusCode.INVALID_ARGUMENT, "StreamingConfig may be sent only once, first")
                    return
                else:
                    self._fail(grpc.StatusCode.INVALID_ARGUMENT, "empty request: set config, audio or control")
                    return
                if self.handover is not None:
                    self._check_handover()
                if self.state != StreamState.STREAMING:
                    return  # (ended, or handed over)
            self.finish()
        except asyncio.CancelledError:
            raise
        except (grpc.RpcError, grpc.aio.AbortError, grpc.aio.UsageError, asyncio.InvalidStateError) as err:
            # The client went away, or the stream was aborted while a read was pending: expected.
            log.info(
                "session %s: requests ended (%s)",
                self.session_id,
                type(err).__name__,
                extra={"session_id": self.session_id},
            )
            if not self.resume_token:  # (a resumable one is held when its handler is cancelled: _park)
                self._fail(grpc.StatusCode.CANCELLED, "the stream ended")
        except Exception:
            log.exception(
                "session %s: reading requests failed", self.session_id, extra={"session_id": self.session_id}
            )
            self._fail(grpc.StatusCode.INTERNAL, "the server failed to process the audio")


class CosyStreamServicer(pb_grpc.CosyStreamServicer):
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
        are traced (``frontend/tracing.py``), None: off."""
        self.engine = engine
        self.token_sessions = token_sessions or TokenSessions()
        self.options = options
        self.second_pass = second_pass
        self.tracer = tracer
        self.thin_interims = False  # (thin_interims_now)
        self.metrics = metrics or FrontendMetrics()
        self._vocabularies = dict(options.vocabularies)
        self.lag = LoopLag()  # (sampling from the first stream on)
        self.draining = False
        self._streams: set[_Stream] = set()
        self._resumable: dict[str, _Stream] = {}  # resume token -> its stream, held or attached
        self.peers = Peers(options.peers)  # (the other frontends: a resume of one of their sessions goes there)
        self.models = ModelDecoders(
            engine, options.decoder, options.decoders, options.vocabularies, self._phrase_lists
        )

    def new_resume_token(self) -> str:
        """Unguessable; with several frontends, prefixed with this one's index (``forward.py``)."""
        token = secrets.token_urlsafe(18)
        return f"{self.options.frontend_index}.{token}" if self.options.peers else token

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

    def _trace_parent(self, context):
        """The trace a client's ``traceparent`` metadata names (tracing on), else None."""
        metadata = getattr(context, "invocation_metadata", None) if self.tracer is not None else None
        return None if metadata is None else self.tracer.parent(dict(metadata() or ()))

    def vocabulary(self, name: str) -> tuple[str, tuple[Phrase, ...]] | None:
        """The named vocabulary ``name`` as (name, phrases); None for "" (none asked)."""
        return (name, self._vocabularies[name]) if name else None

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

    def model_by_id(self, model: int) -> ModelInfo | None:
        return self.engine.model_by_id(model)

    async def _accept(
        self, requests: AsyncIterator[pb.StreamingRecognizeRequest]
    ) -> SessionConfig | _Stream | _Forward:
        """The stream's validated config, the held stream a resume takes, or the frontend to pass a resume to
        (its session is held there); raises :class:`_Refused` saying why not."""
        if self.draining and not self._resumable:  # (else the first request says whether it resumes one)
            raise _draining()
        try:
            first = await asyncio.wait_for(anext(requests), self.options.idle_timeout_s)
        except StopAsyncIteration:
            raise _Refused(
                grpc.StatusCode.INVALID_ARGUMENT, "the stream ended before its StreamingConfig"
            ) from None
        except TimeoutError:
            raise _Refused(
                grpc.StatusCode.DEADLINE_EXCEEDED, "no StreamingConfig within the idle timeout", "idle_timeout"
            ) from None
        if first.WhichOneof("request") != "config":
            raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, "the first message must be a StreamingConfig")
        if first.config.resume_token:  # (a held session may be resumed while the server drains)
            holder = token_frontend(first.config.resume_token)
            if holder is not None and holder != self.options.frontend_index and holder < len(self.options.peers):
                return _Forward(first, holder)
            return await self._take(first.config)
        if self.draining:
            raise _draining()
        snapshot = self._open_snapshot(first.config) if first.config.resume_snapshot else None
        wanted = first.config if snapshot is None else pb.StreamingConfig.FromString(snapshot.config)
        try:
            config = validate_config(
                wanted,
                self.info,
                self.options.default_endpointing,
                self.second_pass is not None,
                self._vocabularies,
            )
        except ConfigError as err:
            raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, str(err)) from None
        if snapshot is not None:
            config = self._resumed_from(snapshot, config, first.config.resume_offset_samples)
        if config.phrases or config.vocabulary:
            factory = self.models.decoder(self.info.models[config.model])
            vocabulary = self.vocabulary(config.vocabulary)
            try:  # (the G2P and the session's lexicon: milliseconds per new word, off the event loop)
                boosting = factory.cached(config.phrases, vocabulary) or await asyncio.to_thread(
                    factory.boosting, config.phrases, vocabulary
                )
            except PhraseError as err:
                raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, f"phrases: {err}") from None
            config = dataclasses.replace(config, boosting=boosting)
        token = current_token()
        if token is not None and not token.allows(config.priority.name):
            allowed = ", ".join(sorted(token.priorities))
            raise _Refused(
                grpc.StatusCode.PERMISSION_DENIED,
                f"token {token.name!r} may not use priority {config.priority.name} (allowed: {allowed})",
                "permission_denied",
            )
        if not self.engine.connected:
            raise _Refused(grpc.StatusCode.UNAVAILABLE, "the engine is restarting; retry in a moment", None)
        self.lag.start()
        lag_s = self.lag.median_s
        if config.priority == Priority.REALTIME and self.options.admit_lag_s and lag_s > self.options.admit_lag_s:
            raise _Refused(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the server is at capacity for realtime sessions (its frontend runs {lag_s * 1000:.0f} ms "
                f"behind, limit {self.options.admit_lag_s * 1000:g} ms); retry in {RETRY_AFTER_S:g} s or on "
                "another server",
                "overloaded",
                RETRY_AFTER_S,
            )
        return config

    async def StreamingRecognize(self, request_iterator, context):
        requests = aiter(request_iterator)
        try:
            accepted = await self._accept(requests)
        except _Refused as refused:
            if refused.reason:
                token = current_token()
                self.metrics.rejected(refused.reason, None if token is None else token.name)
            yield _last_response("", refused)
            await _abort(context, refused)
        if isinstance(accepted, _Forward):
            log.info("a resume of frontend %d's session: passed on to it", accepted.frontend)
            self.metrics.forwarded()
            async for response in forward(self.peers.stub(accepted.frontend), accepted.first, requests, context):
                yield response
            return

        resumed = isinstance(accepted, _Stream)
        # (no side effects until the try owns it)
        stream = accepted if resumed else _Stream(self, accepted, self._trace_parent(context))
        stream.outcome = "ok"
        parked = False
        try:
            if resumed:
                replay, stream.replay = stream.replay, []
                await context.send_initial_metadata(stream.metadata())
                for item in replay:
                    yield item
            else:
                config = accepted
                self._streams.add(stream)
                stream.claim_quota()
                log.info(
                    "session %s opened: %s %d Hz %s, model %s%s%s",
                    stream.session_id,
                    config.encoding.name,
                    config.sample_rate_hz,
                    config.priority.name,
                    self.info.models[config.model].name,
                    "" if stream.token is None else f" token {stream.token.name}",
                    ", resumable" if stream.resume_token else "",
                    extra={"session_id": stream.session_id},
                )
                if stream.resume_token:
                    self._resumable[stream.resume_token] = stream
                self.engine.open(stream.key, config.priority, stream, stream.model_id)
                # The config is accepted: say so at once (clients may wait for this before sending audio).
                await context.send_initial_metadata(stream.metadata())
            stream.start(requests, context)
            while True:
                item = await stream.responses.get()
                if item is _DONE:
                    break
                if item is _TAKEN:
                    if stream.taking:  # (else a marker left by a take-over that cancelled a stuck handler)
                        stream.taking = False
                        stream.outcome = "taken over"
                        parked = self._park(stream)
                        await _abort(
                            context, _Abort(grpc.StatusCode.CANCELLED, "the session was resumed elsewhere")
                        )
                    continue
                if isinstance(item, _Handoff):
                    item = stream.snapshot_response(item)
                if isinstance(item, _Abort):
                    stream.outcome = item.code.name
                    # The status, also as a last response (some clients can lose the status itself).
                    yield _last_response(stream.session_id, item)
                    await _abort(context, item)
                yield stream.stamp(item)
        except _Refused as refused:  # by the token's quotas
            stream.outcome = refused.code.name
            self.metrics.rejected(refused.reason, stream.token.name)
            yield _last_response(stream.session_id, refused)
            await _abort(context, refused)
        except (asyncio.CancelledError, GeneratorExit):
            # The client went away (or cancelled; or a resume took the stream over): a resumable session is
            # held for its window, any other is freed.
            stream.outcome = "cancelled"
            parked = self._park(stream)
            raise
        finally:
            if not parked:
                stream.release()
                self._streams.discard(stream)
                log.info(
                    "session %s closed: %s",
                    stream.session_id,
                    stream.outcome,
                    extra={"session_id": stream.session_id},
                )
            # An abort's traceback keeps this frame, and its locals, alive: let the session (resampler, decoder)
            # go now, not when the RPC's last exception is dropped.
            del stream

    def _park(self, stream: _Stream) -> bool:
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

    def _expire(self, stream: _Stream, why: str = "no resume within the window") -> None:
        if stream.detached.is_set() and stream.state < StreamState.RELEASED:
            self.metrics.expired()
            stream.release()
            self._streams.discard(stream)
            log.info("session %s closed: %s", stream.session_id, why, extra={"session_id": stream.session_id})

    def _open_snapshot(self, config: pb.StreamingConfig) -> Snapshot:
        """The snapshot a resume from another server brings, checked; raises :class:`_Refused` saying why
        it cannot be used here."""
        if self.options.resume_key is None:
            raise _Refused(
                grpc.StatusCode.FAILED_PRECONDITION,
                "resume_snapshot: this server has no --resume-key-file (it cannot check a snapshot); open a new "
                "stream, or resume on a server that shares the key",
                "resume_refused",
            )
        try:
            snapshot = Snapshot.open(config.resume_snapshot, self.options.resume_key)
        except SnapshotError as err:
            code = grpc.StatusCode.INVALID_ARGUMENT if err.tampered else grpc.StatusCode.FAILED_PRECONDITION
            raise _Refused(code, str(err), "resume_refused") from None
        caller = current_token()
        if snapshot.token != (caller.name if caller is not None else None):
            raise _Refused(
                grpc.StatusCode.FAILED_PRECONDITION,
                "resume_snapshot: the session was opened with another token; resume it with that token",
                "resume_refused",
            )
        return snapshot

    def _resumed_from(self, snapshot: Snapshot, config: SessionConfig, offset: int) -> SessionConfig:
        """``config`` (the snapshot's, validated here) going on where the snapshot says."""
        model = self.info.models[config.model]
        if (model.name, model.version) != (snapshot.model, snapshot.model_version):
            raise _Refused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"resume_snapshot: the session ran {snapshot.model} version {snapshot.model_version}; this server "
                f"serves {model.name} version {model.version}: open a new stream",
                "resume_refused",
            )
        if not 0 <= offset <= snapshot.offset_samples:
            raise _Refused(
                grpc.StatusCode.FAILED_PRECONDITION,
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

    async def _take(self, config: pb.StreamingConfig) -> _Stream:
        """The held session ``config.resume_token`` names, attached to the calling connection (its old one, if
        it still holds it, is cancelled), with the responses to send again in ``replay``; raises
        :class:`_Refused` saying why not (the session stays held)."""
        stream = self._resumable.get(config.resume_token)
        caller = current_token()
        if (
            stream is not None
            and stream.token is not None
            and (caller is None or caller.name != stream.token.name)
        ):
            stream = None  # (another token's session: as if unknown, so a token reveals nothing of it)
        if stream is None or stream.state >= StreamState.RELEASED:
            raise _Refused(
                grpc.StatusCode.NOT_FOUND,
                "no session to resume with this resume_token: it ended, its resume window passed, or it was never "
                "issued here (a session is resumed on the server that holds it); open a new one",
                "resume_not_found",
            )
        if not stream.detached.is_set():  # its old connection still holds it (the server has not seen it drop)
            # Its handler ends that call (CANCELLED) once it takes the marker; one stuck sending to a dead
            # connection is cancelled instead (the old call then ends when its transport does).
            stream.taking = True
            stream.responses.put(_TAKEN)
            try:
                await asyncio.wait_for(stream.detached.wait(), 1.0)
            except TimeoutError:
                if stream.handler is not None:
                    stream.handler.cancel()
                try:
                    await asyncio.wait_for(stream.detached.wait(), 4.0)
                except TimeoutError:
                    raise _Refused(
                        grpc.StatusCode.UNAVAILABLE, "the session's old connection did not let it go; retry", None
                    ) from None
            finally:
                stream.taking = False
            if stream.state >= StreamState.RELEASED:
                raise _Refused(grpc.StatusCode.NOT_FOUND, "the session ended while it was taken over", None)
        offset = config.resume_offset_samples
        if offset < 0:
            raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, f"resume_offset_samples={offset} is negative")
        skip = stream.consumed_bytes - offset * stream.bytes_per_sample
        if skip < 0:
            raise _Refused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"resume_offset_samples={offset} is past the {stream.consumed_samples} samples this session has "
                f"consumed: send the audio from sample {stream.consumed_samples} (or earlier) on",
            )
        after = config.resume_after_response
        if after > stream.response_index:
            raise _Refused(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"resume_after_response={after}: this session has sent {stream.response_index} responses",
            )
        if after < stream.response_index and stream.sent[0][0] > after + 1:
            raise _Refused(
                grpc.StatusCode.FAILED_PRECONDITION,
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

    async def GetServerInfo(self, request, context):
        info = self.info
        defaults = self.options.default_endpointing
        return pb.ServerInfo(
            version=__version__,
            models=[model_message(model, is_default=index == 0) for index, model in enumerate(info.models)],
            encodings=[int(encoding) for encoding in stream_encodings()],
            min_sample_rate_hz=MIN_INPUT_RATE_HZ,
            max_sample_rate_hz=MAX_INPUT_RATE_HZ,
            max_sessions=info.max_sessions,
            active_sessions=self.engine.active_sessions,
            device=info.device,
            final_model=self.second_pass.config.model if self.second_pass and self.second_pass.enabled else "",
            vocabularies=sorted(self._vocabularies),
            load=load_status(self.engine.loads(), self.lag.median_s),
            default_endpointing=pb.EndpointingConfig(
                silence_ms=defaults.silence_ms,
                max_utterance_ms=defaults.max_utterance_ms,
                vad_aggressiveness=defaults.vad_aggressiveness,
            ),
            frontends=self.engine.listening_frontends,  # live: those connected to the engine and listening
            loaded_model_versions=info.held_models or len(info.models),
            engines=[
                pb.EngineStatus(
                    index=e.index,
                    device=e.device,
                    serving=e.connected,
                    active_sessions=e.active_sessions,
                    max_sessions=e.max_sessions,
                    load=load.load if load else 0.0,
                    overloaded=bool(load and load.overloaded),
                )
                for e, load in zip(
                    self.engine.engines() if isinstance(self.engine, EnginePool) else [],
                    self.engine.loads(),
                    strict=False,
                )
            ],
        )

    async def drain(self, grace_s: float, final_wait_s: float = 5.0) -> None:
        """Refuse new streams; serve the open ones for ``grace_s``; then cut those still open (their final
        for the audio received, then UNAVAILABLE) and wait up to ``final_wait_s`` for those finals."""
        self.draining = True
        if self.options.resume_key is not None:  # (handed over at their next utterance boundary)
            for stream in list(self._streams):
                if stream.resume_token and not stream.detached.is_set():
                    stream.hand_over(_Abort(grpc.StatusCode.UNAVAILABLE, HANDED_OVER))
        ended = await self._streams_ended_within(grace_s)
        self._expire_held("the server drained")
        if ended:
            return
        log.info("drain grace over: cutting %d open sessions after their finals", len(self._streams))
        if self.second_pass is not None:  # (finals that wait for it come before the wait below ends)
            self.second_pass.hurry(max(0.0, final_wait_s - 1.0))
        for stream in list(self._streams):
            stream.cut(
                grpc.StatusCode.UNAVAILABLE,
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
