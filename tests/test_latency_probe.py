"""The latency probe against a live server (``cosystream serve`` in a subprocess), for a few seconds."""

from __future__ import annotations

import json
import math
import subprocess

import pytest

from benchmarks._harness import ROOT, Server, probe_command
from tests.speech import needs_espeak

pytestmark = needs_espeak

METRICS = ("first_packet_ms", "first_result_ms", "chunk_latency_ms", "final_latency_ms")


def run_probe(server: Server, tmp_path, *args: str) -> tuple[dict, str]:
    out = tmp_path / "probe.json"
    completed = subprocess.run(
        probe_command(server, str(out), *args), capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert completed.returncode == 0, completed.stderr
    return json.loads(out.read_text()), completed.stdout


def check_schema(result: dict, realtime: int, batch: int) -> None:
    assert set(result) == {"classes", "config"}
    for name, sessions in (("realtime", realtime), ("batch", batch)):
        entry = result["classes"][name]
        assert entry["sessions"] == sessions
        assert isinstance(entry["deadline_misses"], int) and isinstance(entry["errors"], int)
        for metric in METRICS:
            stats = entry[metric]
            assert set(stats) == {"p50", "p90", "p95", "p99", "max"}
            values = [stats[k] for k in ("p50", "p90", "p95", "p99", "max")]
            if sessions and metric != "first_result_ms":
                assert all(v is not None and math.isfinite(v) and v >= 0 for v in values), (name, metric, stats)
            present = [v for v in values if v is not None]
            assert present == sorted(present), f"{name} {metric} percentiles out of order: {stats}"


def test_probe_reports_both_classes(tmp_path):
    with Server("--max-sessions", "16", "--frontends", "1", "--final-model", "off") as server:
        result, stdout = run_probe(server, tmp_path, "--realtime", "4", "--batch", "1", "--duration", "4")
    check_schema(result, realtime=4, batch=1)
    realtime, batch = result["classes"]["realtime"], result["classes"]["batch"]
    assert realtime["errors"] == 0 and batch["errors"] == 0
    interims, chunks = realtime["interim_latency_ms"], realtime["chunk_latency_ms"]
    assert interims["p50"] is not None and interims["max"] <= chunks["max"]  # (interims are some of the results)
    # None on a quiet machine; a loaded one (other jobs on the 2 cores) misses a handful, where REALTIME
    # stepped behind BATCH work would miss far more (test_overloaded_run_shows_deadline_misses: 4-7%).
    realtime_frames = 4 * 4 * 100
    assert realtime["deadline_misses"] <= 0.02 * realtime_frames, realtime["deadline_misses"]
    assert batch["realtime_factor"] > 1.5, "BATCH sessions send faster than real time"
    last = stdout.strip().splitlines()[-1]
    assert last.startswith("realtime=4 ") and "batch=1" in last


def test_more_probe_processes_than_sessions(tmp_path):
    # The capacity benchmark's warm-up asks for 4 streams from as many processes as its largest count
    # needs (6 on a 16-core GPU machine): the processes without a session are not started.
    with Server("--max-sessions", "8", "--frontends", "1", "--final-model", "off") as server:
        result, _ = run_probe(server, tmp_path, "--realtime", "2", "--processes", "3", "--duration", "1")
    check_schema(result, realtime=2, batch=0)
    assert result["classes"]["realtime"]["errors"] == 0


def test_overloaded_run_shows_deadline_misses(tmp_path):
    # A deadline far below what one step costs: a frame that arrives while a step runs waits for it and
    # misses. One that arrives at an idle engine may still make it, so how many miss depends on the
    # machine's timing (99-163 of at most 2,400 frames in runs on a 2-core machine); the default deadline
    # shows none (test_probe_reports_both_classes).
    with Server(
        "--max-sessions", "16", "--deadline-ms", "0.2", "--batch-window-ms", "0", "--final-model", "off"
    ) as server:
        result, _ = run_probe(server, tmp_path, "--realtime", "8", "--duration", "3")
    check_schema(result, realtime=8, batch=0)
    assert result["classes"]["realtime"]["deadline_misses"] >= 10


def test_compare_prints_both_runs(tmp_path):
    with Server("--max-sessions", "8", "--final-model", "off") as server:
        first, _ = run_probe(server, tmp_path, "--realtime", "2", "--duration", "2")
        (tmp_path / "first.json").write_text(json.dumps(first))
        _, stdout = run_probe(
            server, tmp_path, "--realtime", "2", "--duration", "2", "--compare", str(tmp_path / "first.json")
        )
    header = stdout.splitlines()[0]
    assert "other p50" in header and "other p99" in header


@pytest.mark.parametrize("flag", ["--plot"])
def test_plot_writes_a_png(tmp_path, flag):
    pytest.importorskip("matplotlib")
    with Server("--max-sessions", "8", "--final-model", "off") as server:
        run_probe(server, tmp_path, "--realtime", "2", "--duration", "2", flag, str(tmp_path / "cdf.png"))
    assert (tmp_path / "cdf.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_finalize_after_each_sentence_times_its_final(tmp_path):
    """``--finalize-after-ms 100``: each sentence is ended by FINALIZE 100 ms after it, well before the
    endpointer's 500 ms of silence would end it, so every final comes sooner than that silence."""
    from cosystream.audio.endpointing import EndpointingConfig

    with Server("--max-sessions", "8", "--frontends", "1", "--final-model", "off") as server:
        result, _ = run_probe(server, tmp_path, "--realtime", "2", "--duration", "8", "--finalize-after-ms", "100")
    realtime = result["classes"]["realtime"]
    assert realtime["errors"] == 0
    finalize, final = realtime["finalize_ms"], realtime["final_latency_ms"]
    assert finalize["p50"] is not None and 0 < finalize["p50"] <= finalize["max"], finalize
    assert final["max"] < EndpointingConfig().silence_ms, (final, finalize)


def test_realtime_streams_arrive_over_the_ramp_not_all_at_once(tmp_path):
    """Four calls a second apart, each half a second long, on a server with two slots: a call opens its session
    when its audio starts, so never more than one is open and none is refused (opened all at once, waiting for
    their audio, two of the four were refused RESOURCE_EXHAUSTED)."""
    with Server("--max-sessions", "2", "--frontends", "1", "--final-model", "off") as server:
        result, _ = run_probe(server, tmp_path, "--realtime", "4", "--ramp-s", "4", "--duration", "0.5")
    realtime = result["classes"]["realtime"]
    assert realtime["sessions"] == 4 and realtime["errors"] == 0, realtime
