"""A recognition stream that survives dropped connections: the client half of session resume
(docs/RELIABILITY.md, "Session resume").

:class:`ResumableStream` opens a resumable stream (``StreamingConfig.resumable``) and hands its caller every
response once, in order, whatever happens to the connections under it. It keeps the audio the server has not
yet reported consumed (``StreamingRecognizeResponse.consumed_samples``; a resumable stream reports it at
least every second of audio, silence included, so that is about a second of audio plus what is in flight).
When a call fails UNAVAILABLE (a reset connection, a proxy recycling it, a server that went away) it opens a
new one with the resume token, the last consumed offset and the last response index, sends the audio again
from that offset, and carries on, with a backoff between attempts (:class:`ResumePolicy`). A draining server
(with ``--resume-key-file``) hands the session over instead: a last response carries its snapshot
(``resume_snapshot``), the call ends UNAVAILABLE, and the next call (which the load balancer sends to another
replica) goes on from the snapshot. The audio source
is read on meanwhile, so a live microphone loses nothing during an outage. It gives up, raising the last
error, when the server says the session is gone (NOT_FOUND: its resume window passed, or it was drained),
when an outage lasts longer than the policy allows, or on any other status::

    stream = ResumableStream(stub, pb.StreamingConfig(encoding=pb.LINEAR16, sample_rate_hz=16000))
    async for response in stream.recognize(chunks):  # chunks: any async iterable of encoded audio
        ...

Only the uncompressed encodings (LINEAR16, MULAW, ALAW) are resumable: the server picks a stream up at a
sample offset.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import AsyncIterable, AsyncIterator, Callable, Sequence
from dataclasses import dataclass

import grpc

from cosystream.v1 import cosystream_pb2 as pb
from cosystream.v1 import cosystream_pb2_grpc as pb_grpc
from cosystream.v1.client import StreamStatus

log = logging.getLogger(__name__)

BYTES_PER_SAMPLE = {pb.AUDIO_ENCODING_UNSPECIFIED: 2, pb.LINEAR16: 2, pb.MULAW: 1, pb.ALAW: 1}
"""The resumable encodings and their sample sizes (unspecified is LINEAR16)."""

TOKEN_METADATA = "cosystream-resume-token"
"""The initial-metadata key the server sends a resumable stream's token under."""

SESSION_METADATA = "cosystream-session-id"
"""The initial-metadata key of every stream's session id, sent once the session is admitted (an engine slot)."""


@dataclass(frozen=True, slots=True)
class ResumePolicy:
    """How hard a :class:`ResumableStream` tries to get its session back after its connection fails."""

    # Reconnections tried per outage; the count starts again once a new connection answers.
    attempts: int = 8
    first_delay_s: float = 0.1  # before the first reconnection; doubled for each next one
    max_delay_s: float = 2.0
    # An outage longer than this ends the stream: the server's --resume-window-s (default 30 s), after which
    # it no longer holds the session.
    outage_s: float = 30.0
    # At most this much unconfirmed audio is kept (the oldest is let go past it); a resume that needs audio
    # older than what is kept fails. With a server that reports consumed audio every second it is never near.
    max_buffer_s: float = 120.0

    def __post_init__(self) -> None:
        if self.attempts < 0:
            raise ValueError(f"attempts must be >= 0, got {self.attempts}")
        if not 0 <= self.first_delay_s <= self.max_delay_s:
            raise ValueError(
                f"need 0 <= first_delay_s <= max_delay_s, got {self.first_delay_s}, {self.max_delay_s}"
            )
        if not self.outage_s > 0 or not self.max_buffer_s > 0:
            raise ValueError("outage_s and max_buffer_s must be > 0")

    def delay_s(self, attempt: int) -> float:
        """The wait before reconnection number ``attempt`` (1, 2, ...)."""
        return min(self.max_delay_s, self.first_delay_s * 2 ** (attempt - 1))


DEFAULT_RESUME = ResumePolicy()
NO_RESUME = ResumePolicy(attempts=0)
"""A stream that is not resumable: the first failure ends it, and no audio is kept once sent."""


class ResumeError(Exception):
    """The session could not be resumed with the audio this client still has (see the message)."""


class ResumableStream:
    """One recognition session over as many connections as it takes; see the module's docstring.

    ``stub``: a ``CosyStreamStub`` over a ``grpc.aio`` channel (a channel reconnects by itself; a new call
    after a failure goes over a new connection). ``config``: the stream's config (``resumable`` is set here,
    unless the policy makes no attempts: :data:`NO_RESUME`);
    ``metadata``: sent with every call (an ``authorization`` token, ...); ``on_resume(n)``: called after the
    n-th resume, once the new call has been accepted. Counters for the curious: :attr:`connections`,
    :attr:`resumes`, :attr:`buffered_bytes`.
    """

    def __init__(
        self,
        stub: pb_grpc.CosyStreamStub,
        config: pb.StreamingConfig,
        *,
        policy: ResumePolicy = DEFAULT_RESUME,
        metadata: Sequence[tuple[str, str]] = (),
        on_resume: Callable[[int], None] | None = None,
    ):
        if policy.attempts and config.encoding not in BYTES_PER_SAMPLE:
            raise ValueError(
                f"encoding {pb.AudioEncoding.Name(config.encoding)} cannot be resumed: use LINEAR16, MULAW or ALAW"
            )
        self._stub = stub
        self.config = pb.StreamingConfig()
        self.config.CopyFrom(config)
        self.resumable = policy.attempts > 0
        self.config.resumable = self.resumable
        self.policy = policy
        self._metadata = tuple(metadata)
        self._on_resume = on_resume
        self._width = BYTES_PER_SAMPLE.get(config.encoding, 1)
        self._max_buffer_bytes = int(policy.max_buffer_s * config.sample_rate_hz) * self._width
        # The audio not yet confirmed: chunks as the source gave them, the first starting at byte _base.
        self._chunks: deque[bytes] = deque()
        self._base = 0
        self._end = 0  # bytes read from the source so far
        # Chunks let go (confirmed, or past max_buffer_s): a chunk's number less this is its index.
        self._trimmed = 0
        self._next = 0  # the number of the next chunk the current call sends (only chunks sent are let go)
        self._source_done = False
        self._source_error: BaseException | None = None
        self._more = asyncio.Event()  # new audio, or the source's end
        # The current call's config was accepted (its initial metadata came): audio is written only then, so
        # that it never races a refusal (whose status then arrives intact).
        self._accepted = asyncio.Event()
        # Set once a call's session is admitted (its initial metadata names it; a refusal for capacity has none):
        # a caller may wait for it before it commits to the stream (a telephony gateway, before it answers).
        self.admitted = asyncio.Event()
        self.status = StreamStatus()  # the status the last call really ended with (client.py)
        self.token = ""
        # A snapshot the server handed the session over with (a drain: StreamingRecognizeResponse.resume_snapshot)
        # and the offset it goes on from: the next call resumes from it, on whichever server it reaches.
        self.snapshot = b""
        self.snapshot_samples = 0
        self.consumed_samples = 0
        self.last_index = 0  # the response_index of the last response handed on
        self.connections = 0
        self.resumes = 0

    @property
    def buffered_bytes(self) -> int:
        """Audio kept in case of a resume: from the last consumed offset to what the source gave."""
        return self._end - self._base

    async def recognize(self, audio: AsyncIterable[bytes]) -> AsyncIterator[pb.StreamingRecognizeResponse]:
        """Stream ``audio`` (encoded as the config says; chunks of any size), yielding every response once.
        Ends when the server has ended the stream OK after the audio's end; raises ``grpc.aio.AioRpcError``
        with the status that ended it otherwise (or :class:`ResumeError`), and whatever the source raised
        once what it gave was transcribed."""
        feeder = asyncio.create_task(self._feed(audio))
        loop = asyncio.get_running_loop()
        lost_at: float | None = None  # when the current outage began
        attempt = 0
        try:
            while True:
                resuming = bool(self.token or self.snapshot)
                start = self.snapshot_samples if self.snapshot else self.consumed_samples
                if resuming and start * self._width < self._base:
                    raise ResumeError(
                        f"cannot resume: the session goes on from sample {start} and the audio "
                        f"before sample {self._base // self._width} was let go (max_buffer_s)"
                    )
                self.connections += 1
                self._accepted.clear()
                self.status = StreamStatus()
                call = self._stub.StreamingRecognize(self._requests(), metadata=self._metadata or None)
                try:
                    metadata = dict(await call.initial_metadata() or ())
                    if metadata.get(SESSION_METADATA):
                        self.admitted.set()
                    token = metadata.get(TOKEN_METADATA)
                    if token:
                        if resuming:
                            self.resumes += 1
                            log.info("stream resumed (%d) at sample %d", self.resumes, self.consumed_samples)
                            if self._on_resume is not None:
                                self._on_resume(self.resumes)
                        self.token, self.snapshot, lost_at, attempt = token, b"", None, 0
                    self._accepted.set()
                    async for response in call:
                        self.status.seen(response)
                        if response.HasField("error"):
                            continue  # (the call's status, as a last response: raised below, or resumed)
                        if response.response_index and response.response_index <= self.last_index:
                            continue  # (sent again by a server whose earlier copy did arrive)
                        self._confirmed(response)
                        yield response
                    break
                except grpc.aio.AioRpcError as failed:
                    err = self.status.resolve(failed)
                    if not self._lost(err):
                        raise err from None
                    now = loop.time()
                    lost_at = now if lost_at is None else lost_at
                    attempt += 1
                    if attempt > self.policy.attempts or now - lost_at > self.policy.outage_s:
                        raise err from None
                    delay_s = self.policy.delay_s(attempt)
                    log.info(
                        "stream lost (%s); reconnecting in %.2f s (attempt %d)", err.details(), delay_s, attempt
                    )
                    await asyncio.sleep(delay_s)
                finally:
                    call.cancel()
            if self._source_error is not None:
                raise self._source_error
        finally:
            feeder.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await feeder

    def _lost(self, err: grpc.aio.AioRpcError) -> bool:
        """Whether a call ended because its connection did (resume), not by the server's word (raise): the
        status UNAVAILABLE, or INTERNAL "Internal error from Core" with no status from the server, which is how
        grpcio's asyncio client reports a connection reset under a message being written (grpc/grpc#36066)."""
        if err.code() == grpc.StatusCode.UNAVAILABLE:
            return True
        return (
            err.code() == grpc.StatusCode.INTERNAL
            and self.status.error is None
            and "from Core" in (err.details() or "")
        )

    def _confirmed(self, response: pb.StreamingRecognizeResponse) -> None:
        """What a response says the server has: its index, its token, the audio it consumed (let go here)."""
        if response.response_index:
            self.last_index = response.response_index
        if response.resume_token:
            self.token = response.resume_token
        if response.resume_snapshot:  # (handed over: this call ends, the session goes on elsewhere)
            self.snapshot, self.snapshot_samples = response.resume_snapshot, response.consumed_samples
        if response.consumed_samples > self.consumed_samples:
            self.consumed_samples = response.consumed_samples
            consumed = self.consumed_samples * self._width
            while self._trimmed < self._next and self._base + len(self._chunks[0]) <= consumed:
                self._let_go()  # (only chunks this call has sent: a resume may still need the rest)

    def _let_go(self) -> None:
        self._base += len(self._chunks.popleft())
        self._trimmed += 1

    async def _feed(self, audio: AsyncIterable[bytes]) -> None:
        """Read the source into the buffer, whatever the connection is doing."""
        try:
            async for chunk in audio:
                if chunk:
                    self._chunks.append(bytes(chunk))
                    self._end += len(chunk)
                    while self._end - self._base > self._max_buffer_bytes and self._trimmed < self._next:
                        self._let_go()  # (sent, not confirmed: a resume from before it is no longer possible)
                    if self._end - self._base > self._max_buffer_bytes:
                        raise ResumeError(
                            f"the connection has taken no audio for {self.policy.max_buffer_s:g} s of it"
                        )
                    self._more.set()
        except Exception as err:  # (reported once what was sent is transcribed)
            self._source_error = err
        finally:
            self._source_done = True
            self._more.set()

    def _requests(self) -> AsyncIterator[pb.StreamingRecognizeRequest]:
        """One call's requests: the config (with the resume fields once there is a session), then the audio
        from the last consumed offset on, then a half-close once the source has ended. Made (not yet run)
        when the call is opened: the offset it resumes from is fixed then, and the chunks from there on are
        kept until this call has sent them, whatever the responses it replays say meanwhile."""
        config = self.config
        start = self.snapshot_samples if self.snapshot else self.consumed_samples if self.token else 0
        offset = start * self._width
        if self.snapshot or self.token:
            config = pb.StreamingConfig()
            config.CopyFrom(self.config)
            if self.snapshot:
                config.resume_snapshot = self.snapshot
            else:
                config.resume_token = self.token
            config.resume_offset_samples = start
            config.resume_after_response = self.last_index
        # The chunk holding that offset, and how far into it (the chunks before it are confirmed: skipped).
        self._next, skip = self._trimmed, offset - self._base
        while self._next - self._trimmed < len(self._chunks) and skip >= len(
            self._chunks[self._next - self._trimmed]
        ):
            skip -= len(self._chunks[self._next - self._trimmed])
            self._next += 1
        return self._write(config, max(0, skip))

    async def _write(self, config: pb.StreamingConfig, skip: int) -> AsyncIterator[pb.StreamingRecognizeRequest]:
        yield pb.StreamingRecognizeRequest(config=config)
        await self._accepted.wait()
        while True:
            self._more.clear()
            while self._next - self._trimmed < len(self._chunks):
                chunk = self._chunks[self._next - self._trimmed]
                self._next += 1
                yield pb.StreamingRecognizeRequest(audio=chunk[skip:] if skip else chunk)
                skip = 0
                if not self.resumable:
                    self._let_go()  # (nothing to send again)
            if self._source_done:
                return
            await self._more.wait()
