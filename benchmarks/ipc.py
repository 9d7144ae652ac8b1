"""The frontend <-> engine channel: what one tick's message costs, by transport and batch size.

A tick's message carries one 10 ms frame (160 float32 samples) for each of N sessions, as the frontend
sends it (``ToEngine.pack()``), and the engine answers with the 8 best token ids and log-probabilities per
frame, one step's block (``ToFrontend.add_step``).
Measures the round trip (send, the peer receives and answers, receive) between two processes for:

- ``connection``: ``multiprocessing.connection`` over a Unix socket, pickle protocol 5 (what cosystream uses);
- ``zmq``: pyzmq PAIR over ``ipc://`` with the same pickled payload (if pyzmq is installed);
- ``per-chunk``: the unbatched alternative, one message per session per tick over the same connection.

    python benchmarks/ipc.py
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import pickle
import sys
import tempfile
import time
from multiprocessing.connection import Client, Listener

import numpy as np

from cosystream.engine import ipc
from cosystream.v1.client import HelpFormatter

SESSIONS = (1, 16, 64, 256)


def tick_message(sessions: int) -> tuple:
    message = ipc.ToEngine()
    frames = np.zeros((1, 160), dtype=np.float32)
    for key in range(sessions):
        message.add_frames(key, frames)
    return message.pack()


TOP_K = 8  # the candidates per frame a beam-search frontend reads


def reply(message: tuple) -> tuple:
    """The engine's answer: one step of every session's frame, as ``EngineCore`` files it."""
    _, keys, _counts, _frames = message
    box = ipc.ToFrontend()
    rows = len(keys)
    box.add_step(
        list(keys), np.zeros((rows, 1, TOP_K), np.int32), np.zeros((rows, 1, TOP_K), np.float32), [0.0] * rows, 0.0
    )
    return box.pack()


def connection_peer(address: str, authkey: bytes) -> None:
    with Client(address, family="AF_UNIX", authkey=authkey) as conn:
        while True:
            message = conn.recv()
            if message is None:
                return
            conn.send(reply(message))


def zmq_peer(address: str) -> None:
    import zmq

    sock = zmq.Context.instance().socket(zmq.PAIR)
    sock.connect(address)
    while True:
        message = pickle.loads(sock.recv())
        if message is None:
            return
        sock.send(pickle.dumps(reply(message), protocol=5))


def time_round_trips(send, recv, message, iterations: int) -> float:
    for _ in range(20):
        send(message)
        recv()
    start = time.perf_counter()
    for _ in range(iterations):
        send(message)
        recv()
    return (time.perf_counter() - start) / iterations


def bench_connection(iterations: int) -> dict:
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        address, authkey = os.path.join(tmp, "s"), os.urandom(8)
        listener = Listener(address, family="AF_UNIX", authkey=authkey)
        peer = mp.get_context("spawn").Process(target=connection_peer, args=(address, authkey))
        peer.start()
        conn = listener.accept()
        for n in SESSIONS:
            results[n] = time_round_trips(conn.send, conn.recv, tick_message(n), iterations)
        # Unbatched: one message per session per tick.
        per_chunk = {}
        for n in SESSIONS:
            single = tick_message(1)

            def one_tick(_message, n=n, single=single):
                for _ in range(n):
                    conn.send(single)
                    conn.recv()

            per_chunk[n] = time_round_trips(one_tick, lambda: None, None, max(5, iterations // n))
        conn.send(None)
        peer.join()
        listener.close()
    return {"connection": results, "per-chunk": per_chunk}


def bench_zmq(iterations: int) -> dict:
    try:
        import zmq
    except ImportError:
        return {}
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        address = f"ipc://{tmp}/z"
        sock = zmq.Context.instance().socket(zmq.PAIR)
        sock.bind(address)
        peer = mp.get_context("spawn").Process(target=zmq_peer, args=(address,))
        peer.start()
        for n in SESSIONS:
            results[n] = time_round_trips(
                lambda m: sock.send(pickle.dumps(m, protocol=5)),
                lambda: pickle.loads(sock.recv()),
                tick_message(n),
                iterations,
            )
        sock.send(pickle.dumps(None))
        peer.join()
    return {"zmq": results}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    parser.add_argument("--iterations", type=int, default=500)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    results = {**bench_connection(args.iterations), **bench_zmq(args.iterations)}
    table = {name: {str(n): seconds * 1e6 for n, seconds in by_n.items()} for name, by_n in results.items()}
    output = {
        "round_trip_us": table,
        "message_bytes": {str(n): len(pickle.dumps(tick_message(n), 5)) for n in SESSIONS},
    }
    print(json.dumps(output, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(output, f, indent=2)
    print(
        f"\n{'transport':<12}" + "".join(f"{f'{n} sess':>12}" for n in SESSIONS) + "   (round trip per tick, us)"
    )
    for name, by_n in table.items():
        print(f"{name:<12}" + "".join(f"{by_n[str(n)]:>12.1f}" for n in SESSIONS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
