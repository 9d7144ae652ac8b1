"""One stream's audio bytes, in any wire encoding, to float32 mono samples at 16 kHz, as the bytes arrive.

* LINEAR16, MULAW, ALAW: :class:`~cosystream.audio.codecs.PcmDecoder`, then the resampler.
* OGG_OPUS (Ogg pages, RFC 7845) and WEBM_OPUS (Matroska/WebM, what browsers' ``MediaRecorder`` and many
  WebRTC recorders write): Opus packets decoded by libavcodec's Opus decoder (PyAV, the ``codecs`` extra),
  48 kHz, then the resampler.
* FLAC (a native FLAC stream, ``fLaC`` and its metadata first): frames decoded by libavcodec's FLAC decoder;
  a frame is decoded once the next one begins (its end is not written in it), so FLAC adds one frame of
  latency: 4096 samples (256 ms at 16 kHz) for libFLAC's default block size. The last frame comes at the
  end of the stream.

Why the containers are read here and not by libavformat: its demuxers pull from a blocking reader and read
ahead to probe the stream (``avformat_find_stream_info``), while a stream's bytes are pushed to us a chunk at
a time on the event loop; Ogg pages and the few Matroska elements an audio track needs are simple and
length-prefixed, so they are split here in a few lines, and only the codecs (the hard part) come from the
library. libavcodec's FLAC parser was measured unusable for streaming: it holds ten frames back before it
returns one (2.5 s at 16 kHz), and PyAV's ``parse`` returns one packet per call, so frames queued in it
were lost at the end.

Every byte buffered is bounded (a page, a block, a frame: at most :data:`MAX_PACKET_BYTES`); anything that is
not the declared format raises :class:`AudioFormatError` with what was wrong, which the servicer turns into
INVALID_ARGUMENT after the final for what was heard.
"""

from __future__ import annotations

import functools
import importlib.util
import struct
from typing import Protocol

import numpy as np

from cosystream.audio.codecs import MAX_INPUT_RATE_HZ, MIN_INPUT_RATE_HZ, AudioEncoding, PcmDecoder
from cosystream.audio.resample import Resampler

OPUS_RATE_HZ = 48000
"""Opus always decodes at 48 kHz here; the rate a stream declares for Opus audio is only checked."""

OPUS_RATES_HZ = (8000, 12000, 16000, 24000, 48000)
"""The rates Opus encodes at; a stream that declares a rate for Opus audio declares one of these."""

MAX_PACKET_BYTES = 1 << 20
"""The most a compressed stream may buffer: one Ogg packet, one Matroska element, one FLAC frame (an Opus
packet is at most 120 ms, ~60 KB at any bitrate; a FLAC frame of 65535 samples of 8 channels x 24 bits is
~1.5 MB only in theory: encoders write 4096-sample frames, tens of KB)."""

COMPRESSED = frozenset({AudioEncoding.OGG_OPUS, AudioEncoding.FLAC, AudioEncoding.WEBM_OPUS})

_EMPTY = np.zeros(0, dtype=np.float32)


class AudioFormatError(ValueError):
    """The stream's bytes are not audio in its declared encoding (the message says what was wrong)."""


class StreamAudio(Protocol):
    """What a session reads its audio through."""

    int16_levels: bool  # every sample is an int16 level / 32768 (the VAD converts it back without clipping)

    def decode(self, chunk: bytes) -> np.ndarray:
        """The 16 kHz samples ``chunk`` completes (a new array, possibly empty)."""
        ...

    def flush(self) -> np.ndarray:
        """End of stream: the samples still held back."""
        ...


@functools.cache
def codecs_available() -> bool:
    """Whether the compressed encodings can be decoded here (PyAV installed: the ``codecs`` extra). Looked
    up, not imported: PyAV (its FFmpeg libraries) is loaded by the first compressed stream."""
    return importlib.util.find_spec("av") is not None


def open_stream_audio(encoding: AudioEncoding, sample_rate_hz: int) -> StreamAudio:
    """A decoder for one stream. ``sample_rate_hz``: the rate declared (for LINEAR16 and G.711 the rate of
    the samples; for FLAC 0 or the header's; for Opus 0 or one of :data:`OPUS_RATES_HZ`, not used)."""
    if encoding == AudioEncoding.OGG_OPUS:
        return OggOpusAudio()
    if encoding == AudioEncoding.WEBM_OPUS:
        return WebmOpusAudio()
    if encoding == AudioEncoding.FLAC:
        return FlacAudio(sample_rate_hz)
    return PcmAudio(encoding, sample_rate_hz)


class PcmAudio:
    """LINEAR16 and G.711 at their declared rate."""

    __slots__ = ("_pcm", "_resampler", "int16_levels")

    def __init__(self, encoding: AudioEncoding, sample_rate_hz: int):
        self._pcm = PcmDecoder(encoding)
        self._resampler = Resampler(sample_rate_hz)
        # Decoded LINEAR16 and G.711 samples are int16 levels / 32768 until a resampler changes them.
        self.int16_levels = not self._resampler.resamples

    def decode(self, chunk: bytes) -> np.ndarray:
        return self._resampler.process(self._pcm.decode(chunk))

    def flush(self) -> np.ndarray:
        return self._resampler.flush()


def _mono(frame) -> np.ndarray:
    """A decoded PyAV audio frame as float32 mono in [-1, 1] (the mean of its channels)."""
    samples = frame.to_ndarray()
    channels = len(frame.layout.channels)
    if not frame.format.is_planar:
        samples = samples.reshape(-1, channels).T
    if samples.dtype == np.int16:
        scale = 1.0 / 32768.0
    elif samples.dtype == np.int32:
        scale = 1.0 / 2147483648.0
    else:
        scale = 1.0
    mono = samples[0] if channels == 1 else samples.mean(axis=0, dtype=np.float32)
    return np.multiply(mono, scale, dtype=np.float32) if scale != 1.0 else np.asarray(mono, dtype=np.float32)


class _Codec:
    """A libavcodec decoder fed one packet at a time."""

    __slots__ = ("_av", "_context", "name")

    def __init__(self, codec: str, extradata: bytes, name: str):
        try:
            import av
        except ImportError:
            raise AudioFormatError(
                f"{name} audio needs PyAV on the server (pip install 'cosystream[codecs]')"
            ) from None
        self._av = av
        self.name = name
        self._context = av.CodecContext.create(codec, "r")
        self._context.extradata = extradata

    def decode(self, packet: bytes) -> list[np.ndarray]:
        try:
            return [_mono(frame) for frame in self._context.decode(self._av.Packet(packet))]
        except self._av.FFmpegError as err:
            raise AudioFormatError(f"{self.name}: a packet does not decode ({err})") from None


def _concat(parts: list[np.ndarray]) -> np.ndarray:
    if not parts:
        return _EMPTY
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


class _OpusTrack:
    """Opus packets (after the OpusHead) to 16 kHz samples."""

    __slots__ = ("_codec", "_resampler", "emitted", "pre_skip")

    def __init__(self, head: bytes, container: str):
        if len(head) < 19 or not head.startswith(b"OpusHead"):
            raise AudioFormatError(f"{container}: the Opus stream does not begin with an OpusHead header")
        if head[8] >> 4:
            raise AudioFormatError(f"{container}: OpusHead version {head[8]} is not supported (only 0.x)")
        self.pre_skip = struct.unpack_from("<H", head, 10)[0]
        self._codec = _Codec("opus", bytes(head), container)  # applies the pre-skip itself
        self._resampler = Resampler(OPUS_RATE_HZ)
        self.emitted = 0  # 48 kHz samples decoded (after the pre-skip)

    def decode(self, packets: list[bytes], keep: int | None = None) -> np.ndarray:
        """``keep``: the stream's total length in 48 kHz samples, known at its last page (the encoder
        padded its last packet: what goes past the total is cut)."""
        parts = [samples for packet in packets for samples in self._codec.decode(packet)]
        samples = _concat(parts)
        if keep is not None and self.emitted + len(samples) > keep:
            samples = samples[: max(0, keep - self.emitted)]
        self.emitted += len(samples)
        return self._resampler.process(samples)

    def flush(self) -> np.ndarray:
        return self._resampler.flush()


class OggOpusAudio:
    """Ogg pages (RFC 3533) carrying one Opus stream (RFC 7845): the first logical stream that begins with
    an OpusHead; pages of other streams are skipped, a chained stream (a new one after the end of the
    previous) is read on."""

    __slots__ = ("_buffer", "_opened", "_packet", "_serial", "_state", "_track", "int16_levels")

    NAME = "OGG_OPUS"

    def __init__(self):
        self._buffer = bytearray()
        self._packet = bytearray()  # a packet continued on the next page
        self._serial: int | None = None
        self._state = 0  # 0: OpusHead next, 1: OpusTags next, 2: audio
        self._track: _OpusTrack | None = None
        self._opened = False  # an Opus stream began (pages of other streams are skipped from then on)
        self.int16_levels = False

    def decode(self, chunk: bytes) -> np.ndarray:
        self._buffer += chunk
        out: list[np.ndarray] = []
        buffer = self._buffer
        start = 0
        while len(buffer) - start >= 27:
            if buffer[start : start + 4] != b"OggS":
                found = bytes(buffer[start : start + 8])
                raise AudioFormatError(f"{self.NAME}: expected an Ogg page ('OggS') at its start, got {found!r}")
            segments = buffer[start + 26]
            header = 27 + segments
            if len(buffer) - start < header:
                break
            lacing = buffer[start + 27 : start + header]
            size = header + sum(lacing)
            if len(buffer) - start < size:
                break
            flags = buffer[start + 5]
            granule, serial = struct.unpack_from("<qI", buffer, start + 6)
            packets = self._packets(memoryview(buffer)[start + header : start + size], lacing, flags & 1)
            start += size
            samples = self._page(serial, flags, granule, packets)
            if len(samples):
                out.append(samples)
        del buffer[:start]
        return _concat(out)

    def _packets(self, body: memoryview, lacing: bytes, continued: int) -> list[bytes]:
        """The packets that end on this page (a packet left open goes on to the next)."""
        if not continued:
            self._packet.clear()
        packets = []
        offset = 0
        for length in lacing:
            self._packet += body[offset : offset + length]
            offset += length
            if len(self._packet) > MAX_PACKET_BYTES:
                raise AudioFormatError(f"{self.NAME}: an Ogg packet is over {MAX_PACKET_BYTES} bytes")
            if length < 255:
                packets.append(bytes(self._packet))
                self._packet.clear()
        return packets

    def _page(self, serial: int, flags: int, granule: int, packets: list[bytes]) -> np.ndarray:
        if self._serial is None:
            if flags & 2 and packets and packets[0].startswith(b"OpusHead"):
                self._serial = serial
            elif flags & 2 or self._opened:
                return _EMPTY  # the first page of another logical stream (a video track, metadata)
            else:
                raise AudioFormatError(f"{self.NAME}: the stream does not begin with an Opus header page")
        if serial != self._serial:
            return _EMPTY
        out = []
        for index, packet in enumerate(packets):
            if self._state == 0:
                self._track = _OpusTrack(packet, self.NAME)
                self._state, self._opened = 1, True
            elif self._state == 1:
                if not packet.startswith(b"OpusTags"):
                    raise AudioFormatError(f"{self.NAME}: the OpusHead is not followed by OpusTags")
                self._state = 2
            else:
                audio = packets[index:]
                keep = granule - self._track.pre_skip if flags & 4 and granule >= 0 else None
                out.append(self._track.decode(audio, keep))
                break
        if flags & 4:  # the end of this stream: a chained one may follow
            if self._track is not None:
                out.append(self._track.flush())
            self._state, self._serial, self._track = 0, None, None
        return _concat(out)

    def flush(self) -> np.ndarray:
        self._buffer.clear()  # (a page cut short: the client's file ended inside it)
        return self._track.flush() if self._track is not None else _EMPTY


# Matroska element IDs (with their length marker, as written).
_EBML, _SEGMENT, _CLUSTER, _TRACKS, _TRACK_ENTRY, _BLOCK_GROUP = (
    0x1A45DFA3,
    0x18538067,
    0x1F43B675,
    0x1654AE6B,
    0xAE,
    0xA0,
)
_TRACK_NUMBER, _CODEC_ID, _CODEC_PRIVATE, _AUDIO, _CHANNELS = 0xD7, 0x86, 0x63A2, 0xE1, 0x9F
_SIMPLE_BLOCK, _BLOCK = 0xA3, 0xA1
_MASTERS = frozenset({_SEGMENT, _CLUSTER, _TRACKS, _TRACK_ENTRY, _BLOCK_GROUP, _AUDIO})
"""Elements read into (their children follow, often of unknown size while a recorder is still writing)."""
_READ = frozenset({_TRACK_NUMBER, _CODEC_ID, _CODEC_PRIVATE, _CHANNELS, _SIMPLE_BLOCK, _BLOCK})
"""Elements whose payload is read; every other is skipped without being buffered."""


def _vint(data: bytearray | bytes, pos: int, keep_marker: bool) -> tuple[int, int] | None:
    """An EBML variable-length integer at ``pos``: (value, length), None if not all there; value -1 for
    an unknown size (all ones)."""
    if pos >= len(data):
        return None
    first = data[pos]
    if not first:
        raise AudioFormatError("WEBM_OPUS: an element's ID or size is malformed (a zero first byte)")
    length = 9 - first.bit_length()
    if pos + length > len(data):
        return None
    value = first if keep_marker else first & (0xFF >> length)
    for byte in data[pos + 1 : pos + length]:
        value = (value << 8) | byte
    if not keep_marker and value == (1 << (7 * length)) - 1:
        value = -1
    return value, length


def _past_skip(parser, chunk: bytes) -> bytes | memoryview:
    """What of ``chunk`` follows the bytes ``parser`` still skips (an element it does not need, never
    buffered), counting them down."""
    if not parser._skip:
        return chunk
    dropped = min(parser._skip, len(chunk))
    parser._skip -= dropped
    return memoryview(chunk)[dropped:]


class WebmOpusAudio:
    """The Opus track of a WebM (Matroska) stream: the first track whose codec is ``A_OPUS``; blocks of
    other tracks are skipped. SimpleBlocks and BlockGroups, with or without lacing."""

    __slots__ = ("_buffer", "_opus_track", "_skip", "_started", "_track", "_tracks", "int16_levels")

    NAME = "WEBM_OPUS"

    def __init__(self):
        self._buffer = bytearray()
        self._skip = 0  # bytes of a skipped element still to come
        self._started = False
        self._tracks: list[dict] = []  # per TrackEntry: number, codec, private, channels
        self._opus_track: int | None = None
        self._track: _OpusTrack | None = None
        self.int16_levels = False

    def decode(self, chunk: bytes) -> np.ndarray:
        buffer = self._buffer
        buffer += _past_skip(self, chunk)
        if not self._started and len(buffer) >= 4:
            if buffer[:4] != b"\x1a\x45\xdf\xa3":
                found = bytes(buffer[:8])
                raise AudioFormatError(f"{self.NAME}: expected a WebM (EBML) header at its start, got {found!r}")
            self._started = True
        out: list[np.ndarray] = []
        pos = 0
        while self._started and not self._skip:
            element = _vint(buffer, pos, keep_marker=True)
            if element is None:
                break
            element_id, id_length = element
            size = _vint(buffer, pos + id_length, keep_marker=False)
            if size is None:
                break
            size, size_length = size
            body = pos + id_length + size_length
            if element_id in _MASTERS:
                if element_id == _TRACK_ENTRY:
                    self._tracks.append({})
                pos = body
                continue
            if size < 0:
                raise AudioFormatError(f"{self.NAME}: element 0x{element_id:X} has an unknown size")
            if element_id not in _READ:
                available = len(buffer) - body
                if available < size:
                    self._skip = size - available
                    pos = len(buffer)
                    break
                pos = body + size
                continue
            if size > MAX_PACKET_BYTES:
                raise AudioFormatError(f"{self.NAME}: element 0x{element_id:X} is over {MAX_PACKET_BYTES} bytes")
            if len(buffer) - body < size:
                break
            payload = bytes(buffer[body : body + size])
            pos = body + size
            samples = self._element(element_id, payload)
            if samples is not None and len(samples):
                out.append(samples)
        del buffer[:pos]
        return _concat(out)

    def _element(self, element_id: int, payload: bytes) -> np.ndarray | None:
        if element_id in (_SIMPLE_BLOCK, _BLOCK):
            return self._block(payload)
        if not self._tracks:
            return None  # (a track field outside a TrackEntry: ignored)
        track = self._tracks[-1]
        if element_id == _TRACK_NUMBER:
            track["number"] = int.from_bytes(payload, "big")
        elif element_id == _CODEC_ID:
            track["codec"] = payload.rstrip(b"\0").decode("ascii", "replace")
        elif element_id == _CODEC_PRIVATE:
            track["private"] = payload
        elif element_id == _CHANNELS:
            track["channels"] = int.from_bytes(payload, "big")
        return None

    def _open_track(self) -> None:
        for track in self._tracks:
            if track.get("codec") == "A_OPUS" and "number" in track:
                head = track.get("private")
                if not head:  # (a writer that left it out: the defaults of RFC 7845)
                    head = (
                        b"OpusHead\x01" + bytes([track.get("channels", 1)]) + struct.pack("<HIhB", 0, 48000, 0, 0)
                    )
                self._opus_track = track["number"]
                self._track = _OpusTrack(head, self.NAME)
                return
        codecs = ", ".join(track.get("codec", "?") for track in self._tracks) or "no tracks"
        raise AudioFormatError(f"{self.NAME}: the WebM stream has no Opus track ({codecs})")

    def _block(self, block: bytes) -> np.ndarray:
        if self._track is None:
            self._open_track()
        number = _vint(block, 0, keep_marker=False)
        if number is None or len(block) < number[1] + 3:
            raise AudioFormatError(f"{self.NAME}: a block is shorter than its header")
        track, length = number
        if track != self._opus_track:
            return _EMPTY
        flags = block[length + 2]
        frames = _unlace(block, length + 3, (flags >> 1) & 3, self.NAME)
        return self._track.decode(frames)

    def flush(self) -> np.ndarray:
        self._buffer.clear()
        return self._track.flush() if self._track is not None else _EMPTY


def _unlace(block: bytes, pos: int, lacing: int, name: str) -> list[bytes]:
    """A Matroska block's frames: one (no lacing), or several in Xiph, fixed-size or EBML lacing."""
    if lacing == 0:
        return [block[pos:]]
    if pos >= len(block):
        raise AudioFormatError(f"{name}: a laced block has no frame count")
    count = block[pos] + 1
    pos += 1
    sizes: list[int] = []
    if lacing == 2:  # fixed: equal sizes
        total = len(block) - pos
        if total % count:
            raise AudioFormatError(f"{name}: a fixed-size laced block does not divide into {count} frames")
        sizes = [total // count] * count
    elif lacing == 1:  # Xiph: each size as a run of 255s and a last byte
        for _ in range(count - 1):
            size = 0
            while True:
                if pos >= len(block):
                    raise AudioFormatError(f"{name}: a Xiph-laced block is cut short")
                byte = block[pos]
                pos += 1
                size += byte
                if byte < 255:
                    break
            sizes.append(size)
    else:  # EBML: the first size, then signed differences
        first = _vint(block, pos, keep_marker=False)
        if first is None:
            raise AudioFormatError(f"{name}: an EBML-laced block is cut short")
        size, length = first
        pos += length
        sizes.append(size)
        for _ in range(count - 2):
            delta = _vint(block, pos, keep_marker=False)
            if delta is None:
                raise AudioFormatError(f"{name}: an EBML-laced block is cut short")
            value, length = delta
            pos += length
            size += value - ((1 << (7 * length - 1)) - 1)
            sizes.append(size)
    if lacing != 2:
        sizes.append(len(block) - pos - sum(sizes))
    frames = []
    for size in sizes:
        if size < 0 or pos + size > len(block):
            raise AudioFormatError(f"{name}: a laced block's frame sizes overrun it")
        frames.append(block[pos : pos + size])
        pos += size
    return frames


_CRC8 = []
for _byte in range(256):
    _crc = _byte
    for _ in range(8):
        _crc = ((_crc << 1) ^ 0x07) & 0xFF if _crc & 0x80 else (_crc << 1) & 0xFF
    _CRC8.append(_crc)
del _byte, _crc


_MORE = object()
"""A FLAC frame header cut by the end of the buffer: more bytes tell."""


def _flac_number(data: bytearray, pos: int):
    """The frame or sample number in a FLAC frame header (UTF-8-like, 1 to 7 bytes): (value, length); None
    if malformed, :data:`_MORE` if cut by the end of ``data``."""
    first = data[pos]
    if first < 0x80:
        return first, 1
    length = 8 - (first ^ 0xFF).bit_length() if first != 0xFF else 8
    if length < 2 or length > 7:
        return None
    if pos + length > len(data):
        return _MORE
    value = first & (0x7F >> length)
    for byte in data[pos + 1 : pos + length]:
        if byte & 0xC0 != 0x80:
            return None
        value = (value << 6) | (byte & 0x3F)
    return value, length


class FlacAudio:
    """A native FLAC stream: ``fLaC``, its metadata blocks (STREAMINFO first), then frames."""

    __slots__ = (
        "_buffer",
        "_codec",
        "_declared_hz",
        "_frame_key",
        "_next_number",
        "_resampler",
        "_scan",
        "_skip",
        "_state",
        "_streaminfo",
        "int16_levels",
        "sample_rate_hz",
    )

    NAME = "FLAC"

    def __init__(self, declared_hz: int = 0):
        self._declared_hz = declared_hz
        self._buffer = bytearray()
        self._state = 0  # 0: magic, 1: metadata, 2: frames
        self._skip = 0  # bytes of a skipped metadata block (a picture) still to come
        self._streaminfo = b""
        self._codec: _Codec | None = None
        self._resampler: Resampler | None = None
        self._scan = 0  # where the search for the next frame's header resumes
        self._frame_key: tuple | None = None  # (rate code, sample size code, blocking) of the first frame
        self._next_number: int | None = None  # the frame number the next frame's header must carry
        self.sample_rate_hz = 0
        self.int16_levels = False

    def decode(self, chunk: bytes) -> np.ndarray:
        buffer = self._buffer
        buffer += _past_skip(self, chunk)
        if self._state == 0:
            if len(buffer) < 4:
                return _EMPTY
            if buffer[:4] != b"fLaC":
                found = bytes(buffer[:8])
                hint = " (Ogg FLAC is not supported: send native FLAC)" if found.startswith(b"OggS") else ""
                raise AudioFormatError(
                    f"{self.NAME}: expected a FLAC stream ('fLaC') at its start, got {found!r}{hint}"
                )
            del buffer[:4]
            self._state = 1
        while self._state == 1 and not self._skip and len(buffer) >= 4:
            kind, size = buffer[0], int.from_bytes(buffer[1:4], "big")
            if kind & 0x7F == 0:
                if len(buffer) < 4 + size:
                    return _EMPTY
                self._open(bytes(buffer[4 : 4 + size]))
            elif not self._streaminfo:
                raise AudioFormatError(f"{self.NAME}: the first metadata block is not STREAMINFO")
            if kind & 0x80:
                self._state = 2
            available = len(buffer) - 4
            if available < size:
                self._skip = size - available
                buffer.clear()
                return _EMPTY
            del buffer[: 4 + size]
        if self._state != 2:
            return _EMPTY
        return self._frames(final=False)

    def _open(self, streaminfo: bytes) -> None:
        if len(streaminfo) < 34:
            raise AudioFormatError(f"{self.NAME}: STREAMINFO is {len(streaminfo)} bytes, not 34")
        rate = int.from_bytes(streaminfo[10:13], "big") >> 4
        if self._declared_hz and rate != self._declared_hz:
            raise AudioFormatError(
                f"{self.NAME}: sample_rate_hz={self._declared_hz} does not match the stream's header ({rate} Hz): "
                "leave it 0 or make it match"
            )
        if not MIN_INPUT_RATE_HZ <= rate <= MAX_INPUT_RATE_HZ:
            raise AudioFormatError(
                f"{self.NAME}: the stream is at {rate} Hz: send audio between {MIN_INPUT_RATE_HZ} and "
                f"{MAX_INPUT_RATE_HZ} Hz"
            )
        self._streaminfo = streaminfo[:34]
        self.sample_rate_hz = rate
        self._codec = _Codec("flac", self._streaminfo, self.NAME)
        self._resampler = Resampler(rate)

    def _header(self, pos: int):
        """Whether a frame header starts at ``pos``, consistent with the stream's frames so far: its
        (number, blocking strategy), None if not, :data:`_MORE` if the buffer ends before it can tell."""
        buffer = self._buffer
        if pos + 4 > len(buffer):
            return _MORE
        if buffer[pos] != 0xFF or buffer[pos + 1] & 0xFE != 0xF8:
            return None
        blocking = buffer[pos + 1] & 1
        size_code, rate_code = buffer[pos + 2] >> 4, buffer[pos + 2] & 0x0F
        channels, sample_code, reserved = buffer[pos + 3] >> 4, (buffer[pos + 3] >> 1) & 7, buffer[pos + 3] & 1
        if size_code == 0 or rate_code == 15 or channels > 10 or sample_code == 3 or reserved:
            return None
        if self._frame_key is not None and (rate_code, sample_code, blocking) != self._frame_key:
            return None
        if pos + 5 > len(buffer):
            return _MORE
        number = _flac_number(buffer, pos + 4)
        if number is None:
            return None
        if number is _MORE:
            return _MORE
        value, length = number
        end = pos + 4 + length + (1 if size_code == 6 else 2 if size_code == 7 else 0)
        end += 1 if rate_code == 12 else 2 if rate_code in (13, 14) else 0
        if end >= len(buffer):
            return _MORE
        crc = 0
        for byte in buffer[pos:end]:
            crc = _CRC8[crc ^ byte]
        if crc != buffer[end]:
            return None
        if self._next_number is not None and blocking == 0 and value != self._next_number:
            return None
        return value, blocking

    def _frames(self, final: bool) -> np.ndarray:
        buffer = self._buffer
        out: list[np.ndarray] = []
        while buffer:
            self._next_number = None
            first = self._header(0)
            if first is _MORE and not final:
                break
            if first is None or first is _MORE:
                raise AudioFormatError(f"{self.NAME}: expected a frame header, got {bytes(buffer[:8])!r}")
            if self._frame_key is None:
                self._frame_key = (buffer[2] & 0x0F, (buffer[3] >> 1) & 7, first[1])
            # The frame ends where the next frame's header begins.
            self._next_number = first[0] + 1
            end = None
            pos = max(self._scan, 2)
            while True:
                found = buffer.find(b"\xff", pos)
                if found < 0:
                    self._scan = len(buffer)
                    break
                header = self._header(found)
                if header is _MORE:
                    self._scan = found
                    break
                if header is not None:
                    end = found
                    break
                pos = found + 1
            if end is None:
                if not final:
                    if len(buffer) > MAX_PACKET_BYTES:
                        raise AudioFormatError(f"{self.NAME}: a frame is over {MAX_PACKET_BYTES} bytes")
                    break
                end = len(buffer)
            frame = bytes(buffer[:end])
            del buffer[:end]
            self._scan = 2
            for samples in self._codec.decode(frame):
                out.append(self._resampler.process(samples))
        return _concat(out)

    def flush(self) -> np.ndarray:
        if self._state != 2:
            self._buffer.clear()
            return _EMPTY
        tail = self._frames(final=True)
        return np.concatenate((tail, self._resampler.flush()))
