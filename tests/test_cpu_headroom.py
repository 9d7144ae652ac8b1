"""Admission by the host's CPU (``serve --admit-cpu``): a frontend prices one more REALTIME session at its
measured CPU per session against the cores busy (``frontend/cpu.py``), refuses past the limit with a retry
delay, reads BATCH no faster than real time meanwhile, and reports the figures in GetServerInfo; on the
arithmetic with scripted counters, on cgroup and ``/proc/stat`` files, and on a real server beside real
busy processes."""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

from cosystream.app.commands.serve_config import default_frontends
from cosystream.engine.headroom import RETRY_AFTER_S
from cosystream.frontend.cpu import WINDOW_S, CpuHeadroom, HostCpu, cgroup_quota
from cosystream.frontend.host import StreamOptions
from cosystream.priority import Priority
from cosystream.v1 import cosystream_pb2 as pb
from cosystream.v1.client import retry_after_s
from tests.test_headroom import local_stub
from tests.test_server import config, run_stream


class Counters:
    """A host whose cores, busy time, this process's CPU time, clock and realtime sessions a test sets."""

    def __init__(self, cores: float = 2.0):
        self.cores = cores
        self.busy = self.own = self.now = 0.0
        self.sessions = self.batch_sessions = 0

    def busy_s(self) -> float:
        return self.busy

    def run(self, headroom: CpuHeadroom, seconds: float, busy: float, own: float, realtime: float, batch: float):
        """``seconds`` of ``busy`` cores on the host, ``own`` of them this frontend's, reading ``realtime``
        and ``batch`` seconds of audio per second, sampled every 0.25 s."""
        for _ in range(round(seconds / 0.25)):
            self.now += 0.25
            self.busy += busy * 0.25
            self.own += own * 0.25
            headroom.read_audio(Priority.REALTIME, realtime * 0.25)
            headroom.read_audio(Priority.BATCH, batch * 0.25)
            headroom.sample()


def headroom_of(counters: Counters) -> CpuHeadroom:
    return CpuHeadroom(
        counters,
        own_s=lambda: counters.own,
        clock=lambda: counters.now,
        realtime_sessions=lambda: counters.sessions,
        batch_sessions=lambda: counters.batch_sessions,
    )


def test_one_more_realtime_session_is_priced_at_the_frontends_cpu_per_session():
    counters = Counters(cores=2.0)
    headroom = headroom_of(counters)
    counters.sessions = 10
    headroom.sample()
    counters.run(headroom, WINDOW_S / 2, busy=1.0, own=0.1, realtime=10, batch=0)
    assert headroom.window is None  # (not a whole window yet: nothing is refused on it)
    counters.run(headroom, WINDOW_S, busy=1.0, own=0.1, realtime=10, batch=0)
    window = headroom.window
    assert window.cores == 2.0 and window.busy == pytest.approx(1.0) and window.sessions == pytest.approx(10)
    assert window.per_session == pytest.approx(0.01) and window.batch == 0
    assert window.projected(10) == pytest.approx(1.01)
    # A burst of 50 opens since the window: each priced before its audio reaches it.
    assert window.projected(60) == pytest.approx(1.51)
    assert window.projected(0) == pytest.approx(1.0)  # (sessions that ended still count until the window moves)


def test_batchs_share_of_the_frontends_cpu_is_left_out_and_the_last_price_kept_while_no_realtime_runs():
    counters = Counters(cores=4.0)
    headroom = headroom_of(counters)
    counters.sessions = 10
    headroom.sample()
    # 10 calls and BATCH read at 30x real time: 0.4 cores of the frontend's, 3/4 of its audio BATCH.
    counters.run(headroom, WINDOW_S, busy=3.5, own=0.4, realtime=10, batch=30)
    window = headroom.window
    assert window.batch == pytest.approx(0.3) and window.per_session == pytest.approx(0.01)
    assert window.projected(10) == pytest.approx(3.5 - 0.3 + 0.01)
    counters.sessions = 0
    counters.run(headroom, WINDOW_S, busy=1.0, own=0.0, realtime=0, batch=0)  # (the host busy with others)
    assert headroom.window.per_session == pytest.approx(0.01) and headroom.window.sessions == 0
    assert headroom.window.projected(0) == pytest.approx(1.01)


def test_batch_is_priced_at_what_it_keeps_once_slowed_to_real_time():
    # Four files read at 1.5x real time each (6 s of audio per second) and 10 calls: 0.4 of the frontend's
    # cores, 0.3 of them BATCH. Shed, BATCH is read at real time (4 s per second), so it keeps 0.2 of those
    # cores: only 0.1 can be freed for the calls. Read at 30x, the same 4 files keep 4/30 of their CPU.
    counters = Counters(cores=2.0)
    headroom = headroom_of(counters)
    counters.sessions, counters.batch_sessions = 10, 4
    headroom.sample()
    counters.run(headroom, WINDOW_S, busy=1.5, own=0.4, realtime=2, batch=6)
    window = headroom.window
    assert window.batch == pytest.approx(0.3) and window.batch_at_real_time == pytest.approx(0.2)
    assert window.per_session == pytest.approx(0.01)
    assert window.projected(10) == pytest.approx(1.5 - 0.1 + 0.01)
    counters.run(headroom, WINDOW_S, busy=1.5, own=0.4, realtime=2, batch=30)
    window = headroom.window
    assert window.batch == pytest.approx(0.4 * 30 / 32) and window.projected(10) == pytest.approx(
        1.5 - window.batch * (1 - 4 / 30) + window.per_session
    )
    counters.batch_sessions = 0  # (the files done: nothing kept)
    counters.run(headroom, WINDOW_S, busy=1.0, own=0.1, realtime=10, batch=0)
    assert headroom.window.batch == 0 and headroom.window.batch_at_real_time == 0


def test_cgroup_quotas_v2_and_v1_and_none(tmp_path: Path, caplog):
    v2 = tmp_path / "v2"
    (v2 / "app").mkdir(parents=True)
    (v2 / "app" / "cpu.max").write_text("150000 100000\n")
    (v2 / "app" / "cpu.stat").write_text("usage_usec 2500000\nuser_usec 2000000\n")
    quota = cgroup_quota(v2, "0::/app\n")
    assert quota.cores == 1.5 and quota.used_s() == 2.5
    (v2 / "app" / "cpu.max").write_text("max 100000\n")
    assert cgroup_quota(v2, "0::/app\n") is None
    # A quota on a parent folder counts for its children.
    (v2 / "app" / "worker").mkdir()
    (v2 / "app" / "cpu.max").write_text("50000 100000\n")
    assert cgroup_quota(v2, "0::/app/worker\n").cores == 0.5

    v1 = tmp_path / "v1"
    (v1 / "cpu" / "pod").mkdir(parents=True)
    (v1 / "cpuacct" / "pod").mkdir(parents=True)
    (v1 / "cpu" / "pod" / "cpu.cfs_quota_us").write_text("50000\n")
    (v1 / "cpu" / "pod" / "cpu.cfs_period_us").write_text("100000\n")
    (v1 / "cpuacct" / "pod" / "cpuacct.usage").write_text("3000000000\n")
    quota = cgroup_quota(v1, "4:memory:/pod\n3:cpuacct:/pod\n2:cpu:/pod\n0::/\n")
    assert quota.cores == 0.5 and quota.used_s() == 3.0
    # cpuacct mounted on its own, this process in another of its cgroups: that one's usage.
    (v1 / "cpuacct" / "batch").mkdir()
    (v1 / "cpuacct" / "batch" / "cpuacct.usage").write_text("7000000000\n")
    assert cgroup_quota(v1, "3:cpuacct:/batch\n2:cpu:/pod\n").used_s() == 7.0
    # No cpuacct controller for it at all: the quota's cores still count (serve's default --frontends), its
    # use is not known (admission by CPU has no window to refuse on).
    (v1 / "cpuacct" / "pod" / "cpuacct.usage").unlink()
    split = cgroup_quota(v1, "2:cpu:/pod\n")
    assert split.cores == 0.5 and split.used_s() is None
    host = HostCpu(quota=split, cpus=set(range(64)))
    assert host.cores == 0.5 and host.busy_s() is None and default_frontends(host.cores) == 1
    with caplog.at_level(logging.WARNING, logger="cosystream.frontend.cpu"):
        unknown = CpuHeadroom(host)
        unknown.sample()
        unknown.sample()
    assert unknown.window is None and unknown.sampled == 0
    assert [r.getMessage() for r in caplog.records] == [
        "the host's CPU use cannot be read (its cgroup has a CPU quota but no cpuacct usage): admission by CPU "
        "refuses nothing"
    ]
    (v1 / "cpu" / "pod" / "cpu.cfs_quota_us").write_text("-1\n")
    assert cgroup_quota(v1, "3:cpuacct:/pod\n2:cpu:/pod\n") is None

    # The host: a quota under the CPUs this process may run on decides; one over them does not.
    host = HostCpu(quota=cgroup_quota(v2, "0::/app/worker\n"), cpus={0, 1})
    assert host.cores == 0.5 and host.busy_s() == 2.5
    (v2 / "app" / "cpu.max").write_text("400000 100000\n")
    assert HostCpu(quota=cgroup_quota(v2, "0::/app\n"), cpus={0, 1}).quota is None


def test_serves_default_frontends_follow_a_containers_cpu_quota_not_the_nodes_cores(tmp_path: Path):
    # A pod limited to 2 cores on a 64-core node: the engine's core and one frontend, not 8 frontends.
    pod = tmp_path / "pod"
    pod.mkdir()
    (pod / "cpu.max").write_text("200000 100000\n")
    (pod / "cpu.stat").write_text("usage_usec 0\n")
    node = set(range(64))
    assert default_frontends(HostCpu(quota=cgroup_quota(tmp_path, "0::/pod\n"), cpus=node).cores) == 1
    (pod / "cpu.max").write_text("450000 100000\n")  # 4.5 cores: 4 whole ones, the engine's and 3 frontends
    assert default_frontends(HostCpu(quota=cgroup_quota(tmp_path, "0::/pod\n"), cpus=node).cores) == 3
    (pod / "cpu.max").write_text("max 100000\n")  # no quota: the CPUs it may run on, at most 8 frontends
    assert default_frontends(HostCpu(quota=cgroup_quota(tmp_path, "0::/pod\n"), cpus=node).cores) == 8
    assert default_frontends(HostCpu(quota=None, cpus={0, 1, 2}).cores) == 2
    assert default_frontends(0.5) == 1  # half a core: still one frontend
    # Measured for this process: its affinity (and quota), not os.cpu_count().
    assert default_frontends() == default_frontends(HostCpu(quota=cgroup_quota()).cores)
    assert default_frontends() <= max(1, len(os.sched_getaffinity(0)) - 1)


def test_proc_stat_counts_the_busy_time_of_the_cpus_this_process_may_run_on(tmp_path: Path):
    ticks = os.sysconf("SC_CLK_TCK")
    stat = tmp_path / "stat"
    # user nice system idle iowait irq softirq steal guest guest_nice
    stat.write_text(
        f"cpu  {9 * ticks} 0 0 0 0 0 0 0 0 0\n"
        f"cpu0 {ticks} {ticks} {ticks} {50 * ticks} {7 * ticks} {ticks} {ticks} {ticks} {ticks} 0\n"
        f"cpu1 {100 * ticks} 0 0 0 0 0 0 0 0 0\n"
        "intr 1 2 3\n"
    )
    # (not idle, iowait, guest again, nor niced work: it yields to the rest)
    assert HostCpu(stat, cpus={0}).busy_s() == pytest.approx(5.0)
    assert HostCpu(stat, cpus={0, 1}).busy_s() == pytest.approx(105.0)


@contextlib.contextmanager
def busy_processes(count: int):
    """``count`` processes spinning on the CPU (each a core's worth), killed on the way out."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


def test_the_host_cpu_sees_a_busy_process():
    host = HostCpu()
    before, started = host.busy_s(), time.monotonic()
    with busy_processes(1):
        time.sleep(1.5)
    busy = (host.busy_s() - before) / (time.monotonic() - started)
    assert busy > 0.7, busy


def test_niced_work_is_not_busy():
    host = HostCpu()
    before, started = host.busy_s(), time.monotonic()
    niced = subprocess.Popen([sys.executable, "-c", "import os\nos.nice(19)\nwhile True: pass"])
    try:
        time.sleep(1.5)
    finally:
        niced.kill()
        niced.wait()
    busy = (host.busy_s() - before) / (time.monotonic() - started)
    assert busy < 0.5, busy


def test_bad_limits_are_refused():
    with pytest.raises(ValueError, match="--admit-cpu must be >= 0"):
        StreamOptions(admit_cpu=-0.5)


def test_a_frontend_on_busy_cores_refuses_realtime_reads_batch_at_real_time_and_recovers():
    """Every core the server may use spun by other processes: a new REALTIME session is refused with a retry
    delay, the REALTIME one already taken goes on, BATCH is served no faster than real time, GetServerInfo
    reports the cores busy; once they are free again, REALTIME is taken and BATCH read at full speed."""
    cores = len(os.sched_getaffinity(0))
    audio = bytes(3200 * 30)  # 3 s

    def batch_s() -> float:
        started = time.monotonic()
        responses = run_stream(stub, config(priority=pb.BATCH), audio)
        assert responses is not None
        return time.monotonic() - started

    with local_stub(admit_cpu=0.5) as stub:
        alone_s = batch_s()  # (and the sampling started)
        time.sleep(WINDOW_S + 0.5)
        load = stub.GetServerInfo(pb.GetServerInfoRequest()).load
        assert load.host_cpu_cores == cores and load.admit_cpu == 0.5 and load.host_cpu_busy < cores
        errors: list[Exception] = []

        def call() -> None:
            try:
                run_stream(stub, config(), bytes(3200 * 100), pace_s=0.1)  # 10 s at real time
            except Exception as err:
                errors.append(err)

        live = threading.Thread(target=call)
        live.start()
        try:
            time.sleep(0.5)
            with busy_processes(cores):
                time.sleep(WINDOW_S + 0.5)
                load = stub.GetServerInfo(pb.GetServerInfoRequest()).load
                assert load.host_cpu_busy > 0.5 * cores, load
                with pytest.raises(grpc.RpcError) as refused:
                    run_stream(stub, config(), bytes(3200))
                assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "its host's CPU" in refused.value.details() and "limit 0.5" in refused.value.details()
                assert retry_after_s(refused.value.trailing_metadata()) == RETRY_AFTER_S
                behind_s = batch_s()  # BATCH: served, at real time
        finally:
            live.join(30)
        assert not errors, errors
        deadline = time.monotonic() + 15
        while True:  # (the next windows without the busy processes take REALTIME again)
            try:
                run_stream(stub, config(), bytes(3200))
                break
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() < deadline
                time.sleep(0.5)
        again_s = batch_s()
    assert behind_s > 2.5, (alone_s, behind_s)
    assert again_s < 2.0, (alone_s, again_s)
