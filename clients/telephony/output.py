"""Where results go: one JSON line per result to a stream (stdout or ``--jsonl FILE``) and, optionally,
the same object POSTed to a webhook.

A result line: ``{"call_id", "from", "to", "utterance_index", "start_ms", "end_ms", "text",
"is_final"}``; times are from the start of the call's audio (its first RTP packet or AudioSocket
frame). When a call ends, one more line says so and why: ``{"call_id", "from", "to", "event":
"call_ended", "reason", "audio_ms", "finals", "ok"}``, ``ok`` false for a call that ended with no
usable audio (no RTP at all, RTP only from sources that were dropped) or whose session failed. A
DTMF digit the caller pressed (RFC 4733 telephone-events, AudioSocket DTMF frames) is a line too:
``{"call_id", "from", "to", "event": "dtmf", "digit", "at_ms"}`` (``at_ms``: the call's audio time).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import urllib.request
from dataclasses import dataclass
from typing import TextIO

from cosystream.v1 import cosystream_pb2 as pb

logger = logging.getLogger(__name__)


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


class WebhookPoster:
    """POSTs lines as JSON, in order, from one background task; a slow or failing webhook never holds up
    a call: lines beyond ``max_queued`` are dropped, failures are logged."""

    def __init__(self, url: str, timeout_s: float = 5.0, max_queued: int = 1000):
        self.url = url
        self.timeout_s = timeout_s
        self._queue: asyncio.Queue[bytes] = asyncio.Queue(max_queued)
        self._task: asyncio.Task | None = None
        self.dropped = 0

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._post_all(), name="webhook")

    def post(self, line: dict) -> None:
        try:
            self._queue.put_nowait(json.dumps(line).encode())
        except asyncio.QueueFull:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 100 == 0:
                logger.warning("webhook %s is behind: %d lines dropped", self.url, self.dropped)

    async def stop(self, grace_s: float = 5.0) -> None:
        """Post what is queued (for up to ``grace_s``), then stop."""
        if self._task is None:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._queue.join(), grace_s)
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    async def _post_all(self) -> None:
        while True:
            body = await self._queue.get()
            try:
                await asyncio.to_thread(self._post, body)
            except Exception as err:  # a webhook failure is logged; the gateway keeps going
                logger.warning("webhook %s: %s", self.url, err)
            finally:
                self._queue.task_done()

    def _post(self, body: bytes) -> None:
        request = urllib.request.Request(
            self.url, data=body, method="POST", headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
            response.read()


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
