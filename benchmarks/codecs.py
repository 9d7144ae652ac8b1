"""What a stream's audio encoding costs the frontend: CPU per second of audio, decoded as a stream.

Each encoding decodes the same speech (espeak-ng sentences, ~30 s) fed in 10 ms worth of bytes per chunk,
through what a session uses (``cosystream.audio.streams.open_stream_audio``: container, codec, resampling
to 16 kHz). Besides, the codec candidates on their own over the same packets: libavcodec's native Opus
decoder (the one used) and libopus through libavcodec, and libsndfile (``soundfile``, which the HTTP
uploads use) decoding the whole file at once, which cannot stream. Prints JSON and a table; the best of
``--rounds`` rounds per row (CPU time of this process).

    python -m benchmarks.codecs --json codecs.json
"""

from __future__ import annotations

import argparse
import io
import time

import numpy as np
import soxr

from benchmarks._harness import dump
from clients.latency_probe import synthesize
from cosystream.audio.codecs import AudioEncoding, encode_mulaw
from cosystream.audio.streams import open_stream_audio
from cosystream.v1.client import HelpFormatter


def encode_compressed(audio: np.ndarray, rate_hz: int, container: str, channels: int = 1) -> bytes:
    """``audio`` as a file being written: ``"ogg"`` or ``"webm"`` (Opus by libopus through PyAV, 20 ms
    packets, 48 kHz) or ``"flac"`` (libFLAC through libsndfile, 16-bit, at ``rate_hz``), ``channels`` copies
    of it."""
    if container == "flac":
        import soundfile

        out = io.BytesIO()
        soundfile.write(out, np.repeat(audio[:, None], channels, axis=1), rate_hz, format="FLAC", subtype="PCM_16")
        return out.getvalue()
    import av

    out = io.BytesIO()
    layout = "mono" if channels == 1 else "stereo"
    with av.open(out, "w", format=container) as muxer:
        stream = muxer.add_stream("libopus", rate=48000, layout=layout)
        samples = soxr.resample(audio, rate_hz, 48000).astype(np.float32)
        frame = av.AudioFrame.from_ndarray(
            np.repeat(samples[None, :], channels, axis=0), format="fltp", layout=layout
        )
        frame.sample_rate, frame.pts = 48000, 0
        for packet in [*stream.encode(frame), *stream.encode(None)]:
            muxer.mux(packet)
    return out.getvalue()


def _cpu(run, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        start = time.process_time()
        run()
        best = min(best, time.process_time() - start)
    return best


def _stream(encoding: AudioEncoding, rate_hz: int, data: bytes, chunk: int):
    def run():
        decoder = open_stream_audio(encoding, rate_hz)
        for offset in range(0, len(data), chunk):
            decoder.decode(data[offset : offset + chunk])
        decoder.flush()

    return run


def _opus_packets(data: bytes) -> tuple[bytes, list[bytes]]:
    import av

    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.audio[0]
        head = bytes(stream.codec_context.extradata)
        return head, [bytes(p) for p in container.demux(stream) if p.size]


def _codec_only(name: str, head: bytes, packets: list[bytes]):
    import av

    def run():
        context = av.CodecContext.create(name, "r")
        context.extradata = head
        for packet in packets:
            for frame in context.decode(av.Packet(packet)):
                frame.to_ndarray()

    return run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="rounds per row (the best is kept)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    import soundfile

    audio = synthesize().samples
    seconds = len(audio) / 16000
    pcm = (np.clip(audio, -1, 1 - 1 / 32768) * 32768).astype("<i2").tobytes()
    mulaw8 = encode_mulaw(soxr.resample(audio, 16000, 8000).astype(np.float32))
    pcm48 = (np.clip(soxr.resample(audio, 16000, 48000), -1, 1 - 1 / 32768) * 32768).astype("<i2").tobytes()
    files = {
        "ogg": encode_compressed(audio, 16000, "ogg"),
        "webm": encode_compressed(audio, 16000, "webm"),
        "flac16": encode_compressed(audio, 16000, "flac"),
        "flac48": encode_compressed(soxr.resample(audio, 16000, 48000).astype(np.float32), 48000, "flac"),
    }

    def chunk(data: bytes) -> int:
        return max(1, round(len(data) / seconds / 100))  # 10 ms of audio per chunk

    rows = [
        ("LINEAR16 16 kHz", "stream", _stream(AudioEncoding.LINEAR16, 16000, pcm, 320), len(pcm)),
        ("LINEAR16 48 kHz", "stream", _stream(AudioEncoding.LINEAR16, 48000, pcm48, 960), len(pcm48)),
        ("MULAW 8 kHz", "stream", _stream(AudioEncoding.MULAW, 8000, mulaw8, 80), len(mulaw8)),
    ]
    for name, encoding, key in (
        ("OGG_OPUS", AudioEncoding.OGG_OPUS, "ogg"),
        ("WEBM_OPUS", AudioEncoding.WEBM_OPUS, "webm"),
        ("FLAC 16 kHz", AudioEncoding.FLAC, "flac16"),
        ("FLAC 48 kHz", AudioEncoding.FLAC, "flac48"),
    ):
        data = files[key]
        rows.append((name, "stream", _stream(encoding, 0, data, chunk(data)), len(data)))
    head, packets = _opus_packets(files["ogg"])
    for codec in ("opus", "libopus"):
        rows.append((f"Opus packets, libavcodec '{codec}'", "codec only", _codec_only(codec, head, packets), 0))
    for key, label in (("ogg", "Ogg Opus"), ("flac16", "FLAC 16 kHz")):
        data = files[key]
        rows.append(
            (f"{label}, libsndfile", "whole file", lambda d=data: soundfile.read(io.BytesIO(d)), len(data))
        )

    result = {"audio_s": round(seconds, 2), "rounds": args.rounds, "rows": []}
    for name, how, run, size in rows:
        cpu_s = _cpu(run, args.rounds)
        result["rows"].append(
            {
                "encoding": name,
                "how": how,
                "cpu_ms_per_audio_s": round(cpu_s / seconds * 1000, 3),
                "kbit_per_s": round(size * 8 / seconds / 1000, 1) if size else None,
            }
        )
    dump(result, args.json)
    print(f"\n{result['audio_s']} s of speech, best of {args.rounds} rounds (CPU of one process)")
    print(f"{'encoding':<36} {'how':<11} {'CPU ms / audio s':>17} {'kbit/s':>8}")
    for row in result["rows"]:
        rate = "" if row["kbit_per_s"] is None else f"{row['kbit_per_s']:.1f}"
        print(f"{row['encoding']:<36} {row['how']:<11} {row['cpu_ms_per_audio_s']:>17.3f} {rate:>8}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
