"""The gRPC servicer of ``cosystream.v1.CosyStream``: validation, and the gRPC mapping of the frontend's sessions.

Each bidi stream is an async generator that yields the messages of what its session (``frontend/live.py``)
says, while a task reads the requests into it. A client half-close flushes the session and ends the stream
with OK after the last final. A stream that the server ends early (idle timeout, the end of a drain's grace)
is *cut*: reading stops, the audio received is flushed, its final is sent, then the status says why; OK means
every byte sent was transcribed. The stream's engine slot is owned by one ``try`` whose ``finally`` frees it,
entered before the first ``await``: a cancel, a rejection or an error at any point frees it.

A stream runs on the model its config names (the default when it names none), with that model's own decoder
(its vocabulary, lexicon and language model) and output delay; every result names the model and its version.
A model loaded while serving gets its decoder before it serves (``frontend/model_decoders.py``); a session
moved to a new version of its model between utterances decodes the next ones with the new version's decoder.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from cosystream import __version__
from cosystream.audio.codecs import MAX_INPUT_RATE_HZ, MIN_INPUT_RATE_HZ, AudioEncoding
from cosystream.audio.endpointing import EndpointingConfig
from cosystream.audio.streams import COMPRESSED, OPUS_RATES_HZ, codecs_available
from cosystream.decoding.greedy import MAX_ALTERNATIVES
from cosystream.decoding.phrases import Phrase, PhraseError
from cosystream.decoding.phrases import normalize as normalize_phrases
from cosystream.engine.headroom import Degradation, LoadReport
from cosystream.engine.ipc import EngineInfo, ModelInfo
from cosystream.frames import FRAME_MS, SAMPLE_RATE_HZ
from cosystream.frontend.cpu import CpuWindow
from cosystream.frontend.engine_pool import EnginePool
from cosystream.frontend.final_pass import SECOND_PASS, STREAMING
from cosystream.frontend.host import SessionHost
from cosystream.frontend.live import DONE, RESUMABLE, TAKEN, Handoff, LiveSession
from cosystream.frontend.results import Response
from cosystream.frontend.session import SessionConfig
from cosystream.frontend.status import Ended, Refused, Status, draining
from cosystream.priority import Priority
from cosystream.server.auth import current_token
from cosystream.server.forward import Peers, forward, sibling_holding
from cosystream.server.messages import STATUS_CODES, response_message
from cosystream.server.retry import retry_metadata
from cosystream.v1 import cosystream_pb2 as pb
from cosystream.v1 import cosystream_pb2_grpc as pb_grpc
from cosystream.v1.resume import SESSION_METADATA, TOKEN_METADATA

log = logging.getLogger(__name__)

RESUME_EOF_WAIT_S = 0.1
"""After a resumable stream's requests end, how long the server waits to see whether its connection dropped
(then the session is held) before taking it as a half-close (then its last final is flushed): the price of
resume is up to this much on a half-close's final."""


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


def session_config(host: SessionHost, config: pb.StreamingConfig) -> SessionConfig:
    """``config`` validated for ``host``'s server; raises :class:`Refused` (INVALID_ARGUMENT) saying what to fix."""
    try:
        return validate_config(
            config, host.info, host.options.default_endpointing, host.second_pass is not None, host.vocabularies
        )
    except ConfigError as err:
        raise Refused(Status.INVALID_ARGUMENT, str(err)) from None


def _wire(config: pb.StreamingConfig) -> bytes:
    """``config`` as a snapshot carries it: without the fields that resumed it."""
    wire = pb.StreamingConfig()
    wire.CopyFrom(config)
    for name in ("resume_token", "resume_offset_samples", "resume_after_response", "resume_snapshot"):
        wire.ClearField(name)
    return wire.SerializeToString()


def load_status(
    loads: list[LoadReport | None],
    lag_s: float = 0.0,
    late_s: float = 0.0,
    cpu: CpuWindow | None = None,
    admit_cpu: float = 0.0,
) -> pb.LoadStatus:
    """The engines' load reports as GetServerInfo gives them: the most loaded engine's load, counts summed,
    overloaded when every engine reporting is; ``lag_s``: the answering frontend's loop lag, ``late_s``: how
    late it reads its realtime audio, ``cpu``: its host's CPU window (None: not sampled yet)."""
    status = pb.LoadStatus(frontend_lag_ms=lag_s * 1000, audio_late_ms=late_s * 1000, admit_cpu=admit_cpu)
    if cpu is not None:
        status.host_cpu_busy, status.host_cpu_cores, status.cpu_per_session = cpu.busy, cpu.cores, cpu.per_session
    known = [load for load in loads if load is not None]
    if not known:
        return status
    status.MergeFrom(
        pb.LoadStatus(
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
    )
    return status


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


@dataclass(frozen=True, slots=True)
class _Forward:
    """A resume of a session another frontend of this server holds: passed on to it (``forward.py``)."""

    first: pb.StreamingRecognizeRequest
    frontend: int


def _status_response(
    session_id: str, status: Status, message: str, retry_after_s: float | None = None
) -> pb.StreamingRecognizeResponse:
    """A stream's error status as its last response (grpcio's asyncio client can lose the status itself)."""
    delay_ms = 0 if retry_after_s is None else math.ceil(retry_after_s * 1000)
    return pb.StreamingRecognizeResponse(
        session_id=session_id,
        error=pb.StreamError(code=int(status), message=message, retry_delay_ms=delay_ms),
    )


def _last_response(session_id: str, end: Ended) -> pb.StreamingRecognizeResponse:
    return _status_response(session_id, end.status, end.message, end.retry_after_s)


async def _abort(context, end: Ended) -> None:
    """End the stream with ``end``'s status (with a RetryInfo when it says when to retry)."""
    code = STATUS_CODES[end.status]
    await context.abort(code, end.message, retry_metadata(code, end.message, end.retry_after_s))


def _metadata(stream: LiveSession) -> tuple[tuple[str, str], ...]:
    """A stream's initial metadata: its session id, and its resume token if it is resumable."""
    session = ((SESSION_METADATA, stream.session_id),)
    return (*session, (TOKEN_METADATA, stream.resume_token)) if stream.resume_token else session


async def _dropped(context) -> bool:
    """Whether the end of the requests was a dropped connection rather than a half-close: grpc.aio ends the
    request iterator the same way for both, and marks the call cancelled a moment later when the connection
    is gone (observed within a loop iteration or two; RESUME_EOF_WAIT_S allows for a busy loop)."""
    cancelled = getattr(context, "cancelled", None)
    if cancelled is None:
        return False
    deadline = time.monotonic() + RESUME_EOF_WAIT_S
    while not cancelled():
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.005)
    return True


class CosyStreamServicer(SessionHost, pb_grpc.CosyStreamServicer):
    """The gRPC mapping of the frontend's sessions (``frontend/host.py``): requests to a session's calls, its
    responses and ends to messages and status codes."""

    def __init__(self, *args, **kwargs):
        """As :class:`SessionHost`'s; with several frontends, a resume of another one's session is passed to it
        (``forward.py``)."""
        super().__init__(*args, **kwargs)
        self.peers = Peers(self.options.peers)

    def _trace_parent(self, context):
        """The trace a client's ``traceparent`` metadata names (tracing on), else None."""
        metadata = getattr(context, "invocation_metadata", None) if self.tracer is not None else None
        return None if metadata is None else self.tracer.parent(dict(metadata() or ()))

    async def _accept(
        self, requests: AsyncIterator[pb.StreamingRecognizeRequest]
    ) -> SessionConfig | LiveSession | _Forward:
        """The stream's validated config, the held stream a resume takes, or the frontend to pass a resume to
        (its session is held there); raises :class:`Refused` saying why not."""
        if self.draining and not self._resumable:  # (else the first request says whether it resumes one)
            raise draining()
        try:
            first = await asyncio.wait_for(anext(requests), self.options.idle_timeout_s)
        except StopAsyncIteration:
            raise Refused(Status.INVALID_ARGUMENT, "the stream ended before its StreamingConfig") from None
        except TimeoutError:
            raise Refused(
                Status.DEADLINE_EXCEEDED, "no StreamingConfig within the idle timeout", "idle_timeout"
            ) from None
        if first.WhichOneof("request") != "config":
            raise Refused(Status.INVALID_ARGUMENT, "the first message must be a StreamingConfig")
        wanted = first.config
        if wanted.resume_token:  # (a held session may be resumed while the server drains)
            holder = sibling_holding(wanted.resume_token, self.options)
            if holder is not None:
                return _Forward(first, holder)
            return await self.take(
                wanted.resume_token, wanted.resume_offset_samples, wanted.resume_after_response, current_token()
            )
        if self.draining:
            raise draining()
        snapshot = self.open_snapshot(wanted.resume_snapshot, current_token()) if wanted.resume_snapshot else None
        if snapshot is not None:
            wanted = pb.StreamingConfig.FromString(snapshot.config)
        config = session_config(self, wanted)
        if snapshot is not None:
            config = self.resumed_from(snapshot, config, first.config.resume_offset_samples)
        return await self.admit(config, current_token())

    async def StreamingRecognize(self, request_iterator, context):
        requests = aiter(request_iterator)
        try:
            accepted = await self._accept(requests)
        except Refused as refused:
            self.count_refusal(refused, current_token())
            yield _last_response("", refused.ended)
            await _abort(context, refused.ended)
        if isinstance(accepted, _Forward):
            log.info("a resume of frontend %d's session: passed on to it", accepted.frontend)
            self.metrics.forwarded()
            async for response in forward(self.peers.stub(accepted.frontend), accepted.first, requests, context):
                yield response
            return

        resumed = isinstance(accepted, LiveSession)
        # (no side effects until the try owns it)
        stream = accepted if resumed else LiveSession(self, accepted, current_token(), self._trace_parent(context))
        stream.outcome = "ok"
        parked = False
        try:
            if resumed:
                replay, stream.replay = stream.replay, []
                await context.send_initial_metadata(_metadata(stream))
                for message in replay:
                    yield message
                stream.attach(asyncio.create_task(self._read(stream, requests, context)))
            else:
                self.start(stream)
                stream.attach(asyncio.create_task(self._read(stream, requests, context)))  # (audio read meanwhile)
                # The metadata says the session is admitted: its config accepted and an engine slot given. So a
                # client that waits for it before sending audio (a telephony gateway, before it answers the
                # call) never takes a session the engine refuses for capacity: that one gets no metadata, only
                # its RESOURCE_EXHAUSTED (with a RetryInfo), from the loop below.
                await stream.answered.wait()
                if stream.opened:
                    await context.send_initial_metadata(_metadata(stream))
            while True:
                item = await stream.responses.get()
                if item is DONE:
                    break
                if item is TAKEN:
                    if stream.taking:  # (else a marker left by a take-over that cancelled a stuck handler)
                        stream.taking = False
                        stream.outcome = "taken over"
                        parked = self.park(stream)
                        await _abort(context, Ended(Status.CANCELLED, "the session was resumed elsewhere"))
                    continue
                if isinstance(item, Ended):
                    stream.outcome = item.status.name
                    # The status, also as a last response (some clients can lose the status itself).
                    yield _last_response(stream.session_id, item)
                    await _abort(context, item)
                yield self._message(stream, item)
        except Refused as refused:  # by the token's quotas
            stream.outcome = refused.status.name
            self.count_refusal(refused, stream.token)
            yield _last_response(stream.session_id, refused.ended)
            await _abort(context, refused.ended)
        except (asyncio.CancelledError, GeneratorExit):
            # The client went away (or cancelled; or a resume took the stream over): a resumable session is
            # held for its window, any other is freed.
            stream.outcome = "cancelled"
            parked = self.park(stream)
            raise
        finally:
            if not parked:
                self.close(stream)
            # An abort's traceback keeps this frame, and its locals, alive: let the session (resampler, decoder)
            # go now, not when the RPC's last exception is dropped.
            del stream

    def _message(self, stream: LiveSession, item: object) -> pb.StreamingRecognizeResponse:
        """The message of what the session said: numbered if it is resumable, saying how much input it has
        consumed, and kept to send again."""
        consumed = None
        if isinstance(item, Response):
            message = response_message(item)
        elif isinstance(item, Handoff):
            snapshot = stream.snapshot(item, self.options.resume_key, self.options.resume_window_s)
            consumed = snapshot.offset_samples  # (a snapshot's says where it resumes)
            message = pb.StreamingRecognizeResponse(
                session_id=stream.session_id,
                consumed_samples=consumed,
                resume_snapshot=snapshot.seal(self.options.resume_key),
            )
        else:  # (Progress: only what was consumed)
            message = pb.StreamingRecognizeResponse(session_id=stream.session_id)
        if stream.resume_token:
            message.response_index, message.consumed_samples = stream.number(consumed)
            message.resume_token = stream.resume_token
            stream.keep(message.response_index, message)
        return message

    async def _read(
        self, stream: LiveSession, requests: AsyncIterator[pb.StreamingRecognizeRequest], context
    ) -> None:
        """Read the stream's requests into its session until it half-closes (then flush to its last final),
        the session reads no more, or the connection goes."""
        try:
            while True:
                await stream.wait_for_room()
                try:
                    request = await anext(requests)
                except StopAsyncIteration:
                    if stream.resume_token and await _dropped(context):
                        return  # (not a half-close: the handler is being cancelled, and the stream held)
                    break
                stream.heard()
                kind = request.WhichOneof("request")
                if kind == "audio":
                    going_on = await stream.feed(request.audio)
                elif kind == "control" and request.control.type == pb.Control.FINALIZE:
                    going_on = stream.finalize()
                elif kind == "control" and request.control.type == pb.Control.SNAPSHOT:
                    if not stream.resume_token or self.options.resume_key is None:
                        stream.fail(
                            Status.FAILED_PRECONDITION,
                            "Control.SNAPSHOT needs a resumable stream on a server with --resume-key-file",
                        )
                        return
                    stream.hand_over(DONE)
                    going_on = stream.went_on()
                elif kind == "control":
                    stream.fail(Status.INVALID_ARGUMENT, f"unknown control type {request.control.type}")
                    return
                elif kind == "config":
                    stream.fail(Status.INVALID_ARGUMENT, "StreamingConfig may be sent only once, first")
                    return
                else:
                    stream.fail(Status.INVALID_ARGUMENT, "empty request: set config, audio or control")
                    return
                if not going_on:
                    return  # (ended, or handed over)
            stream.finish()
        except asyncio.CancelledError:
            raise
        except (grpc.RpcError, grpc.aio.AbortError, grpc.aio.UsageError, asyncio.InvalidStateError) as err:
            # The client went away, or the stream was aborted while a read was pending: expected.
            log.info(
                "session %s: requests ended (%s)",
                stream.session_id,
                type(err).__name__,
                extra={"session_id": stream.session_id},
            )
            if not stream.resume_token:  # (a resumable one is held when its handler is cancelled: park)
                stream.fail(Status.CANCELLED, "the stream ended")
        except Exception:
            log.exception(
                "session %s: reading requests failed", stream.session_id, extra={"session_id": stream.session_id}
            )
            stream.fail(Status.INTERNAL, "the server failed to process the audio")

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
            vocabularies=sorted(self.vocabularies),
            load=load_status(
                self.engine.loads(), self.lag.median_s, self.audio_late_s, self.cpu.window, self.options.admit_cpu
            ),
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
