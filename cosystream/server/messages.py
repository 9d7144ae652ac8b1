"""A session's plain results (``frontend/results.py``) as the wire API's messages, and its ends as gRPC's status
codes."""

from __future__ import annotations

import grpc

from cosystream.frontend.results import Response, Result, Word
from cosystream.frontend.status import Status
from cosystream.v1 import cosystream_pb2 as pb

STATUS_CODES = {status: next(code for code in grpc.StatusCode if code.value[0] == status) for status in Status}
"""The gRPC status code of each of the frontend's (they share their values)."""


def response_message(response: Response) -> pb.StreamingRecognizeResponse:
    latency = response.latency
    message = pb.StreamingRecognizeResponse(
        session_id=response.session_id,
        latency=pb.Latency(
            audio_processed_ms=latency.audio_processed_ms,
            queue_ms=latency.queue_ms,
            compute_ms=latency.compute_ms,
            receive_to_send_ms=latency.receive_to_send_ms,
        ),
    )
    if response.result is not None:
        message.results.append(result_message(response.result))
    if response.event is not None:
        message.speech_event.type = response.event.type
        message.speech_event.offset_ms = response.event.offset_ms
    return message


def result_message(result: Result) -> pb.StreamingResult:
    message = pb.StreamingResult(
        transcript=result.transcript,
        is_final=result.is_final,
        stability=result.stability,
        start_ms=result.start_ms,
        end_ms=result.end_ms,
        utterance_index=result.utterance_index,
        confidence=result.confidence,
        model=result.model,
        model_version=result.model_version,
        final_pass=result.final_pass,
        words=word_messages(result.words),
    )
    for alternative in result.alternatives:
        message.alternatives.add(
            transcript=alternative.transcript,
            confidence=alternative.confidence,
            words=word_messages(alternative.words),
        )
    return message


def word_messages(words: list[Word]) -> list[pb.WordInfo]:
    return [pb.WordInfo(word=w.word, start_ms=w.start_ms, end_ms=w.end_ms, confidence=w.confidence) for w in words]
