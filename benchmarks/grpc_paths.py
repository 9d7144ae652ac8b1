"""What receiving a live stream costs a gRPC server in Python, by server kind, with no speech work at all.

A frontend's largest single cost is gRPC itself: each stream sends one ``StreamingRecognizeRequest`` of
10 ms of audio per 10 ms. This benchmark serves ``cosystream.v1.CosyStream/StreamingRecognize`` with a
handler that only reads the requests (and answers one response per ``--answer-every`` requests, as interims
do), in a process of its own, and measures that process's CPU per second of audio per stream while a paced
client (another process, grpc.aio) sends ``--streams`` streams. The server kinds:

- ``aio``: today's path: grpc.aio, the generated servicer, ``anext`` on the request iterator;
- ``aio-read``: grpc.aio, ``context.read()`` in place of the iterator;
- ``aio-raw``: grpc.aio with a generic handler and no deserializer (the handler gets bytes; the requests are
  parsed by ``FromString`` in the handler, to keep the work the same);
- ``aio-uvloop``: today's path on uvloop's event loop (where uvloop is installed);
- ``sync``: the synchronous server, a thread per stream from a pool;

alternating, ``--rounds`` times each, in one sitting.

    python -m benchmarks.grpc_paths --streams 60 --duration 6 --rounds 3
    python -m benchmarks.grpc_paths --kinds aio --chunk-ms 20 --streams 60
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import statistics
import subprocess
import sys
import time
from concurrent import futures
from pathlib import Path

import grpc

from benchmarks._harness import cpu_seconds
from cosystream.v1 import cosystream_pb2 as pb
from cosystream.v1 import cosystream_pb2_grpc as pb_grpc

KINDS = ("aio", "aio-read", "aio-raw", "aio-uvloop", "sync")
METHOD = "/cosystream.v1.CosyStream/StreamingRecognize"


def _answer(n: int) -> pb.StreamingRecognizeResponse:
    return pb.StreamingRecognizeResponse(session_id="s", results=[pb.StreamingResult(transcript=str(n))])


class _Aio(pb_grpc.CosyStreamServicer):
    def __init__(self, every: int):
        self.every = every

    async def StreamingRecognize(self, request_iterator, context):
        requests = aiter(request_iterator)
        n = 0
        while True:
            try:
                request = await anext(requests)
            except StopAsyncIteration:
                break
            n += 1
            if request.WhichOneof("request") == "audio" and n % self.every == 0:
                yield _answer(n)


class _AioRead(pb_grpc.CosyStreamServicer):
    def __init__(self, every: int):
        self.every = every

    async def StreamingRecognize(self, request_iterator, context):
        n = 0
        while (request := await context.read()) is not grpc.aio.EOF:
            n += 1
            if request.WhichOneof("request") == "audio" and n % self.every == 0:
                await context.write(_answer(n))


class _Sync(pb_grpc.CosyStreamServicer):
    def __init__(self, every: int):
        self.every = every

    def StreamingRecognize(self, request_iterator, context):
        for n, request in enumerate(request_iterator, 1):
            if request.WhichOneof("request") == "audio" and n % self.every == 0:
                yield _answer(n)


def _raw_handler(every: int) -> grpc.GenericRpcHandler:
    async def stream(request_iterator, context):
        n = 0
        async for raw in request_iterator:
            request = pb.StreamingRecognizeRequest.FromString(raw)
            n += 1
            if request.WhichOneof("request") == "audio" and n % every == 0:
                yield _answer(n).SerializeToString()

    handler = grpc.stream_stream_rpc_method_handler(stream)
    return grpc.method_handlers_generic_handler("cosystream.v1.CosyStream", {"StreamingRecognize": handler})


def serve(kind: str, port: int, every: int, streams: int) -> None:
    address = f"127.0.0.1:{port}"
    if kind == "sync":
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=streams + 8))
        pb_grpc.add_CosyStreamServicer_to_server(_Sync(every), server)
        server.add_insecure_port(address)
        server.start()
        print("ready", flush=True)
        server.wait_for_termination()
        return

    async def main() -> None:
        server = grpc.aio.server()
        if kind == "aio-raw":
            server.add_generic_rpc_handlers((_raw_handler(every),))
        else:
            servicer = _AioRead if kind == "aio-read" else _Aio
            pb_grpc.add_CosyStreamServicer_to_server(servicer(every), server)
        server.add_insecure_port(address)
        await server.start()
        print("ready", flush=True)
        await server.wait_for_termination()

    if kind == "aio-uvloop":
        import uvloop

        uvloop.run(main())
    else:
        asyncio.run(main())


async def _clients(port: int, streams: int, duration_s: float, chunk_ms: int) -> int:
    """Paced streams of ``chunk_ms`` chunks of 16 kHz LINEAR16, one channel each; the responses received."""
    chunk, period_s = bytes(32 * chunk_ms), chunk_ms / 1000
    received = 0

    async def one(index: int) -> None:
        nonlocal received
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.stream_stream(
                METHOD,
                request_serializer=pb.StreamingRecognizeRequest.SerializeToString,
                response_deserializer=pb.StreamingRecognizeResponse.FromString,
            )()
            await call.write(pb.StreamingRecognizeRequest(config=pb.StreamingConfig(sample_rate_hz=16000)))

            async def read() -> None:
                nonlocal received
                async for _ in call:
                    received += 1

            reader = asyncio.create_task(read())
            start = time.monotonic() + index * period_s / streams
            for i in range(int(duration_s / period_s)):
                await asyncio.sleep(max(0.0, start + i * period_s - time.monotonic()))
                await call.write(pb.StreamingRecognizeRequest(audio=chunk))
            await call.done_writing()
            await reader

    await asyncio.gather(*(one(i) for i in range(streams)))
    return received


def measure(kind: str, streams: int, duration_s: float, chunk_ms: int, every: int, port: int) -> dict:
    command = [sys.executable, "-m", "benchmarks.grpc_paths", "--serve", kind, "--port", str(port)]
    command += ["--answer-every", str(every), "--streams", str(streams)]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        before = cpu_seconds(server.pid)
        wall = time.monotonic()
        received = asyncio.run(_clients(port, streams, duration_s, chunk_ms))
        wall = time.monotonic() - wall
        cpu = cpu_seconds(server.pid) - before
    finally:
        server.kill()
        server.wait()
    audio_s = streams * duration_s
    return {
        "kind": kind,
        "streams": streams,
        "server_cpu_ms_per_audio_s": round(cpu * 1000 / audio_s, 2),
        "us_per_request": round(cpu * 1e6 / (audio_s * 1000 / chunk_ms), 1),
        "responses": received,
        "wall_s": round(wall, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    available = [kind for kind in KINDS if kind != "aio-uvloop" or importlib.util.find_spec("uvloop")]
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=available)
    parser.add_argument("--streams", type=int, default=60)
    parser.add_argument("--duration", type=float, default=6.0, help="seconds of audio per stream")
    parser.add_argument("--chunk-ms", type=int, default=10, help="audio per request")
    parser.add_argument("--answer-every", type=int, default=10, help="one response per this many requests")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--port", type=int, default=50231)
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--serve", choices=KINDS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.port, args.answer_every, args.streams)
        return
    runs: dict[str, list[dict]] = {kind: [] for kind in args.kinds}
    for round_ in range(args.rounds):
        order = args.kinds if round_ % 2 == 0 else args.kinds[::-1]
        for kind in order:
            runs[kind].append(
                measure(kind, args.streams, args.duration, args.chunk_ms, args.answer_every, args.port)
            )
    rows = []
    for kind, results in runs.items():
        values = [r["server_cpu_ms_per_audio_s"] for r in results]
        rows.append(
            {
                "kind": kind,
                "median_ms_per_audio_s": round(statistics.median(values), 2),
                "runs_ms_per_audio_s": values,
                "us_per_request": round(statistics.median(r["us_per_request"] for r in results), 1),
            }
        )
    result = {
        "streams": args.streams,
        "chunk_ms": args.chunk_ms,
        "duration_s": args.duration,
        "rounds": args.rounds,
        "kinds": rows,
    }
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    print(f"\n{'server kind':<10} {'ms CPU / audio-s / stream':>26} {'us / request':>13}   runs")
    for row in rows:
        print(
            f"{row['kind']:<10} {row['median_ms_per_audio_s']:>26} {row['us_per_request']:>13}   "
            + " ".join(str(v) for v in row["runs_ms_per_audio_s"])
        )


if __name__ == "__main__":
    main()
