"""Asterisk AudioSocket ingress: Asterisk connects over TCP (``AudioSocket(uuid,host:port)`` in the
dialplan) and sends frames of a 3-byte header (kind, 16-bit big-endian length) and a payload:

- 0x01: the call's UUID (16 bytes), first; it becomes the result lines' ``call_id``;
- 0x10: audio, signed 16-bit little-endian mono at 8 kHz, 20 ms (320 bytes) per frame;
- 0x03: a DTMF digit (a "dtmf" line); 0x00: hang-up; 0xff: an error from Asterisk.

Each connection is one cosystream session (LINEAR16, 8000 Hz, REALTIME); the hang-up (or the
connection closing) half-closes it, and the connection is closed after the last final.

AudioSocket has no authentication: a connection from outside ``config.allow`` is reset at once,
before a byte is read.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
import uuid

import grpc

from cosystream.v1 import cosystream_pb2 as pb
from cosystream.v1 import cosystream_pb2_grpc as pb_grpc

from .asr import AsrStream, streaming_config
from .call import CallSlots
from .config import GatewayConfig
from .output import CallInfo, ResultSink
from .security import AllowList, SecurityStats, should_log

logger = logging.getLogger(__name__)

KIND_HANGUP = 0x00
KIND_UUID = 0x01
KIND_DTMF = 0x03
KIND_AUDIO = 0x10
KIND_ERROR = 0xFF


async def read_frame(reader: asyncio.StreamReader) -> tuple[int, bytes] | None:
    """One frame, or None at the end of the stream."""
    try:
        header = await reader.readexactly(3)
        payload = await reader.readexactly(int.from_bytes(header[1:], "big"))
    except asyncio.IncompleteReadError:
        return None
    return header[0], payload


def frame(kind: int, payload: bytes = b"") -> bytes:
    return bytes([kind]) + len(payload).to_bytes(2, "big") + payload


class AudioSocketServer:
    def __init__(
        self,
        config: GatewayConfig,
        stub: pb_grpc.CosyStreamStub,
        sink: ResultSink,
        slots: CallSlots,
        security: SecurityStats | None = None,
    ):
        self.config = config
        self.security = security or SecurityStats()
        self._allow = AllowList(config.allow)
        self._stub = stub
        self._sink = sink
        self._slots = slots
        self._server: asyncio.Server | None = None
        self._sessions: set[asyncio.Task] = set()
        self._streams: set[AsrStream] = set()
        self._stopping = False
        self.address: tuple[str, int] = (config.bind, config.audiosocket_port or 0)

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, self.config.bind, self.config.audiosocket_port)
        self.address = self._server.sockets[0].getsockname()[:2]
        logger.info("AudioSocket on tcp %s:%d, from %s only", *self.address, self._allow.describe())

    async def stop(self) -> None:
        """Stop listening; end every call (its last final flushed, for up to ``flush_timeout_s``)."""
        self._stopping = True
        if self._server is not None:
            self._server.close()
        for asr in self._streams:
            asr.close()
        if self._sessions:
            await asyncio.wait(list(self._sessions), timeout=self.config.flush_timeout_s)
        for task in list(self._sessions):
            task.cancel()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._sessions.add(task)
        peer = writer.get_extra_info("peername") or ("?", 0)
        try:
            if peer[0] not in self._allow:
                self._refuse(writer, peer)
                return
            if not self._slots.try_acquire():
                logger.warning("AudioSocket %s:%d refused: %d calls already", *peer[:2], self._slots.active)
                writer.write(frame(KIND_HANGUP))
                return
            try:
                await self._serve(reader, peer)
            finally:
                self._slots.release()
        except (TimeoutError, ConnectionError) as err:
            logger.warning("AudioSocket %s:%d: %s", *peer[:2], err or type(err).__name__)
        finally:
            self._sessions.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    def _refuse(self, writer: asyncio.StreamWriter, peer: tuple) -> None:
        self.security.audiosocket_refused += 1
        if should_log(self.security.audiosocket_refused):
            logger.warning(
                "AudioSocket %s:%d refused: not in --allow %s (%d refused)",
                *peer[:2],
                self._allow.describe(),
                self.security.audiosocket_refused,
            )
        sock = writer.get_extra_info("socket")
        if sock is not None:  # linger 0: the close resets the connection rather than ending it politely
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))

    async def _serve(self, reader: asyncio.StreamReader, peer: tuple) -> None:
        first = await asyncio.wait_for(read_frame(reader), self.config.rtp_timeout_s)
        if first is None or first[0] != KIND_UUID or len(first[1]) != 16:
            logger.warning("AudioSocket %s:%d: the first frame is not a UUID; closing", *peer[:2])
            return
        info = CallInfo(str(uuid.UUID(bytes=first[1])))
        asr = AsrStream(
            self._stub,
            streaming_config(
                pb.LINEAR16, self.config.interim_results, self.config.phrases, self.config.vocabulary
            ),
            lambda result: self._sink.write(info, result),
        )
        logger.info("AudioSocket call %s from %s:%d", info.call_id, *peer[:2])
        self._streams.add(asr)
        session = asyncio.ensure_future(asr.run())
        receive = asyncio.ensure_future(self._receive(reader, asr, info))
        reason, failed = "", False
        try:
            done, _ = await asyncio.wait({session, receive}, return_when=asyncio.FIRST_COMPLETED)
            if receive in done:
                reason = receive.result()
                asr.close()
                await asyncio.wait_for(session, self.config.flush_timeout_s)
            else:
                session.result()
                reason = "the gateway is stopping" if self._stopping else "the server ended the session"
        except grpc.aio.AioRpcError as err:
            failed = True
            reason = f"the cosystream session failed: {err.code().name}: {err.details()}"
            logger.error("AudioSocket call %s: %s", info.call_id, reason)
        finally:
            self._streams.discard(asr)
            for task in (session, receive):
                if not task.done():
                    task.cancel()
                    with contextlib.suppress(BaseException):
                        await task
            reason = reason or "cancelled"
            self._sink.ended(info, reason, asr.sent_ms, asr.finals, ok=asr.sent_ms > 0 and not failed)
            logger.log(
                logging.INFO if asr.sent_ms else logging.WARNING,
                "AudioSocket call %s ended (%s): %.1f s of audio, %d finals",
                info.call_id,
                reason,
                asr.sent_ms / 1000,
                asr.finals,
            )

    async def _receive(self, reader: asyncio.StreamReader, asr: AsrStream, info: CallInfo) -> str:
        """Feed audio until the call ends; return why it ended."""
        while True:
            try:
                received = await asyncio.wait_for(read_frame(reader), self.config.rtp_timeout_s)
            except TimeoutError:
                return f"no frame for {self.config.rtp_timeout_s:g} s"
            if received is None:
                return "the connection closed"
            kind, payload = received
            if kind == KIND_AUDIO:
                asr.feed(payload)
            elif kind == KIND_DTMF and payload:
                self._sink.dtmf(info, payload[:1].decode("ascii", "replace"), asr.sent_ms)
            elif kind == KIND_HANGUP:
                return "Asterisk hung up"
            elif kind == KIND_ERROR:
                logger.warning("AudioSocket call %s: Asterisk reported error %s", info.call_id, payload.hex())
                return "Asterisk reported an error"
