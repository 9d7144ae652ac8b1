"""One long stream: does a stream of an hour (or more) keep the server's memory flat?

A stream has no maximum length. This sends ``--minutes`` of audio in one ``StreamingRecognize`` (espeak-ng
sentences, each followed by a second of silence, cycled) to ``cosystream serve`` as a BATCH stream, so an
hour takes minutes rather than an hour, and samples every process of the server (resident memory, open
file descriptors) against the audio sent so far. At the end: the finals received, the stream's status, and
the growth of each process from the first tenth of the audio to the end. Prints JSON and a table.

    python -m benchmarks.long_stream --minutes 60 --json long_stream.json
    python -m benchmarks.long_stream --minutes 60 --final-model embedded:whisper-tiny-en   # with the second pass
"""

from __future__ import annotations

import argparse
import sys
import threading
import time

import grpc
import numpy as np

from benchmarks._harness import Server, dump
from benchmarks.soak import sample
from clients.latency_probe import synthesize
from cosystream.v1 import cosystream_pb2 as pb
from cosystream.v1 import cosystream_pb2_grpc as pb_grpc
from cosystream.v1.client import HelpFormatter

CHUNK_S = 0.1
RATE_HZ = 16000


def speech_cycle() -> bytes:
    """Sentences with a second of silence after each, as LINEAR16."""
    speech = synthesize()
    gap = np.zeros(RATE_HZ, dtype=np.float32)
    audio = np.concatenate([speech.samples, gap])
    return (np.clip(audio, -1, 1 - 1 / 32768) * 32768).astype("<i2").tobytes()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    parser.add_argument("--minutes", type=float, default=60.0, help="audio in the stream")
    parser.add_argument("--sample-audio-s", type=float, default=60.0, help="sample the processes this often")
    parser.add_argument("--final-model", default="off", help="serve's --final-model (off: streaming finals)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    cycle = speech_cycle()
    chunk = int(CHUNK_S * RATE_HZ) * 2
    total_chunks = int(args.minutes * 60 / CHUNK_S)
    samples: list[dict] = []
    sent = [0]
    finals = 0
    with Server("--frontends", "1", "--final-model", args.final_model) as server:
        time.sleep(2)
        pid = server.process.pid

        def requests():
            yield pb.StreamingRecognizeRequest(
                config=pb.StreamingConfig(encoding=pb.LINEAR16, sample_rate_hz=RATE_HZ, priority=pb.BATCH)
            )
            next_sample_s = 0.0
            for i in range(total_chunks):
                offset = (i * chunk) % (len(cycle) - chunk)
                sent[0] = i + 1
                audio_s = i * CHUNK_S
                if audio_s >= next_sample_s:
                    samples.append(
                        {"audio_s": round(audio_s), "wall_s": round(time.monotonic() - began, 1), **sample(pid)}
                    )
                    next_sample_s += args.sample_audio_s
                yield pb.StreamingRecognizeRequest(audio=cycle[offset : offset + chunk])

        began = time.monotonic()
        code = grpc.StatusCode.OK
        with grpc.insecure_channel(server.address) as channel:
            call = pb_grpc.CosyStreamStub(channel).StreamingRecognize(requests(), timeout=args.minutes * 60 + 600)
            try:
                for response in call:
                    finals += sum(r.is_final for r in response.results)
            except grpc.RpcError as err:
                code = err.code()
        wall_s = time.monotonic() - began
        threading.Event().wait(1)
        samples.append({"audio_s": round(sent[0] * CHUNK_S), "wall_s": round(wall_s, 1), **sample(pid)})
    names = sorted({k for s in samples for k in s if k.startswith("cs-")})
    first = next((s for s in samples if s["audio_s"] >= args.minutes * 6), samples[0])  # after a tenth
    summary = {
        name: {
            "rss_mb_early": first.get(name, {}).get("rss_mb"),
            "rss_mb_end": samples[-1].get(name, {}).get("rss_mb"),
            "rss_mb_max": max(s[name]["rss_mb"] for s in samples if name in s),
            "fds_early": first.get(name, {}).get("fds"),
            "fds_end": samples[-1].get(name, {}).get("fds"),
        }
        for name in names
    }
    result = {
        "audio_minutes": args.minutes,
        "final_model": args.final_model,
        "status": code.name,
        "finals": finals,
        "wall_s": round(wall_s, 1),
        "processes": summary,
        "samples": samples,
    }
    dump(result, args.json)
    print(f"\n{'process':<16} {'RSS early':>10} {'RSS end':>8} {'RSS max':>8} {'fds early':>10} {'fds end':>8}")
    for name, row in summary.items():
        print(
            f"{name:<16} {row['rss_mb_early'] or 0:>9.1f}M {row['rss_mb_end'] or 0:>7.1f}M {row['rss_mb_max']:>7.1f}M"
            f" {row['fds_early'] or 0:>10} {row['fds_end'] or 0:>8}"
        )
    print(f"\n{args.minutes:g} min of audio in {wall_s:.0f} s: {code.name}, {finals} finals")
    return 0 if code == grpc.StatusCode.OK else 1


if __name__ == "__main__":
    sys.exit(main())
