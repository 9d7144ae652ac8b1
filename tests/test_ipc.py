"""The engine channel's messages: ``unpack(pack(m))`` gives ``m`` back, through pickle as on the socket."""

from __future__ import annotations

import pickle

import numpy as np

from cosystream.engine import ipc
from cosystream.frames import FRAME_SAMPLES


def frames(n: int, value: float) -> np.ndarray:
    return np.full((n, FRAME_SAMPLES), value, np.float32)


def test_to_engine_round_trips_and_keeps_each_run():
    message = ipc.ToEngine(ops=[(ipc.Op.OPEN, 3, 1), (ipc.Op.RESET, 4), (ipc.Op.LISTENING, 0)])
    message.add_frames(3, frames(2, 0.5))
    message.add_frames(4, frames(1, -0.25))
    message.add_frames(3, frames(3, 0.125))
    built = [(key, run.copy()) for key, run in message.runs()]
    received = ipc.ToEngine.unpack(pickle.loads(pickle.dumps(message.pack(), protocol=5)))
    assert received.ops == message.ops and isinstance(received.ops[0][0], ipc.Op)
    assert [key for key, _ in received.runs()] == [3, 4, 3]
    for (key, run), (key2, run2) in zip(built, received.runs(), strict=True):
        assert key == key2
        np.testing.assert_array_equal(run, run2)


def test_an_empty_message_round_trips():
    received = ipc.ToEngine.unpack(ipc.ToEngine().pack())
    assert not received and list(received.runs()) == []


def test_to_frontend_round_trips():
    box = ipc.ToFrontend(events=[(ipc.Event.OPENED, 3), (ipc.Event.ACTIVE, 5, 2)])
    ids = np.arange(8, dtype=np.int32).reshape(2, 4, 1)
    box.add_step([3, 9], ids, np.zeros((2, 4, 1), np.float32), [0.001, 0.003], 0.002)
    box.add_step([3], ids[:1, :1] + 100, np.ones((1, 1, 1), np.float32), [0.0], 0.004)
    received = ipc.ToFrontend.unpack(pickle.loads(pickle.dumps(box.pack(), protocol=5)))
    assert received.events == box.events and received.keys == [3, 9, 3]
    rows = list(received.rows())
    assert [(key, q, c) for key, _, _, q, c in rows] == [(3, 0.001, 0.002), (9, 0.003, 0.002), (3, 0.0, 0.004)]
    np.testing.assert_array_equal(rows[1][1], ids[1])
    assert rows[2][1].tolist() == [[100]] and rows[2][2].shape == (1, 1)


def test_the_engine_client_and_the_naive_baseline_are_both_engines():
    from cosystream.app.naive import NaiveEngine
    from cosystream.frontend.engine_client import Engine, EngineClient

    assert isinstance(EngineClient("/nonexistent.sock", b"key"), Engine)
    assert isinstance(NaiveEngine(None, max_sessions=2), Engine)
