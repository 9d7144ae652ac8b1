"""``cosystream transcribe FILE``: an audio file through a running server, or through one started in-process.

The file is decoded as ``POST /v1/audio/transcriptions`` decodes uploads (:mod:`cosystream.audio.files`: WAV,
FLAC, OGG, MP3 at 8-48 kHz); the server is reached only through the public API (``cosystream.v1``), the same
way any client would.
"""

from __future__ import annotations

import logging
import sys
import time
import wave
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np

from cosystream.audio.files import UndecodableAudio, open_audio
from cosystream.v1 import client
from cosystream.v1 import cosystream_pb2 as pb
from cosystream.v1 import cosystream_pb2_grpc as pb_grpc
from cosystream.v1.client import Connection, describe_error, server_address

log = logging.getLogger(__name__)

CHUNK_MS = 100


def read_wav(path: str) -> tuple[np.ndarray, int]:
    """Mono int16 samples and the rate of a WAV file (PCM, float, mu-law or A-law; channels are averaged).
    Raises ``ValueError`` saying what is accepted."""
    audio, rate = client.read_wav(path)
    return (np.clip(audio, -1, 1 - 1 / 32768) * 32768).astype("<i2"), rate


def read_audio(path: str) -> tuple[np.ndarray, int]:
    """Mono int16 samples and the rate of an audio file in any format the server's uploads take. Raises
    :class:`~cosystream.audio.files.UndecodableAudio` saying what is wrong with it."""
    data = Path(path).read_bytes()
    try:
        audio = open_audio(data)
        return audio.read(), audio.info.sample_rate_hz
    except UndecodableAudio as err:
        hint = (
            ""
            if "sox" in str(err)
            else "; convert it with `sox IN -c 1 -b 16 OUT.wav` or `ffmpeg -i IN -ac 1 OUT.wav`"
        )
        raise UndecodableAudio(f"{path}: {err}{hint}") from None


def write_wav(path: str, samples: np.ndarray, rate: int) -> None:
    """``samples`` (int16) as a mono 16-bit PCM WAV file."""
    with wave.open(str(path), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(samples.astype("<i2").tobytes())


def requests(
    samples: np.ndarray, rate: int, realtime: bool, interim: bool, words: bool
) -> Iterator[pb.StreamingRecognizeRequest]:
    priority = pb.REALTIME if realtime else pb.BATCH
    yield pb.StreamingRecognizeRequest(
        config=pb.StreamingConfig(
            encoding=pb.LINEAR16,
            sample_rate_hz=rate,
            priority=priority,
            interim_results=interim,
            enable_word_time_offsets=words,
        )
    )
    step = rate * CHUNK_MS // 1000
    start = time.monotonic()
    for i, offset in enumerate(range(0, len(samples), step)):
        if realtime:
            time.sleep(max(0.0, start + i * CHUNK_MS / 1000 - time.monotonic()))
        yield pb.StreamingRecognizeRequest(audio=samples[offset : offset + step].tobytes())


def stream_file(
    address: str,
    path: str,
    realtime: bool = False,
    interim: bool = False,
    words: bool = False,
    connection: Connection | None = None,
):
    """Yield the server's responses for ``path`` (``connection``: TLS and token; default plaintext)."""
    yield from stream_samples(address, *read_audio(path), realtime, interim, words, connection)


def stream_samples(
    address: str,
    samples: np.ndarray,
    rate: int,
    realtime: bool = False,
    interim: bool = False,
    words: bool = False,
    connection: Connection | None = None,
):
    """Yield the server's responses for int16 ``samples`` at ``rate`` Hz."""
    with (connection or Connection()).channel(address) as channel:
        stub = pb_grpc.CosyStreamStub(channel)
        yield from stub.StreamingRecognize(requests(samples, rate, realtime, interim, words))


def format_result(result: pb.StreamingResult, words: bool) -> str:
    span = f"[{result.start_ms / 1000:7.2f} - {result.end_ms / 1000:7.2f}]"
    line = f"{span} {result.transcript}" if result.is_final else f"{span} ... {result.transcript}"
    if words and result.words:
        line += "\n" + " ".join(f"{w.word}@{w.start_ms / 1000:.2f}" for w in result.words)
    return line


def transcribe_command(
    path: str,
    server_at: str | None = None,
    realtime: bool = False,
    interim: bool = False,
    words: bool = False,
    connection: Connection | None = None,
    final_model: str | None = None,
) -> int:
    """``cosystream transcribe``: the file's finals (and interims) printed, nothing else on stdout (logs go to
    stderr, and only warnings unless ``--log-level`` says more); 1 with the reason on failure. ``final_model``:
    the in-process server's second pass (None: finals from the streaming model)."""
    server = None
    address = None if server_at is None else server_address(server_at)
    try:
        samples, rate = read_audio(path)  # before an in-process engine is started for it: a bad file fails at once
        if address is None:
            from cosystream.app.local import LocalServer
            from cosystream.frontend.host import StreamOptions
            from cosystream.secondpass.worker import SecondPassConfig
            from cosystream.server.frontend import FrontendConfig

            second_pass = None if final_model is None else SecondPassConfig(final_model)
            frontend = FrontendConfig(host="127.0.0.1", port=0, stream=StreamOptions(second_pass=second_pass))
            server = LocalServer(frontend_config=frontend).start()
            address = server.address
        for response in stream_samples(address, samples, rate, realtime, interim, words, connection):
            for result in response.results:
                if result.is_final or interim:
                    print(format_result(result, words), flush=True)
    except grpc.RpcError as err:
        print(f"cosystream transcribe: {describe_error(err.code(), err.details(), connection)}", file=sys.stderr)
        return 1
    except (OSError, ValueError, wave.Error) as err:
        print(f"cosystream transcribe: {err}", file=sys.stderr)
        return 1
    finally:
        if server is not None:
            server.stop()
    return 0
