"""How long a new stream waits for its initial metadata (the server's word that the session is admitted: its
config accepted and an engine slot given), streams opened one after another, with some live streams beside.

    python -m benchmarks.metadata_wait --server 127.0.0.1:50051 --streams 40 --busy 0 20

A client that waits for the metadata before it sends audio (``cosystream.v1.resume.ResumableStream``, the
telephony gateway before it answers a call) starts this much later. Prints JSON, then a table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import threading
import time

import grpc

from cosystream.v1 import cosystream_pb2 as pb
from cosystream.v1 import cosystream_pb2_grpc as pb_grpc
from cosystream.v1.client import HelpFormatter

CONFIG = pb.StreamingRecognizeRequest(
    config=pb.StreamingConfig(encoding=pb.LINEAR16, sample_rate_hz=16000, priority=pb.REALTIME)
)


def live_stream(stub: pb_grpc.CosyStreamStub, stop: threading.Event) -> None:
    """A REALTIME stream of quiet noise at real time (20 ms chunks) until ``stop``."""

    def requests():
        yield CONFIG
        while not stop.wait(0.02):
            yield pb.StreamingRecognizeRequest(audio=b"\1\0" * 320)

    with contextlib.suppress(grpc.RpcError):
        for _ in stub.StreamingRecognize(requests(), timeout=600):
            pass


def waits_ms(stub: pb_grpc.CosyStreamStub, streams: int) -> list[float]:
    """Each of ``streams`` new streams in turn: config sent -> initial metadata, ms."""
    waits = []
    for _ in range(streams):
        done = threading.Event()

        def requests(done=done):
            yield CONFIG
            done.wait(5)

        start = time.perf_counter()
        call = stub.StreamingRecognize(requests(), timeout=30)
        call.initial_metadata()
        waits.append((time.perf_counter() - start) * 1000)
        done.set()
        with contextlib.suppress(grpc.RpcError):
            list(call)
    return waits


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    parser.add_argument("--server", default="127.0.0.1:50051")
    parser.add_argument("--streams", type=int, default=40, help="new streams measured, one after another")
    parser.add_argument("--busy", type=int, nargs="+", default=[0, 20], help="live streams beside them")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    rows = []
    with grpc.insecure_channel(args.server) as channel:
        stub = pb_grpc.CosyStreamStub(channel)
        for busy in args.busy:
            stop = threading.Event()
            live = [threading.Thread(target=live_stream, args=(stub, stop), daemon=True) for _ in range(busy)]
            for thread in live:
                thread.start()
            time.sleep(3 if busy else 0)  # (the live streams admitted and stepping)
            waits = sorted(waits_ms(stub, args.streams))
            stop.set()
            for thread in live:
                thread.join(10)
            rows.append(
                {
                    "busy": busy,
                    "streams": len(waits),
                    "p50_ms": statistics.median(waits),
                    "p90_ms": waits[max(0, int(0.9 * len(waits)) - 1)],
                    "max_ms": waits[-1],
                }
            )
    result = {"config": vars(args), "rows": rows}
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=2)
    print(f"\n{'live streams':>12} {'new streams':>11} {'p50 ms':>7} {'p90 ms':>7} {'max ms':>7}")
    for row in rows:
        print(
            f"{row['busy']:>12} {row['streams']:>11} {row['p50_ms']:>7.2f} {row['p90_ms']:>7.2f} {row['max_ms']:>7.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
