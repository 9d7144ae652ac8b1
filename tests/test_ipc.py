"""The engine channel's messages: ``unpack(pack(m))`` gives ``m`` back, every op and event class included."""

from __future__ import annotations

import typing
from multiprocessing.connection import Pipe

import numpy as np
import pytest

from cosystream.engine import ipc
from cosystream.engine.headroom import Degradation, LoadReport
from cosystream.frames import FRAME_SAMPLES

MODEL = ipc.ModelInfo("m", "abc", "/models/m", "en", ["_", "a", "b"], "letters", 1234, 2, "float16", id=3)
INFO = ipc.EngineInfo("cpu", (MODEL,), max_sessions=8, graph_mode="eager", top_k=4, held_models=1)
REPORT = LoadReport(0.5, 3, 1, 4, 12, False, 0.9, 2, Degradation.BATCH_SQUEEZED)
OPS = [
    ipc.Open(3, 1),
    ipc.Open(4, 2, model=3),
    ipc.Reset(4),
    ipc.End(3),
    ipc.Close(4),
    ipc.Listening(),
    ipc.Load(1, "m", "/models/m", "float16"),
    ipc.Unload(2, "m"),
    ipc.Prepared(1, "no lexicon"),
]
EVENTS = [
    ipc.Hello(INFO),
    ipc.Opened(3, 0),
    ipc.Rejected(4, "no room"),
    ipc.Rejected(5, "overloaded", 1.5, "overloaded"),
    ipc.Shed(6, "make room"),
    ipc.Active(5, 2, None),
    ipc.Active(5, 2, REPORT),
    ipc.Models((MODEL,), 2),
    ipc.Moved(3, 3),
    ipc.Loaded(1, MODEL, "", "", 0.001, 2.5),
    ipc.Loaded(2, None, ipc.BUSY, "another model is being loaded", 0.0, 0.0),
    ipc.Unloaded(2, ""),
    ipc.Prepare(1, MODEL),
]


def frames(n: int, value: float) -> np.ndarray:
    return np.full((n, FRAME_SAMPLES), value, np.float32)


def test_every_op_and_event_class_is_on_the_wire():
    """A class the decoders do not list could be built and sent, and not read: the lists are the classes."""
    assert set(typing.get_args(ipc.AnyOp)) == set(ipc.Op.__subclasses__()) == {type(op) for op in OPS}
    assert set(typing.get_args(ipc.AnyEvent)) == set(ipc.Event.__subclasses__()) == {type(e) for e in EVENTS}


def test_to_engine_round_trips_and_keeps_each_run():
    message = ipc.ToEngine(ops=list(OPS))
    message.add_frames(3, frames(2, 0.5))
    message.add_frames(4, frames(1, -0.25))
    message.add_frames(3, frames(3, 0.125))
    built = [(key, run.copy()) for key, run in message.runs()]
    received = ipc.ToEngine.unpack(message.pack())
    assert received.ops == OPS and [type(op) for op in received.ops] == [type(op) for op in OPS]
    assert [key for key, _ in received.runs()] == [3, 4, 3]
    for (key, run), (key2, run2) in zip(built, received.runs(), strict=True):
        assert key == key2 and run2.dtype == np.float32
        np.testing.assert_array_equal(run, run2)


def test_an_empty_message_round_trips():
    received = ipc.ToEngine.unpack(ipc.ToEngine().pack())
    assert not received and list(received.runs()) == []
    assert not ipc.ToFrontend.unpack(ipc.ToFrontend().pack())


def test_to_frontend_round_trips():
    box = ipc.ToFrontend(events=list(EVENTS))
    ids = np.arange(8, dtype=np.int32).reshape(2, 4, 1)
    box.add_step([3, 9], ids, np.zeros((2, 4, 1), np.float32), [0.001, 0.003], 0.002)
    box.add_step([3], ids[:1, :1] + 100, np.ones((1, 1, 1), np.float32), [0.0], 0.004)
    received = ipc.ToFrontend.unpack(box.pack())
    assert received.events == EVENTS and received.keys == [3, 9, 3]
    hello = received.events[0]
    assert hello.info.models[0].vocabulary == ["_", "a", "b"] and hello.info.model_name == "m"
    assert received.events[6].report.stage is Degradation.BATCH_SQUEEZED
    rows = list(received.rows())
    assert [(key, q, c) for key, _, _, q, c in rows] == [(3, 0.001, 0.002), (9, 0.003, 0.002), (3, 0.0, 0.004)]
    np.testing.assert_array_equal(rows[1][1], ids[1])
    assert rows[1][1].dtype == np.int32 and rows[1][2].dtype == np.float32
    assert rows[2][1].tolist() == [[100]] and rows[2][2].shape == (1, 1)


def test_a_step_of_some_rows_of_a_larger_one_round_trips():
    """A step shared by several frontends sends each its rows (fancy-indexed copies); the logprobs of a step
    come as a strided view."""
    out = np.arange(2 * 3 * 4 * 2, dtype=np.float32).reshape(2, 3, 4, 2)
    box = ipc.ToFrontend()
    box.add_step([7, 8], out[..., 0].astype(np.int32), out[..., 1], [0.0, 0.0], 0.001)
    (step,) = ipc.ToFrontend.unpack(box.pack()).steps
    np.testing.assert_array_equal(step.logprobs, out[..., 1])
    np.testing.assert_array_equal(step.ids, out[..., 0])


def test_messages_cross_a_connection_as_bytes():
    ours, theirs = Pipe()
    message = ipc.ToEngine(ops=[ipc.Open(1, 1)])
    message.add_frames(1, frames(1, 0.5))
    ours.send_bytes(message.pack())
    received = ipc.ToEngine.unpack(theirs.recv_bytes())
    assert received.ops == [ipc.Open(1, 1)] and next(received.runs())[1][0, 0] == 0.5


def test_messages_are_frozen():
    with pytest.raises(AttributeError):
        ipc.Open(1, 1).key = 2  # type: ignore[misc]


def test_the_engine_client_and_the_naive_baseline_are_both_engines():
    from cosystream.app.naive import NaiveEngine
    from cosystream.frontend.engine_client import Engine, EngineClient

    assert isinstance(EngineClient("/nonexistent.sock", b"key"), Engine)
    assert isinstance(NaiveEngine(None, max_sessions=2), Engine)
