"""Soak: N paced streams against ``cosystream serve`` for T minutes, with random disconnects; does anything
grow?

Each of ``--streams`` workers opens a REALTIME stream, sends speech paced at real time for 2-20 s, then ends
it at random: a half-close (waiting for the last final), a cancel, or a dropped connection (its channel
closed mid-stream); then opens the next. Every ``--sample-s`` the server's processes are sampled by name
(``cs-supervisor``, ``cs-engine``, ``cs-frontend-N``): resident memory and open file
descriptors. At the end: the engine's slots in use (must be 0) and how every stream ended. Prints JSON and a
table.

    python -m benchmarks.soak --minutes 20 --streams 24 --json soak.json
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import random
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np

from benchmarks._harness import Server, _children, dump
from clients.latency_probe import load_wavs, synthesize
from cosystream.v1 import cosystream_pb2 as pb
from cosystream.v1 import cosystream_pb2_grpc as pb_grpc
from cosystream.v1.client import HelpFormatter

CHUNK_MS = 20


def sample(root: int) -> dict[str, dict[str, float]]:
    """RSS (MB) and open fds of ``root`` and its descendants, by process name."""
    tree = _children()
    out, stack = {}, [root]
    while stack:
        pid = stack.pop()
        stack.extend(tree.get(pid, []))
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            status = Path(f"/proc/{pid}/status").read_text()
            fds = len(os.listdir(f"/proc/{pid}/fd"))
        except OSError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        if not name.startswith("cs-"):
            continue
        rss_kb = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:"))
        out[name] = {"rss_mb": rss_kb / 1024, "fds": fds}
    return out


async def worker(address: str, audio: bytes, until: float, seed: int, outcomes: collections.Counter) -> None:
    rng = random.Random(seed)
    chunk = 16000 * CHUNK_MS // 1000 * 2
    while time.monotonic() < until:
        seconds = rng.uniform(2, 20)
        ending = rng.choice(["half-close", "cancel", "drop"])
        start = rng.randrange(0, max(1, len(audio) - chunk)) // chunk * chunk
        channel = grpc.aio.insecure_channel(address)
        stub = pb_grpc.CosyStreamStub(channel)

        async def requests(seconds=seconds, start=start):
            yield pb.StreamingRecognizeRequest(
                config=pb.StreamingConfig(sample_rate_hz=16000, interim_results=True, priority=pb.REALTIME)
            )
            began = time.monotonic()
            for i in range(int(seconds * 1000 / CHUNK_MS)):
                await asyncio.sleep(max(0.0, began + i * CHUNK_MS / 1000 - time.monotonic()))
                offset = (start + i * chunk) % (len(audio) - chunk)
                yield pb.StreamingRecognizeRequest(audio=audio[offset : offset + chunk])

        call = stub.StreamingRecognize(requests())

        async def read(call=call):
            async for _ in call:
                pass

        reader = asyncio.create_task(read())
        try:
            if ending == "half-close":
                await asyncio.wait_for(reader, seconds + 15)
                outcomes["ok"] += 1
            else:
                await asyncio.sleep(rng.uniform(0.0, seconds))
                if ending == "cancel":
                    call.cancel()
                    outcomes["cancelled"] += 1
                else:
                    await channel.close(grace=None)  # the connection goes away under the stream
                    outcomes["dropped"] += 1
                await asyncio.gather(reader, return_exceptions=True)
        except grpc.aio.AioRpcError as err:
            outcomes[f"error {err.code().name}"] += 1
        except TimeoutError:
            outcomes["error no final"] += 1
        finally:
            reader.cancel()
            await channel.close()


async def run_workers(address: str, audio: bytes, streams: int, seconds: float) -> collections.Counter:
    outcomes: collections.Counter = collections.Counter()
    until = time.monotonic() + seconds
    await asyncio.gather(*(worker(address, audio, until, seed, outcomes) for seed in range(streams)))
    return outcomes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    parser.add_argument("--minutes", type=float, default=20.0)
    parser.add_argument("--streams", type=int, default=24)
    parser.add_argument("--frontends", type=int, default=2)
    parser.add_argument("--sample-s", type=float, default=15.0)
    parser.add_argument("--wav", nargs="+", default=None, help="speech to stream (default: espeak-ng)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    speech = load_wavs(args.wav) if args.wav else synthesize()
    audio = (np.clip(speech.samples, -1, 1 - 1 / 32768) * 32768).astype("<i2").tobytes()
    samples: list[dict] = []
    with Server("--max-sessions", str(args.streams + 8), "--frontends", str(args.frontends)) as server:
        time.sleep(3)  # the other frontends finish starting
        stop = threading.Event()

        def sampler() -> None:
            started = time.monotonic()
            while True:
                samples.append({"t_s": round(time.monotonic() - started, 1), **sample(server.process.pid)})
                if stop.wait(args.sample_s):
                    return

        thread = threading.Thread(target=sampler, daemon=True)
        thread.start()
        outcomes = asyncio.run(run_workers(server.address, audio, args.streams, args.minutes * 60))
        time.sleep(2)  # CLOSEs reach the engine, which announces the count
        with grpc.insecure_channel(server.address) as channel:
            info = pb_grpc.CosyStreamStub(channel).GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
        stop.set()
        thread.join()
        samples.append({"t_s": samples[-1]["t_s"] + 2, **sample(server.process.pid)})
    names = sorted({k for s in samples for k in s if k != "t_s"})
    # Growth from the first sample taken after a minute of traffic (start-up and warm-up excluded).
    warm = next((s for s in samples if s["t_s"] >= 60), samples[0])
    summary = {
        name: {
            "rss_mb_warm": warm.get(name, {}).get("rss_mb"),
            "rss_mb_end": samples[-1].get(name, {}).get("rss_mb"),
            "rss_mb_max": max(s[name]["rss_mb"] for s in samples if name in s),
            "fds_warm": warm.get(name, {}).get("fds"),
            "fds_end": samples[-1].get(name, {}).get("fds"),
        }
        for name in names
    }
    result = {
        "minutes": args.minutes,
        "streams": args.streams,
        "frontends": args.frontends,
        "outcomes": dict(outcomes),
        "streams_run": sum(outcomes.values()),
        "slots_in_use_at_end": info.active_sessions,
        "processes": summary,
        "samples": samples,
    }
    dump(result, args.json)
    print(f"\n{'process':<16} {'RSS warm':>9} {'RSS end':>8} {'RSS max':>8} {'fds warm':>9} {'fds end':>8}")
    for name, row in summary.items():
        print(
            f"{name:<16} {row['rss_mb_warm'] or 0:>8.1f}M {row['rss_mb_end'] or 0:>7.1f}M {row['rss_mb_max']:>7.1f}M"
            f" {row['fds_warm'] or 0:>9} {row['fds_end'] or 0:>8}"
        )
    print(f"\n{result['streams_run']} streams: {dict(outcomes)}; slots in use at the end: {info.active_sessions}")
    errors = sum(v for k, v in outcomes.items() if k.startswith("error"))
    return 1 if errors or info.active_sessions else 0


if __name__ == "__main__":
    sys.exit(main())
