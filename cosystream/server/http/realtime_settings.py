"""A Realtime transcription session's settings: ``session.update`` (either dialect) read into
:class:`Settings`, and :class:`Settings` described back as ``session.created`` / ``.updated`` show it."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from cosystream.audio.codecs import MAX_INPUT_RATE_HZ, MIN_INPUT_RATE_HZ
from cosystream.audio.endpointing import EndpointingConfig
from cosystream.frames import FRAME_MS
from cosystream.server.http.common import check_language, native_model
from cosystream.server.http.errors import ApiError
from cosystream.server.servicer import CosyStreamServicer
from cosystream.v1 import cosystream_pb2 as pb

OPENAI_PCM_RATE_HZ = 24000  # pcm16 / audio/pcm unless the session says otherwise

_FORMATS = {  # (native encoding, fixed rate or None)
    "pcm16": (pb.LINEAR16, None),
    "audio/pcm": (pb.LINEAR16, None),
    "g711_ulaw": (pb.MULAW, 8000),
    "audio/pcmu": (pb.MULAW, 8000),
    "g711_alaw": (pb.ALAW, 8000),
    "audio/pcma": (pb.ALAW, 8000),
}
_GA_FORMAT_NAMES = {pb.LINEAR16: "audio/pcm", pb.MULAW: "audio/pcmu", pb.ALAW: "audio/pcma"}
_BETA_FORMAT_NAMES = {pb.LINEAR16: "pcm16", pb.MULAW: "g711_ulaw", pb.ALAW: "g711_alaw"}


class EventError(Exception):
    """A client event refused: an ``error`` event with this code; the connection goes on."""

    def __init__(self, message: str, code: str = "invalid_value", param: str | None = None):
        super().__init__(message)
        self.message, self.code, self.param = message, code, param


@dataclass(frozen=True, slots=True)
class Settings:
    encoding: int = pb.LINEAR16
    sample_rate_hz: int = OPENAI_PCM_RATE_HZ
    server_vad: bool = True
    silence_ms: int = 0  # 0: the server's default
    model: str = ""  # as requested (echoed back)
    language: str = ""
    prompt: str = ""
    vad_extra: tuple = ()  # turn-detection fields accepted and echoed (threshold, prefix_padding_ms, ...)

    @property
    def bytes_per_ms(self) -> float:
        return self.sample_rate_hz * (2 if self.encoding == pb.LINEAR16 else 1) / 1000


def _silence_ms(value: Any) -> int:
    if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
        raise EventError(
            "silence_duration_ms must be a positive number of milliseconds", param="silence_duration_ms"
        )
    return int(min(10_000, max(FRAME_MS, round(value / FRAME_MS) * FRAME_MS)))


def apply_update(settings: Settings, session: Any, servicer: CosyStreamServicer) -> Settings:
    """``settings`` changed by a ``session`` object of either dialect. Raises :class:`EventError`."""
    if not isinstance(session, dict):
        raise EventError("session must be an object", param="session")
    if session.get("type") not in (None, "transcription"):
        raise EventError(
            f"this server runs transcription sessions only (session.type {session.get('type')!r})",
            param="session.type",
        )
    audio = session.get("audio") or {}
    audio_input = (audio.get("input") or {}) if isinstance(audio, dict) else None
    if not isinstance(audio_input, dict):
        raise EventError("session.audio.input must be an object", param="session.audio.input")
    changes: dict[str, Any] = {}
    # The audio format: GA {"type": "audio/pcm", "rate": N}, or the older "pcm16" with our own rate field.
    fmt = audio_input.get("format", session.get("input_audio_format"))
    rate = session.get("input_audio_sample_rate")
    if isinstance(fmt, dict):
        rate = fmt.get("rate", rate)
        fmt = fmt.get("type")
    if fmt is not None:
        if fmt not in _FORMATS:
            raise EventError(
                f"audio format {fmt!r} is not supported: use audio/pcm (pcm16), audio/pcmu (g711_ulaw) or "
                "audio/pcma (g711_alaw)",
                param="session.audio.input.format",
            )
        encoding, fixed = _FORMATS[fmt]
        changes["encoding"] = encoding
        if fixed:
            changes["sample_rate_hz"] = fixed
        elif settings.encoding != encoding:  # back to PCM from G.711: OpenAI's rate unless one is given
            changes["sample_rate_hz"] = OPENAI_PCM_RATE_HZ
    if rate is not None:
        encoding = changes.get("encoding", settings.encoding)
        if encoding != pb.LINEAR16 and rate != 8000:
            raise EventError("G.711 audio is 8000 Hz", param="session.audio.input.format.rate")
        if not isinstance(rate, int) or not MIN_INPUT_RATE_HZ <= rate <= MAX_INPUT_RATE_HZ:
            raise EventError(
                f"rate {rate!r} is not supported: use {MIN_INPUT_RATE_HZ} to {MAX_INPUT_RATE_HZ} Hz",
                param="session.audio.input.format.rate",
            )
        changes["sample_rate_hz"] = rate
    transcription = audio_input.get("transcription", session.get("input_audio_transcription"))
    if transcription is not None:
        if not isinstance(transcription, dict):
            raise EventError("transcription must be an object", param="session.audio.input.transcription")
        try:
            if "model" in transcription:
                native_model(servicer, transcription.get("model"), "session.audio.input.transcription.model")
                changes["model"] = transcription.get("model") or ""
            if "language" in transcription:
                check_language(
                    servicer, transcription.get("language"), "session.audio.input.transcription.language"
                )
                changes["language"] = transcription.get("language") or ""
        except ApiError as err:
            raise EventError(err.message, err.code or "invalid_value", err.param) from None
        changes["prompt"] = transcription.get("prompt") or settings.prompt
    marker = object()
    turn = audio_input.get("turn_detection", session.get("turn_detection", marker))
    if turn is None:
        changes["server_vad"] = False
    elif turn is not marker:
        if not isinstance(turn, dict) or turn.get("type", "server_vad") not in ("server_vad", "semantic_vad"):
            raise EventError(
                'turn_detection: use {"type": "server_vad", "silence_duration_ms": N} or null',
                param="session.audio.input.turn_detection",
            )
        changes["server_vad"] = True
        changes["silence_ms"] = _silence_ms(turn["silence_duration_ms"]) if "silence_duration_ms" in turn else 0
        changes["vad_extra"] = tuple(
            (key, value) for key, value in turn.items() if key not in ("type", "silence_duration_ms")
        )
    return replace(settings, **changes)


def describe(settings: Settings, session_id: str, defaults: EndpointingConfig, beta: bool) -> dict:
    """The session as ``session.created`` / ``.updated`` show it."""
    turn = None
    if settings.server_vad:
        turn = {
            "type": "server_vad",
            **dict(settings.vad_extra),
            "silence_duration_ms": settings.silence_ms or defaults.silence_ms,
        }
    transcription = {"model": settings.model or "default", "language": settings.language or None}
    transcription["prompt"] = settings.prompt
    if beta:
        return {
            "id": session_id,
            "object": "realtime.transcription_session",
            "input_audio_format": _BETA_FORMAT_NAMES[settings.encoding],
            "input_audio_sample_rate": settings.sample_rate_hz,
            "input_audio_transcription": transcription,
            "turn_detection": turn,
            "input_audio_noise_reduction": None,
            "include": [],
        }
    return {
        "type": "transcription",
        "id": session_id,
        "object": "realtime.transcription_session",
        "audio": {
            "input": {
                "format": {"type": _GA_FORMAT_NAMES[settings.encoding], "rate": settings.sample_rate_hz},
                "transcription": transcription,
                "turn_detection": turn,
                "noise_reduction": None,
            }
        },
        "include": [],
    }
