"""Admission by headroom: new REALTIME sessions refused (RESOURCE_EXHAUSTED with a RetryInfo) when one more
would take the engine's projected load past ``--admit-load``, BATCH ones admitted; the overload state, the
load GetServerInfo reports and the ``load`` health service, on the policy with a fake clock, on the engine
core, and on a real ``cosystream serve``."""

from __future__ import annotations

import contextlib
import itertools
import time

import grpc
import numpy as np
import pytest
import torch

from cosystream.engine import ipc
from cosystream.engine.config import EngineConfig
from cosystream.engine.core import EngineCore
from cosystream.engine.headroom import RETRY_AFTER_S, THIN_INTERIM_MS, Degradation, Headroom
from cosystream.priority import Priority
from cosystream.v1 import cosystream_pb2 as pb
from cosystream.v1 import cosystream_pb2_grpc as pb_grpc
from cosystream.v1.client import retry_after_s
from tests.servers import Served
from tests.speech import encode, needs_espeak, silence, speech
from tests.test_adaptive import FRAMES, FakeClock, send, tiny
from tests.test_server import config, run_stream


def line_cost(fixed_ms: float, per_row_ms: float):
    """A step cost model: ``fixed + per_row x rows`` ms (frames aside)."""
    return lambda rows, frames: (fixed_ms + per_row_ms * rows) / 1000


def test_one_more_session_is_refused_when_its_projected_load_passes_the_limit():
    clock = FakeClock()
    headroom = Headroom(0.9, window_s=1.0, clock=clock)
    cost = line_cost(1.0, 1.0)  # a step of 4 rows: 5 ms; of 5: 6 ms
    assert headroom.refuse(4, cost) is None  # (nothing measured yet)
    for _ in range(4):
        headroom.observe(0.7, rows=4, frames=1)
    assert headroom.projected(4, cost) == pytest.approx(0.7 * 6 / 5)  # 0.84: admitted
    assert headroom.refuse(4, cost) is None
    headroom.observe(0.8, rows=4, frames=1)  # the last four windows: 0.725, x 1.2 = 0.87
    headroom.observe(0.9, rows=4, frames=1)  # 0.775 x 1.2 = 0.93
    why = headroom.refuse(4, cost)
    assert why is not None and "projected load 0.93 with one more, limit 0.9)" in why
    assert headroom.refuse(0, cost) is None  # the first session always: what it costs is not known
    # Without a cost model (or before it measured), linear in rows: 0.775 x 5/4 = 0.97.
    assert headroom.projected(4) == pytest.approx(0.775 * 5 / 4)
    for _ in range(4):
        headroom.observe(0.0)  # windows without a realtime step: nothing to project from
    assert headroom.projected(4, cost) is None and headroom.refuse(4, cost) is None
    assert headroom.refused == 1
    assert Headroom(0, clock=clock).refuse(1, cost) is None  # 0: off


def test_one_more_row_of_a_batched_step_costs_its_share_of_the_step_not_a_sessions_share_of_the_load():
    headroom = Headroom(0.9, window_s=1.0, clock=FakeClock())
    for _ in range(4):
        headroom.observe(0.2, rows=1, frames=2)  # one live stream: 0.2, mostly the step's fixed cost
    # A step of two rows costs 3.2 ms where one costs 3.1 ms: one more stream takes 0.2 to 0.206, not 0.4.
    assert headroom.projected(1, line_cost(3.0, 0.1)) == pytest.approx(0.2 * 3.2 / 3.1)


def test_the_load_of_sessions_just_ended_is_not_charged_to_those_left():
    headroom = Headroom(0.9, window_s=1.0, clock=FakeClock())
    cost = line_cost(1.0, 1.0)
    for _ in range(4):
        headroom.observe(0.88, rows=10, frames=1)  # ten calls speaking: steps of 10 rows, 11 ms
    assert headroom.refuse(10, cost) is not None  # 0.88 x 12/11 = 0.96
    # They end but one: the windows still hold their load, but a step of two rows costs 3 ms, not 11.
    assert headroom.projected(1, cost) == pytest.approx(0.88 * 3 / 11)
    assert headroom.refuse(1, cost) is None


def test_a_step_cost_guessed_past_linear_prices_one_more_session_no_more_than_linearly():
    """The cost model's guess for a bucket never measured (its fitted line), or a noisy one, can put a step of
    one more row at many times the cost of the steps measured; no step costs more than linearly more."""
    headroom = Headroom(0.9, window_s=1.0, clock=FakeClock())
    for _ in range(4):
        headroom.observe(0.4, rows=8, frames=1, sessions=8, compute=0.2)  # eight calls, half of it steps

    def wild(rows: int, frames: int) -> float:
        return 0.001 if rows <= 8 else 0.055  # (9 rows: guessed at 55x)

    assert headroom.projected(8, wild) == pytest.approx(0.4 * 9 / 8)
    assert headroom.refuse(8, wild) is None


def test_sessions_admitted_since_the_windows_are_priced_before_their_speech_reaches_the_load():
    """A ramp of arrivals: the windows measured ten sessions' steps, ten more were admitted since (their
    audio not stepped yet). One more is priced as a step of 21 sessions' rows, not of 11."""
    headroom = Headroom(0.9, window_s=1.0, clock=FakeClock())
    cost = line_cost(1.0, 1.0)
    for _ in range(4):
        headroom.observe(0.5, rows=10, frames=1, sessions=10)
    assert headroom.projected(10, cost) == pytest.approx(0.5 * 12 / 11)  # steady: admitted
    assert headroom.projected(20, cost) == pytest.approx(0.5 * 22 / 11)  # 1.0: refused
    assert headroom.refuse(20, cost) is not None
    # Steps more often than every session's frame: 40 sessions open, 20 rows a step; one more adds half a row.
    steps = Headroom(0.9, window_s=1.0, clock=FakeClock())
    for _ in range(4):
        steps.observe(0.5, rows=20, frames=1, sessions=40)
    assert steps.projected(40, cost) == pytest.approx(0.5 * 22 / 21)  # (ceil(20.5) rows)
    assert steps.projected(60, cost) == pytest.approx(0.5 * 32 / 21)  # (ceil(30.5) rows)


def test_the_work_around_the_steps_is_priced_per_session_and_the_steps_by_their_cost():
    """Of a 0.6 load, 0.2 was model steps: with twice the sessions (20 rows) the steps cost 21/11 as much, the rest
    (IPC, queues, results: per frame) twice as much."""
    headroom = Headroom(0.9, window_s=1.0, clock=FakeClock())
    for _ in range(4):
        headroom.observe(0.6, rows=10, frames=1, sessions=10, compute=0.2)
    assert headroom.projected(19, line_cost(1.0, 1.0)) == pytest.approx(0.2 * 21 / 11 + 0.4 * 20 / 10)
    assert headroom.projected(10, line_cost(1.0, 1.0)) == pytest.approx(0.2 * 12 / 11 + 0.4 * 11 / 10)


def test_overloaded_once_over_the_limit_for_the_window_and_back_once_under_for_as_long():
    clock = FakeClock()
    headroom = Headroom(0.9, window_s=1.0, clock=clock)
    changes = []
    for load in [0.95, 0.95, 0.95, 0.5, 0.95, 0.95, 0.95, 0.95, 0.3, 0.3, 0.3, 0.3]:
        clock.now += 0.5
        if headroom.observe(load):
            changes.append((clock.now - 1000, headroom.overloaded))
    # Over from 0.5 s: 1 s later, overloaded; the dip at 2.0 s restarts the count (over again from 2.5 s:
    # still overloaded, it had not been under for a window); under from 4.5 s: no longer at 5.5 s.
    assert changes == [(1.5, True), (5.5, False)]
    off = Headroom(0, window_s=0, clock=clock)  # off: overloaded means busy all the time
    assert not off.observe(0.99) and off.observe(1.0) and off.overloaded


def test_degradation_sheds_batch_then_interims_then_admission_and_comes_back():
    clock = FakeClock()
    headroom = Headroom(1.0, window_s=1.0, clock=clock)
    stages = []
    for load in [
        0.5,
        0.75,
        0.75,
        0.75,
        0.9,
        0.9,
        0.9,
        0.9,
        1.0,
        1.0,
        1.0,
        0.85,
        0.6,
        0.6,
        0.6,
        0.6,
        0.1,
        0.1,
        0.1,
    ]:
        clock.now += 0.5
        headroom.observe(load)
        stages.append(int(headroom.stage))
    # The stages follow the 2 s average (from 0.7 and 0.95 of the limit, until 0.1 under: 0.79 squeezes BATCH,
    # 0.95 thins interims), admission closes with the overload state (1 s at the limit) and ends with it (1 s
    # under), and the stages come back down with the average (0.76: squeezed still, no longer thinned; 0.6:
    # squeezed still).
    assert stages == [0, 0, 0, 0, 1, 1, 1, 1, 1, 2, 3, 3, 3, 1, 1, 1, 0, 0, 0], stages
    assert not headroom.overloaded and headroom.stage == Degradation.NONE


def test_the_engine_refuses_realtime_past_the_limit_and_admits_batch():
    clock = FakeClock()
    config_ = EngineConfig(
        max_sessions=8, max_batch=8, realtime_batch_window_s=0, admit_load=0.9, overload_window_s=1.0
    )
    core = EngineCore([tiny(1, 0)], config_, torch.device("cpu"), None, ["m"], None, clock)
    realtime, batch = int(Priority.REALTIME), int(Priority.BATCH)
    box = send(core, [ipc.Open(1, realtime, 0)])
    assert [type(e) for e in box.events] == [ipc.Opened]
    for _ in range(8):  # 2 s at 0.7 busy, a step of the one realtime session in each window
        send(core, [], {1: FRAMES[:1]})
        clock.now += 0.25
        core.observe_load(0.7 * 0.25)
    assert core.report.load == 0.7 and not core.report.overloaded
    assert core.scheduler.realtime_load == pytest.approx(0.7)  # (BATCH's duty cap subtracts the whole load)
    box = send(core, [ipc.Open(2, realtime, 0), ipc.Open(3, batch, 0)])
    rejected = [e for e in box.events if isinstance(e, ipc.Rejected)]
    assert [(e.key, e.retry_after_s, e.reason) for e in rejected] == [(2, RETRY_AFTER_S, "overloaded")]
    assert "projected load 1.40 with one more, limit 0.9)" in rejected[0].message
    assert [e.key for e in box.events if isinstance(e, ipc.Opened)] == [3]  # BATCH: admitted, slowed by the load
    for _ in range(8):
        clock.now += 0.25
        core.observe_load(0.95 * 0.25)
    report = core.report
    assert (report.realtime, report.batch, report.free_slots, report.overloaded) == (1, 1, 6, True)
    assert report.refused == 1 and report.admit_load == 0.9
    for _ in range(8):
        clock.now += 0.25
        core.observe_load(0.1 * 0.25)
    assert not core.report.overloaded and core.scheduler.realtime_load == pytest.approx(0.1)
    assert [type(e) for e in send(core, [ipc.Open(2, realtime, 0)]).events] == [ipc.Opened]


def test_batch_sessions_open_take_their_floor_share_off_the_realtime_limit():
    headroom = Headroom(0.9, window_s=1.0, clock=FakeClock())
    cost = line_cost(1.0, 1.0)
    for _ in range(4):
        headroom.observe(0.7, rows=4, frames=1)
    assert headroom.projected(4, cost) == pytest.approx(0.84)
    assert headroom.refuse(4, cost) is None  # 0.84 <= 0.9
    why = headroom.refuse(4, cost, batch_share=0.1)  # 0.84 > 0.9 - 0.1: BATCH keeps a tenth of the engine
    assert why is not None and "(projected load 0.84 with one more, limit 0.9 less BATCH's floor share 0.1)" in why
    assert headroom.refuse(4, cost, batch_share=0.05) is None


def test_the_engine_prices_batchs_floor_share_into_realtime_admission_while_batch_sessions_are_open():
    clock = FakeClock()
    config_ = EngineConfig(
        max_sessions=8, max_batch=8, realtime_batch_window_s=0, admit_load=0.9, overload_window_s=60.0
    )
    core = EngineCore([tiny(1, 0)], config_, torch.device("cpu"), None, ["m"], None, clock)
    realtime, batch = int(Priority.REALTIME), int(Priority.BATCH)
    send(core, [ipc.Open(1, realtime, 0)])
    send(core, [], {1: FRAMES[:1]})  # (torch's first step: out of the windows below)
    for _ in range(8):  # 2 s at 0.43: one more session projects to at most 0.86, over 0.9 - 0.1, under 0.9
        send(core, [], {1: FRAMES[:1]})
        clock.now += 0.25
        core.observe_load(0.43 * 0.25)
    projected = core.headroom.projected(1, core._realtime_step_cost)
    assert 0.8 < projected <= 0.86, projected
    box = send(core, [ipc.Open(3, batch, 0), ipc.Open(2, realtime, 0)])
    assert [e.key for e in box.events if isinstance(e, ipc.Opened)] == [3]
    (rejected,) = [e for e in box.events if isinstance(e, ipc.Rejected)]
    assert rejected.key == 2 and rejected.reason == "overloaded"
    assert "limit 0.9 less BATCH's floor share 0.1)" in rejected.message
    send(core, [ipc.Close(3)])  # the file is done: realtime gets the whole limit back
    assert [type(e) for e in send(core, [ipc.Open(2, realtime, 0)]).events] == [ipc.Opened]


def test_calls_that_end_during_the_windows_leave_their_load_to_the_sessions_that_made_it():
    """A wave of twelve calls ends over 2 s (three hang up each half second), each call 0.055 of load while it
    speaks, and a second wave calls in at once. Its sessions are priced by the load per session that was
    measured (the windows' load over the sessions stepped in them), so the engine takes calls while 16 fit under
    0.9; priced by the sessions left at each window's end (9, 6, 3, 1), the same load looked like 0.087 per
    session and the door closed at 10."""
    clock = FakeClock()
    config_ = EngineConfig(
        max_sessions=24, max_batch=24, realtime_batch_window_s=0, admit_load=0.9, overload_window_s=60.0
    )
    core = EngineCore([tiny(1, 0)], config_, torch.device("cpu"), None, ["m"], None, clock)
    realtime = int(Priority.REALTIME)
    warm = list(range(200, 212))  # (torch's first steps take a second: out of the windows below)
    send(core, [ipc.Open(key, realtime, 0) for key in warm], {key: FRAMES[:1] for key in warm})
    send(core, [ipc.Close(key) for key in warm])
    for _ in range(4):
        clock.now += 0.5
        core.observe_load(0.0)
    first = list(range(12))
    box = send(core, [ipc.Open(key, realtime, 0) for key in first])
    assert [type(e) for e in box.events] == [ipc.Opened] * 12
    for hanging_up in (3, 3, 3, 2):  # four load windows of 0.5 s, two steps of every open call in each
        send(core, [], {key: FRAMES[:1] for key in first})
        clock.now += 0.25
        core.observe_load(0.055 * len(first) * 0.25)
        send(core, [], {key: FRAMES[:1] for key in first})
        send(core, [ipc.Close(key) for key in first[:hanging_up]])  # (before the window ends)
        clock.now += 0.25
        core.observe_load(0.055 * len(first) * 0.25)
        del first[:hanging_up]
    assert len(first) == 1
    admitted = 0
    for key in range(100, 124):
        box = send(core, [ipc.Open(key, realtime, 0)])
        if not any(isinstance(e, ipc.Opened) for e in box.events):
            break
        admitted += 1
    assert box.events and isinstance(box.events[0], ipc.Rejected) and box.events[0].reason == "overloaded"
    assert admitted == 15, admitted  # 16 calls open: 0.88 (linear: the tiny model's steps are a small share)


def test_bad_limits_are_refused():
    with pytest.raises(ValueError, match="--admit-load must be between 0"):
        EngineConfig(admit_load=-1)
    with pytest.raises(ValueError, match="--overload-window-s must be >= 0"):
        EngineConfig(overload_window_s=float("inf"))


# --- a real server -----------------------------------------------------------------------------


def load_health(served: Served) -> int:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(served.address) as channel:
        return (
            health_pb2_grpc.HealthStub(channel)
            .Check(health_pb2.HealthCheckRequest(service="load"), timeout=5)
            .status
        )


@needs_espeak
def test_a_loaded_server_refuses_realtime_with_a_retry_delay_serves_batch_and_recovers():
    from grpc_health.v1 import health_pb2

    from tests.test_admin import Speaker

    sentence = encode(
        np.concatenate([speech("the quick brown fox jumps over the lazy dog"), silence(0.5)]), "LINEAR16"
    )
    # A limit so low that one live stream passes it (its load: 0.1-0.2 here; an idle engine's: under 0.005).
    flags = ("--frontends", "1", "--admit-load", "0.02", "--overload-window-s", "0", "--final-model", "off")
    with Served(*flags) as served:
        serving = health_pb2.HealthCheckResponse.SERVING
        served.wait(lambda: load_health(served) == serving, 30, "the load service SERVING at rest")
        assert served.info().load.admit_load == pytest.approx(0.02)
        speaker = Speaker(served.stub(), 0, sentence)
        try:
            served.wait(lambda: served.info().load.overloaded, 30, "overloaded under one live stream")
            time.sleep(2.5)  # (admission reads the last 2 s of load: the stream's alone from here)
            load = served.info().load
            assert load.realtime_sessions == 1 and load.engine_load >= 0.02 and load.free_slots > 0
            assert load_health(served) == health_pb2.HealthCheckResponse.NOT_SERVING
            assert served.health() == serving  # (the server itself serves its live sessions)
            with pytest.raises(grpc.RpcError) as refused:  # (speech: a stream of silence may end before)
                run_stream(served.stub(), config(), sentence)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "at capacity for realtime sessions" in refused.value.details()
            assert retry_after_s(refused.value.trailing_metadata()) == RETRY_AFTER_S
            assert load.degradation == "admission_closed"  # (and BATCH squeezed, interims thinned)
            assert served.metric("cosystream_engine_degradation") == 3
            # BATCH: served, slower, its interims at most every 500 ms of audio.
            responses = run_stream(served.stub(), config(priority=pb.BATCH, interim_results=True), sentence)
            results = [r for x in responses for r in x.results]
            assert any("lazy dog" in r.transcript for r in results if r.is_final), responses
            interims = [r.end_ms for r in results if not r.is_final]
            assert len(interims) >= 2 and all(b - a >= THIN_INTERIM_MS for a, b in itertools.pairwise(interims)), (
                interims
            )
            served.wait(lambda: served.info().load.refused_for_load >= 1, 10, "the refusal counted")
            assert served.metric("cosystream_rejected_sessions_total", reason="overloaded") >= 1
            assert served.metric("cosystream_engine_overloaded") == 1
        finally:
            speaker.close()
        assert speaker.error is None
        served.wait(lambda: not served.info().load.overloaded, 30, "no longer overloaded once the stream ended")
        served.wait(lambda: load_health(served) == serving, 10, "the load service SERVING again")
        served.wait(lambda: served.info().load.degradation == "none", 10, "nothing shed once the stream ended")
        assert served.metric("cosystream_engine_degradation") == 0
        assert any("overloaded: projected realtime load" in line for line in served.log)
        shed = [line for line in served.log if "degradation " in line and " -> " in line]
        assert any("-> admission_closed" in line for line in shed) and any("-> none" in line for line in shed), (
            shed
        )
        assert any("interims thinned to one per 500 ms" in line for line in served.log)
        deadline = time.monotonic() + 10
        while True:  # (the next window at rest reopens admission)
            try:
                run_stream(served.stub(), config(), sentence)
                break
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() < deadline
                time.sleep(0.5)


def test_the_loop_lag_is_the_median_lateness_of_the_last_two_seconds():
    import asyncio

    from cosystream.frontend.loop_lag import PROBE_S, WINDOW_S, LoopLag

    async def measure(block_s: float) -> float:
        lag = LoopLag()
        lag.start()
        end = time.monotonic() + WINDOW_S + 0.5
        while time.monotonic() < end:
            await asyncio.sleep(PROBE_S)
            time.sleep(block_s)  # (a loop this busy: every wake-up comes this late)
        late = lag.median_s
        lag.stop()
        return late

    assert asyncio.run(measure(0.0)) < 0.02
    assert 0.08 < asyncio.run(measure(0.1)) < 0.3


@contextlib.contextmanager
def local_stub(**stream_options):
    """A stub of an in-process server (4 slots) whose streams take ``stream_options``."""
    from cosystream.app.local import LocalServer
    from cosystream.engine.config import EngineConfig as Engine
    from cosystream.frontend.host import StreamOptions
    from cosystream.server.frontend import FrontendConfig

    stream = StreamOptions(idle_timeout_s=5.0, **stream_options)
    frontend = FrontendConfig(host="127.0.0.1", port=0, stream=stream)
    with (
        LocalServer(frontend_config=frontend, engine=Engine(max_sessions=4, max_batch=4)) as server,
        grpc.insecure_channel(server.address) as channel,
    ):
        yield pb_grpc.CosyStreamStub(channel)


def test_a_frontend_behind_refuses_realtime_with_a_retry_delay_and_serves_batch():
    # A limit no loop meets (any wake-up is later than 1 us): the frontend counts as behind once it has sampled.
    with local_stub(admit_lag_s=1e-6) as stub:
        run_stream(stub, config(), bytes(3200))  # (the first starts the sampling)
        time.sleep(2.5)
        with pytest.raises(grpc.RpcError) as refused:
            run_stream(stub, config(), bytes(3200))
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "its frontend runs" in refused.value.details() and "limit 0.001 ms" in refused.value.details()
        assert retry_after_s(refused.value.trailing_metadata()) == RETRY_AFTER_S
        run_stream(stub, config(priority=pb.BATCH), bytes(3200))  # BATCH: served
        info = stub.GetServerInfo(pb.GetServerInfoRequest())
        assert info.load.frontend_lag_ms > 0.001


def test_a_frontend_that_reads_realtime_audio_late_refuses_realtime_until_it_catches_up():
    """Audio read behind real time (here: a client that sends at half of it; for the frontend, the same as
    chunks waiting in its sockets) refuses new REALTIME sessions past ``admit_late_s``, with a retry delay;
    BATCH is served, GetServerInfo reports the lateness, and once the late stream ends, REALTIME is taken."""
    import threading

    with local_stub(admit_late_s=0.8) as stub:
        run_stream(stub, config(), bytes(3200 * 10), pace_s=0.1)  # (read as it is spoken: no refusal after)
        assert stub.GetServerInfo(pb.GetServerInfoRequest()).load.audio_late_ms == 0
        slow = threading.Thread(target=run_stream, args=(stub, config(), bytes(3200 * 20)), kwargs={"pace_s": 0.2})
        slow.start()
        time.sleep(1.0)
        run_stream(stub, config(), bytes(3200))  # 0.5 s behind after 1 s: under the limit, taken
        time.sleep(1.5)
        with pytest.raises(grpc.RpcError) as refused:  # 1.25 s behind
            run_stream(stub, config(), bytes(3200))
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "reads their audio" in refused.value.details() and "limit 800 ms" in refused.value.details()
        assert retry_after_s(refused.value.trailing_metadata()) == RETRY_AFTER_S
        run_stream(stub, config(priority=pb.BATCH), bytes(3200))  # BATCH: served
        assert stub.GetServerInfo(pb.GetServerInfoRequest()).load.audio_late_ms > 1000
        slow.join(10)
        assert stub.GetServerInfo(pb.GetServerInfoRequest()).load.audio_late_ms == 0
        run_stream(stub, config(), bytes(3200))


def test_a_frontend_reading_realtime_audio_late_reads_batch_no_faster_than_real_time():
    """BATCH is shed first on the frontend too: while its REALTIME audio is read late, a BATCH stream is read
    at real time, not as fast as it is sent, and still ends OK; at full speed again once realtime is on time."""
    import threading

    audio = bytes(3200 * 30)  # 3 s

    def batch_s() -> float:
        started = time.monotonic()
        run_stream(stub, config(priority=pb.BATCH), audio)
        return time.monotonic() - started

    with local_stub() as stub:
        alone_s = batch_s()
        slow = threading.Thread(target=run_stream, args=(stub, config(), bytes(3200 * 40)), kwargs={"pace_s": 0.2})
        slow.start()  # (half of real time for 8 s: 0.5 s behind after 1 s)
        time.sleep(1.0)
        behind_s = batch_s()
        slow.join(15)
        again_s = batch_s()
    assert alone_s < 1.5 and again_s < 1.5, (alone_s, again_s)
    assert behind_s > 2.5, behind_s
