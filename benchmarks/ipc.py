"""The frontend <-> engine channel: what one tick's message costs, by encoding, transport and batch size.

A tick's message carries one 10 ms frame (160 float32 samples) for each of N sessions and an END per 16
sessions (utterance boundaries), as a frontend builds it; the engine reads every run and answers with one
step's block (the 8 best token ids and log-probabilities per frame) and an event per 16 sessions; the
frontend reads every row. Measured: the round trip (build and pack, send, the peer unpacks and answers,
receive and unpack) between two processes over ``multiprocessing.connection`` on a Unix socket, for these
encodings of the same messages, alternating in one sitting, ``--rounds`` times:

- ``msgspec``: ``cosystream.engine.ipc``'s ``pack``/``unpack`` (msgspec Structs, msgpack, arrays as raw bytes);
- ``tuples``: the layout before the typed messages: tuples with integer codes and numpy arrays, pickled by
  the connection;
- ``dataclass``: the same envelope with frozen, slotted dataclasses for the ops, events and step blocks,
  pickled by the connection (the typed messages without a dependency);
- ``struct``: a hand-written layout, ``struct`` headers and the arrays' raw bytes, ops and events pickled.

Then, with ``msgspec``: ``per-chunk``, the unbatched alternative (one message per session per tick), and
``zmq``, pyzmq PAIR over ``ipc://`` (if pyzmq is installed).

    python -m benchmarks.ipc --iterations 300 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import pickle
import statistics
import struct
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Client, Listener

import numpy as np

from cosystream.engine import ipc
from cosystream.frames import FRAME_SAMPLES
from cosystream.v1.client import HelpFormatter

SESSIONS = (1, 16, 64, 256)
TOP_K = 8  # the candidates per frame a beam-search frontend reads
CHURN = 16  # an END (and an event back) per this many sessions
FRAME = np.zeros((1, FRAME_SAMPLES), dtype=np.float32)


def step_arrays(rows: int) -> tuple[np.ndarray, np.ndarray]:
    return np.zeros((rows, 1, TOP_K), np.int32), np.zeros((rows, 1, TOP_K), np.float32)


class Msgspec:
    """What cosystream sends."""

    pickled = False  # bytes: ``send_bytes`` / ``recv_bytes``; else objects: ``send`` / ``recv`` pickle them

    def request(self, sessions: int) -> bytes:
        message = ipc.ToEngine(ops=[ipc.End(key) for key in range(0, sessions, CHURN)])
        for key in range(sessions):
            message.add_frames(key, FRAME)
        return message.pack()

    def answer(self, payload: bytes) -> bytes:
        message = ipc.ToEngine.unpack(payload)
        keys = [key for key, _frames in message.runs()]
        box = ipc.ToFrontend(events=[ipc.Opened(op.key, 0) for op in message.ops])
        box.add_step(keys, *step_arrays(len(keys)), [0.0] * len(keys), 0.0)
        return box.pack()

    def read(self, payload: bytes) -> int:
        box = ipc.ToFrontend.unpack(payload)
        return len(box.events) + sum(1 for _ in box.rows())


def tick_runs(sessions: int) -> tuple[list[int], list[int], np.ndarray]:
    """One frame per session, as a frontend's tick gathers them: keys, counts, the frames as one array."""
    keys, counts, frames = [], [], []
    for key in range(sessions):
        keys.append(key)
        counts.append(1)
        frames.append(FRAME)
    return keys, counts, np.concatenate(frames)


def read_runs(keys, counts, frames: np.ndarray) -> list[int]:
    """What the engine does with a message's runs (each its slice of the frames): the keys, in order."""
    start, read = 0, []
    for key, count in zip(keys, counts, strict=True):
        read.append(key)
        _run = frames[start : start + count]
        start += count
    return read


class Tuples:
    """The layout before: ``(ops, keys, counts, frames)`` and ``(events, steps)``, tuples with integer codes,
    pickled by ``Connection.send`` (``ForkingPickler``, the default protocol)."""

    pickled = True
    END, OPENED = 7, 11

    def end(self, key: int):
        return (self.END, key)

    def opened(self, op):
        return (self.OPENED, op[1], 0)

    def step(self, keys: list[int], ids: np.ndarray, logprobs: np.ndarray, queue_s: list[float]):
        return (keys, ids, logprobs, queue_s, 0.0)

    def step_rows(self, step) -> tuple:
        """(keys, ids, logprobs, queue_s) of a step block."""
        return step[:4]

    def request(self, sessions: int) -> tuple:
        return ([self.end(key) for key in range(0, sessions, CHURN)], *tick_runs(sessions))

    def answer(self, message: tuple) -> tuple:
        ops, *runs = message
        read = read_runs(*runs)
        return ([self.opened(op) for op in ops], [self.step(read, *step_arrays(len(read)), [0.0] * len(read))])

    def read(self, message: tuple) -> int:
        events, steps = message
        rows = 0
        for step in steps:
            keys, ids, logprobs, queue_s = self.step_rows(step)
            for row, _key in enumerate(keys):
                _row = ids[row], logprobs[row], queue_s[row]
                rows += 1
        return len(events) + rows


@dataclass(frozen=True, slots=True)
class End:
    key: int


@dataclass(frozen=True, slots=True)
class Opened:
    key: int
    model: int


@dataclass(frozen=True, slots=True)
class Step:
    keys: list[int]
    ids: np.ndarray
    logprobs: np.ndarray
    queue_s: list[float]
    compute_s: float


class Dataclasses(Tuples):
    """The layout before with a slotted, frozen dataclass per op, event and step block, pickled likewise."""

    def end(self, key: int):
        return End(key)

    def opened(self, op):
        return Opened(op.key, 0)

    def step(self, keys: list[int], ids: np.ndarray, logprobs: np.ndarray, queue_s: list[float]):
        return Step(keys, ids, logprobs, queue_s, 0.0)

    def step_rows(self, step) -> tuple:
        return step.keys, step.ids, step.logprobs, step.queue_s


class Struct:
    """A hand-written layout: a ``struct`` header, the numbers as raw arrays, the (rare) ops and events
    pickled. Request: ``<II`` runs, ops bytes; keys int64, counts int32, frames float32; ops. Reply, one step:
    ``<IIIId`` rows, T, K, events bytes, compute_s; keys int64, queue_s float64, ids int32, logprobs float32;
    events."""

    pickled = False

    def request(self, sessions: int) -> bytes:
        keys, counts, frames = tick_runs(sessions)
        ops = pickle.dumps([(Tuples.END, key) for key in range(0, sessions, CHURN)], protocol=5)
        return b"".join(
            (
                struct.pack("<II", len(keys), len(ops)),
                np.asarray(keys, np.int64).tobytes(),
                np.asarray(counts, np.int32).tobytes(),
                frames.tobytes(),
                ops,
            )
        )

    def answer(self, payload: bytes) -> bytes:
        runs, ops_bytes = struct.unpack_from("<II", payload)
        offset = 8
        keys = np.frombuffer(payload, np.int64, runs, offset)
        offset += 8 * runs
        counts = np.frombuffer(payload, np.int32, runs, offset)
        offset += 4 * runs
        total = int(counts.sum())
        frames = np.frombuffer(payload, np.float32, total * FRAME_SAMPLES, offset).reshape(total, FRAME_SAMPLES)
        offset += 4 * total * FRAME_SAMPLES
        ops = pickle.loads(payload[offset : offset + ops_bytes])
        read = read_runs(keys.tolist(), counts.tolist(), frames)
        events = pickle.dumps([(Tuples.OPENED, op[1], 0) for op in ops], protocol=5)
        ids, logprobs = step_arrays(len(read))
        return b"".join(
            (
                struct.pack("<IIIId", len(read), 1, TOP_K, len(events), 0.0),
                np.asarray(read, np.int64).tobytes(),
                np.zeros(len(read), np.float64).tobytes(),
                ids.tobytes(),
                logprobs.tobytes(),
                events,
            )
        )

    def read(self, payload: bytes) -> int:
        rows, frames, top_k, events_bytes, _compute_s = struct.unpack_from("<IIIId", payload)
        offset = struct.calcsize("<IIIId")
        keys = np.frombuffer(payload, np.int64, rows, offset).tolist()
        offset += 8 * rows
        queue_s = np.frombuffer(payload, np.float64, rows, offset).tolist()
        offset += 8 * rows
        size = rows * frames * top_k
        ids = np.frombuffer(payload, np.int32, size, offset).reshape(rows, frames, top_k)
        offset += 4 * size
        logprobs = np.frombuffer(payload, np.float32, size, offset).reshape(rows, frames, top_k)
        offset += 4 * size
        events = pickle.loads(payload[offset : offset + events_bytes])
        for row, _key in enumerate(keys):
            _row = ids[row], logprobs[row], queue_s[row]
        return len(events) + rows


CODECS = {"msgspec": Msgspec(), "tuples": Tuples(), "dataclass": Dataclasses(), "struct": Struct()}


def peer(address: str, authkey: bytes | None, transport: str, codec_name: str) -> None:
    """The engine's end: answer every message with ``codec`` until None."""
    codec = CODECS[codec_name]
    if transport == "zmq":
        import zmq

        sock = zmq.Context.instance().socket(zmq.PAIR)
        sock.connect(address)
        recv, send, close = sock.recv, sock.send, sock.close
    else:
        conn = Client(address, family="AF_UNIX", authkey=authkey)
        recv, send = (conn.recv, conn.send) if codec.pickled else (conn.recv_bytes, conn.send_bytes)
        close = conn.close
    while (message := recv()) != b"":
        send(codec.answer(message))
    close()


def time_round_trips(round_trip: Callable[[], None], iterations: int) -> float:
    for _ in range(20):
        round_trip()
    start = time.perf_counter()
    for _ in range(iterations):
        round_trip()
    return (time.perf_counter() - start) / iterations


def bench_connection(codec_name: str, iterations: int, chunked: bool = False) -> dict[int, float]:
    """One round trip's seconds per session count, over a fresh peer process; ``chunked``: one message per
    session per tick instead of one per tick."""
    codec = CODECS[codec_name]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        address, authkey = os.path.join(tmp, "s"), os.urandom(8)
        listener = Listener(address, family="AF_UNIX", authkey=authkey)
        process = mp.get_context("spawn").Process(target=peer, args=(address, authkey, "connection", codec_name))
        process.start()
        conn = listener.accept()
        send, recv = (conn.send, conn.recv) if codec.pickled else (conn.send_bytes, conn.recv_bytes)
        for n in SESSIONS:

            def round_trip(n=n) -> None:
                send(codec.request(n))
                codec.read(recv())

            def one_per_chunk(n=n) -> None:
                for _ in range(n):
                    send(codec.request(1))
                    codec.read(recv())

            if chunked:
                results[n] = time_round_trips(one_per_chunk, max(5, iterations // n))
            else:
                results[n] = time_round_trips(round_trip, iterations)
        send(b"")
        process.join()
        listener.close()
    return results


def bench_zmq(iterations: int) -> dict[int, float]:
    try:
        import zmq
    except ImportError:
        return {}
    codec = CODECS["msgspec"]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        address = f"ipc://{tmp}/z"
        sock = zmq.Context.instance().socket(zmq.PAIR)
        sock.bind(address)
        process = mp.get_context("spawn").Process(target=peer, args=(address, None, "zmq", "msgspec"))
        process.start()
        for n in SESSIONS:

            def round_trip(n=n) -> None:
                sock.send(codec.request(n))
                codec.read(sock.recv())

            results[n] = time_round_trips(round_trip, iterations)
        sock.send(b"")
        process.join()
        sock.close()
    return results


def request_bytes(codec, sessions: int) -> int:
    message = codec.request(sessions)
    return len(pickle.dumps(message, protocol=4) if codec.pickled else message)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    parser.add_argument("--iterations", type=int, default=500, help="round trips per codec, size and round")
    parser.add_argument("--rounds", type=int, default=3, help="times each codec is measured, alternating")
    parser.add_argument("--encodings", nargs="+", choices=list(CODECS), default=list(CODECS))
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args(argv)
    names = args.encodings
    by_codec: dict[str, dict[int, list[float]]] = {name: {n: [] for n in SESSIONS} for name in names}
    for round_index in range(args.rounds):
        shift = round_index % len(names)  # (a new order each round: none always runs first)
        for name in names[shift:] + names[:shift]:
            for n, seconds in bench_connection(name, args.iterations).items():
                by_codec[name][n].append(seconds)
    chunked = bench_connection("msgspec", args.iterations, chunked=True)
    zmq_s = bench_zmq(args.iterations)
    us = 1e6
    output = {
        "round_trip_us": {
            name: {str(n): [round(s * us, 1) for s in rounds] for n, rounds in by_n.items()}
            for name, by_n in by_codec.items()
        },
        "median_us": {
            name: {str(n): round(statistics.median(rounds) * us, 1) for n, rounds in by_n.items()}
            for name, by_n in by_codec.items()
        },
        "per_chunk_us": {str(n): round(s * us, 1) for n, s in chunked.items()},
        "zmq_us": {str(n): round(s * us, 1) for n, s in zmq_s.items()},
        "request_bytes": {name: {str(n): request_bytes(CODECS[name], n) for n in SESSIONS} for name in names},
    }
    print(json.dumps(output, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(output, f, indent=2)
    print(
        f"\n{'encoding':<12}"
        + "".join(f"{f'{n} sess':>22}" for n in SESSIONS)
        + "\n(round trip per tick, us: median [min-max] of the rounds)"
    )
    for name, by_n in by_codec.items():
        cells = (
            f"{statistics.median(r) * us:.0f} [{min(r) * us:.0f}-{max(r) * us:.0f}]"
            for r in map(by_n.get, SESSIONS)
        )
        print(f"{name:<12}" + "".join(f"{cell:>22}" for cell in cells))
    for name, by_n in (("per-chunk", chunked), ("zmq", zmq_s)):
        if by_n:
            print(f"{name:<12}" + "".join(f"{by_n[n] * us:>22.0f}" for n in SESSIONS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
