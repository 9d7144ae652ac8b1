"""Where results go: one JSON line per result to a stream (stdout or ``--jsonl FILE``) and, optionally,
the same object POSTed to a webhook (:class:`~cosystream.v1.webhook.WebhookPoster`).

A result line: ``{"call_id", "from", "to", "utterance_index", "start_ms", "end_ms", "text",
"is_final"}``; times are from the start of the call's audio (its first RTP packet or AudioSocket
frame). When a call ends, one more line says so and why: ``{"call_id", "from", "to", "event":
"call_ended", "reason", "audio_ms", "finals", "ok"}``, ``ok`` false for a call that ended with no
usable audio (no RTP at all, RTP only from sources that were dropped) or whose session failed. A
DTMF digit the caller pressed (RFC 4733 telephone-events, AudioSocket DTMF frames) is a line too:
``{"call_id", "from", "to", "event": "dtmf", "digit", "at_ms"}`` (``at_ms``: the call's audio time).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TextIO

from cosystream.v1 import cosystream_pb2 as pb
from cosystream.v1.webhook import WebhookPoster


@dataclass(frozen=True, slots=True)
class CallInfo:
    """Who is talking: the SIP Call-ID (or AudioSocket UUID) and the From/To URIs."""

    call_id: str
    from_uri: str = ""
    to_uri: str = ""


def result_line(info: CallInfo, result: pb.StreamingResult) -> dict:
    return {
        "call_id": info.call_id,
        "from": info.from_uri,
        "to": info.to_uri,
        "utterance_index": result.utterance_index,
        "start_ms": result.start_ms,
        "end_ms": result.end_ms,
        "text": result.transcript,
        "is_final": result.is_final,
    }


def end_line(info: CallInfo, reason: str, audio_ms: int, finals: int, ok: bool) -> dict:
    return {
        "call_id": info.call_id,
        "from": info.from_uri,
        "to": info.to_uri,
        "event": "call_ended",
        "reason": reason,
        "audio_ms": audio_ms,
        "finals": finals,
        "ok": ok,
    }


class ResultSink:
    """Writes each result line to ``stream`` (flushed per line) and hands it to the webhook, if any."""

    def __init__(self, stream: TextIO, webhook: WebhookPoster | None = None):
        self.stream = stream
        self.webhook = webhook

    def write(self, info: CallInfo, result: pb.StreamingResult) -> None:
        self._put(result_line(info, result))

    def ended(self, info: CallInfo, reason: str, audio_ms: int, finals: int, ok: bool) -> None:
        """The call's last line: it ended, why, and whether it had usable audio."""
        self._put(end_line(info, reason, audio_ms, finals, ok))

    def dtmf(self, info: CallInfo, digit: str, at_ms: int) -> None:
        self._put(
            {
                "call_id": info.call_id,
                "from": info.from_uri,
                "to": info.to_uri,
                "event": "dtmf",
                "digit": digit,
                "at_ms": at_ms,
            }
        )

    def _put(self, line: dict) -> None:
        self.stream.write(json.dumps(line) + "\n")
        self.stream.flush()
        if self.webhook is not None:
            self.webhook.post(line)
