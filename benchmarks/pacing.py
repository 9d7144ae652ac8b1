"""Pacing: a tenant's paced REALTIME latency while another client sends REALTIME audio as fast as it can.

For each ``--burst-s`` value (``serve --realtime-burst-s``; ``inf`` is the server without pacing), in
interleaved rounds: the latency probe streams ``--realtime N`` paced sessions alone, then again while one
REALTIME gRPC client sends speech as fast as the server reads it. Reports the paced sessions' chunk latency
p50/p95/p99, the engine's deadline misses (the fast sender's own among them) and how many times real time
the fast sender went. Prints JSON and a table.

    python -m benchmarks.pacing --burst-s inf 2 --rounds 3 --realtime 4 --duration 15
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import grpc
import numpy as np

from benchmarks._harness import ROOT, Server, dump, p, probe
from cosystream.v1 import cosystream_pb2 as pb
from cosystream.v1 import cosystream_pb2_grpc as pb_grpc
from cosystream.v1.client import read_wav

COLUMNS = ("p50_ms", "p95_ms", "p99_ms", "deadline_misses")


class FastSender:
    """One REALTIME stream sending ``pcm`` (16 kHz int16) in 100 ms chunks, back to back, as fast as it is
    read, again and again until stopped; counts the audio seconds sent."""

    def __init__(self, address: str, pcm: bytes):
        self.address, self.pcm = address, pcm
        self.stop = threading.Event()
        self.audio_s = 0.0
        self.error: str | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _requests(self):
        yield pb.StreamingRecognizeRequest(
            config=pb.StreamingConfig(encoding=pb.LINEAR16, sample_rate_hz=16000, priority=pb.REALTIME)
        )
        while not self.stop.is_set():
            for offset in range(0, len(self.pcm), 3200):
                if self.stop.is_set():
                    return
                chunk = self.pcm[offset : offset + 3200]
                self.audio_s += len(chunk) / 32000
                yield pb.StreamingRecognizeRequest(audio=chunk)

    def _run(self) -> None:
        with grpc.insecure_channel(self.address) as channel:
            try:
                for _ in pb_grpc.CosyStreamStub(channel).StreamingRecognize(self._requests(), timeout=600):
                    pass
            except grpc.RpcError as err:
                self.error = f"{err.code().name}: {err.details()}"

    def __enter__(self) -> FastSender:
        self.started = time.monotonic()
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.elapsed_s = time.monotonic() - self.started
        self.stop.set()
        self.thread.join(60)


def speech_pcm() -> bytes:
    """The probe's synthesized speech (espeak-ng), as 16 kHz int16 bytes."""
    with tempfile.NamedTemporaryFile(suffix=".wav") as wav:
        subprocess.run(
            [sys.executable, str(ROOT / "clients" / "latency_probe.py"), "--save-wav", wav.name],
            check=True,
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
        )
        audio, rate = read_wav(wav.name)
    if rate != 16000:
        raise SystemExit(f"the probe's speech is at {rate} Hz, not 16 kHz")
    return (np.clip(audio, -1, 1 - 1 / 32768) * 32768).astype("<i2").tobytes()


def measure(burst: str, args: argparse.Namespace, pcm: bytes) -> dict:
    common = ["--realtime", str(args.realtime), "--duration", str(args.duration), "--chunk-ms", "10"]
    runs = {}
    with Server("--max-sessions", str(args.realtime + 8), "--realtime-burst-s", burst) as server:
        probe(server, "--realtime", "2", "--duration", "1", "--ramp-s", "0")  # unmeasured: warm paths
        for name in ("alone", "with_fast_sender"):
            sender = FastSender(server.address, pcm) if name == "with_fast_sender" else None
            if sender is not None:
                sender.__enter__()
                time.sleep(0.5)
            try:
                result, _ = probe(server, *common)
            finally:
                if sender is not None:
                    sender.__exit__(None, None, None)
            rt = result["classes"]["realtime"]
            runs[name] = {
                "p50_ms": p(rt, "chunk_latency_ms", "p50"),
                "p95_ms": p(rt, "chunk_latency_ms", "p95"),
                "p99_ms": p(rt, "chunk_latency_ms", "p99"),
                "deadline_misses": rt["deadline_misses"],
                "errors": rt["errors"],
                "fast_sender_x_realtime": None if sender is None else sender.audio_s / sender.elapsed_s,
                "fast_sender_error": None if sender is None else sender.error,
            }
    return runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--burst-s", nargs="+", default=["inf", "2"], help="serve --realtime-burst-s values")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--realtime", type=int, default=4, help="paced REALTIME sessions (the other tenant)")
    parser.add_argument("--duration", type=float, default=15.0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    pcm = speech_pcm()
    results: dict[str, list[dict]] = {burst: [] for burst in args.burst_s}
    for round_ in range(args.rounds):
        order = args.burst_s if round_ % 2 == 0 else list(reversed(args.burst_s))
        for burst in order:
            runs = measure(burst, args, pcm)
            results[burst].append(runs)
            print(f"round {round_ + 1} burst {burst}: {runs}", file=sys.stderr, flush=True)
    dump({"config": vars(args), "results": results}, args.json)
    print(
        f"\n{'burst s':>8} {'run':<17} {'round':>5} {'p50 ms':>7} {'p95 ms':>7} {'p99 ms':>7} {'misses':>7} "
        f"{'fast x rt':>9}"
    )
    for burst, rounds in results.items():
        for name in ("alone", "with_fast_sender"):
            for i, runs in enumerate(rounds):
                r = runs[name]
                fast = r["fast_sender_x_realtime"]
                print(
                    f"{burst:>8} {name:<17} {i + 1:>5} {r['p50_ms']:>7.1f} {r['p95_ms']:>7.1f} {r['p99_ms']:>7.1f} "
                    f"{r['deadline_misses']:>7} {'' if fast is None else f'{fast:.1f}':>9}"
                )
            med = {key: statistics.median(runs[name][key] for runs in rounds) for key in COLUMNS}
            print(
                f"{burst:>8} {name:<17} {'med':>5} {med['p50_ms']:>7.1f} {med['p95_ms']:>7.1f} {med['p99_ms']:>7.1f} "
                f"{med['deadline_misses']:>7.0f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
