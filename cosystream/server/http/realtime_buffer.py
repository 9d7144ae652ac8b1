"""One audio buffer of a Realtime connection (``realtime.py``): the audio between two commits (or clears), run
as a native stream (:class:`~cosystream.server.native.NativeStream`), its responses turned into the Realtime
API's item events (speech started / stopped, committed, deltas, completed)."""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any, Protocol

import grpc

from cosystream.priority import Priority
from cosystream.server.auth import Token
from cosystream.server.http.common import native_model, prompt_phrases, seconds
from cosystream.server.http.realtime_settings import Settings
from cosystream.server.native import NativeStream, StreamEnded
from cosystream.server.servicer import CosyStreamServicer
from cosystream.v1 import cosystream_pb2 as pb

log = logging.getLogger(__name__)

MANUAL_SILENCE_MS = 10_000  # turn_detection null: the longest pause the endpointer allows...
MANUAL_MAX_UTTERANCE_MS = 600_000  # ...and utterance; the buffer's text spans them all


class Connection(Protocol):
    """What a buffer uses of its connection (``realtime.RealtimeConnection``)."""

    servicer: CosyStreamServicer
    token: Token | None
    session_id: str
    last_item: str | None

    def emit(self, event: dict) -> None: ...

    def error(self, message: str, code: str, param: str | None = None, event_id: str | None = None) -> None: ...

    def fail(self, code: grpc.StatusCode, message: str) -> None: ...

    def buffer_done(self, buffer: Buffer) -> None: ...


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:20]}"


class Buffer:
    """One native stream of the connection: the audio between two commits (or clears)."""

    def __init__(self, connection: Connection, settings: Settings, offset_ms: float):
        self.connection = connection
        self.settings = settings
        self.offset_ms = offset_ms  # where this buffer starts in the connection's audio
        self.sent_bytes = 0
        self.committing = False
        self.commit_event_id: str | None = None
        self.item_id: str | None = None if settings.server_vad else new_id("item")
        self.committed_items = 0  # items committed since the commit was asked for
        self.finals: list[str] = []  # manual turns: the finals of the buffer so far
        self.text = ""  # the current item's text as the deltas have built it
        endpointing = None
        if not settings.server_vad:
            endpointing = pb.EndpointingConfig(
                silence_ms=MANUAL_SILENCE_MS, max_utterance_ms=MANUAL_MAX_UTTERANCE_MS
            )
        elif settings.silence_ms:
            endpointing = pb.EndpointingConfig(silence_ms=settings.silence_ms)
        model = native_model(connection.servicer, settings.model)
        config = pb.StreamingConfig(
            encoding=settings.encoding,
            sample_rate_hz=settings.sample_rate_hz,
            priority=Priority.REALTIME,
            interim_results=True,
            endpointing=endpointing,
            model=model,
            enable_word_time_offsets=True,
            enable_automatic_punctuation=True,  # (OpenAI's transcriptions are written text)
            phrases=prompt_phrases(connection.servicer, model, settings.prompt),
        )
        self.stream = NativeStream(connection.servicer, config, connection.token)
        self.task = asyncio.get_running_loop().create_task(self._pump())

    @property
    def audio_ms(self) -> float:
        return self.sent_bytes / self.settings.bytes_per_ms

    def ms(self, stream_ms: int) -> int:
        return round(self.offset_ms + stream_ms)

    async def append(self, audio: bytes) -> None:
        await self.stream.send_audio(audio)
        self.sent_bytes += len(audio)  # (after: an append cut off by a dropped connection was not taken)

    def commit(self, asked: bool = True, event_id: str | None = None) -> None:
        """End the buffer (``asked``: by the client's commit, whose ``event_id`` an error names if the buffer
        has nothing to commit; else by a settings change)."""
        self.committing, self.commit_event_id = asked, event_id
        self.committed_items = 0  # server VAD: what the endpointer commits from now on answers this commit
        if not self.settings.server_vad:
            self.connection.emit(
                {
                    "type": "input_audio_buffer.committed",
                    "item_id": self.item_id,
                    "previous_item_id": self.connection.last_item,
                }
            )
            self.connection.last_item = self.item_id
        self.stream.half_close()

    async def _pump(self) -> None:
        emit = self.connection.emit
        try:
            async for response in self.stream.responses():
                event = response.speech_event
                if event.type == pb.SpeechEvent.SPEECH_STARTED and self.settings.server_vad:
                    self.item_id, self.text = new_id("item"), ""
                    emit(
                        {
                            "type": "input_audio_buffer.speech_started",
                            "audio_start_ms": self.ms(event.offset_ms),
                            "item_id": self.item_id,
                        }
                    )
                elif event.type == pb.SpeechEvent.SPEECH_ENDED and self.settings.server_vad:
                    emit(
                        {
                            "type": "input_audio_buffer.speech_stopped",
                            "audio_end_ms": self.ms(event.offset_ms),
                            "item_id": self.item_id,
                        }
                    )
                    emit(
                        {
                            "type": "input_audio_buffer.committed",
                            "item_id": self.item_id,
                            "previous_item_id": self.connection.last_item,
                        }
                    )
                    self.connection.last_item = self.item_id
                    self.committed_items += 1
                for result in response.results:
                    self._result(result, response.latency)
        except StreamEnded as ended:
            self._ended(ended)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("realtime session %s: a buffer failed", self.connection.session_id)
            self.connection.fail(grpc.StatusCode.INTERNAL, "the server failed to process the audio")
        finally:
            self.connection.buffer_done(self)

    def _latency(self, latency: pb.Latency) -> dict:
        return {
            "audio_processed_ms": self.ms(latency.audio_processed_ms),
            "queue_ms": round(latency.queue_ms, 3),
            "compute_ms": round(latency.compute_ms, 3),
            "receive_to_send_ms": round(latency.receive_to_send_ms, 3),
        }

    def _result(self, result: pb.StreamingResult, latency: pb.Latency) -> None:
        if self.item_id is None:  # (server_vad: every result belongs to an utterance that started)
            return
        if self.settings.server_vad:
            text = result.transcript
        else:
            text = " ".join([*self.finals, result.transcript] if result.transcript else self.finals)
        if text != self.text:
            grows = text.startswith(self.text)
            event = {
                "type": "conversation.item.input_audio_transcription.delta",
                "item_id": self.item_id,
                "content_index": 0,
                "delta": text[len(self.text) :] if grows else text,
                "transcript": text,
                "stability": round(result.stability, 3),
                "latency": self._latency(latency),
            }
            if not grows:
                event["replace"] = True
            self.connection.emit(event)
            self.text = text
        if not result.is_final:
            return
        if not self.settings.server_vad:
            if result.transcript:
                self.finals.append(result.transcript)
            return
        self.connection.emit(self._completed(result.transcript, latency, result))
        self.item_id, self.text = None, ""

    def _completed(self, transcript: str, latency: pb.Latency, result: pb.StreamingResult | None = None) -> dict:
        event: dict[str, Any] = {
            "type": "conversation.item.input_audio_transcription.completed",
            "item_id": self.item_id,
            "content_index": 0,
            "transcript": transcript,
            "logprobs": None,
            "usage": {"type": "duration", "seconds": round(self.audio_ms / 1000, 3)},
            "latency": self._latency(latency),
        }
        if result is not None:
            event["start_ms"] = self.ms(result.start_ms)
            event["end_ms"] = self.ms(result.end_ms)
            event["words"] = [
                {"word": w.word, "start": seconds(self.ms(w.start_ms)), "end": seconds(self.ms(w.end_ms))}
                for w in result.words
            ]
        return event

    def _ended(self, ended: StreamEnded) -> None:
        connection = self.connection
        if ended.code == grpc.StatusCode.OK:
            if not self.settings.server_vad:
                connection.emit(self._completed(" ".join(self.finals), pb.Latency()))
            elif self.committing and not self.committed_items:
                connection.error(
                    "the input audio buffer held no speech to commit (the server had committed all of it)",
                    "input_audio_buffer_commit_empty",
                    event_id=self.commit_event_id,
                )
            return
        if ended.code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return  # no audio for the idle timeout: what was heard got its final; the next append reopens
        connection.fail(ended.code, ended.message)
