"""The GPU gauges on /metrics (``cosystream/nvml.py``, ``cosystream.metrics.GpuCollector``) on a machine
without a GPU: the real NVML bindings (nvidia-ml-py's pynvml) load a fake NVML, ``tests/fake_nvml/fake_nvml.c``
compiled here as ``libnvidia-ml.so.1``, found through ``LD_LIBRARY_PATH``. Each reading runs in a subprocess:
the dynamic loader reads ``LD_LIBRARY_PATH`` when a process starts, and pynvml loads the library once."""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from benchmarks._harness import free_port, gpu_gauges
from cosystream.metrics import GpuCollector
from cosystream.nvml import CLOCKS_EVENT_REASONS, GpuReading
from cosystream.v1 import cosystream_pb2 as pb
from tests.servers import Served

ROOT = Path(__file__).resolve().parent.parent
FAKE_SOURCE = ROOT / "tests" / "fake_nvml" / "fake_nvml.c"

# What the fake is told to report (device i: each number plus i, the fake's rule).
FAKE = {
    "devices": 2,
    "name": "NVIDIA H200",
    "driver": "570.86.15",
    "memory_total_bytes": 150_000_000_000,
    "memory_used_bytes": 12_345_678_901,
    "util_gpu": 73,
    "util_memory": 31,
    "temp_c": 64,
    "power_mw": 251_500,
    "power_limit_mw": 700_000,
    "clocks_event_reasons": CLOCKS_EVENT_REASONS["sw_power_cap"] | CLOCKS_EVENT_REASONS["sw_thermal_slowdown"],
}


def expected(index: int, **dropped: None) -> dict:
    """The reading of device ``index`` the fake's FAKE values make, less the ``dropped`` fields."""
    reading = {
        "index": index,
        "name": FAKE["name"],
        "uuid": f"GPU-fake-{index:04d}",
        "memory_used_bytes": FAKE["memory_used_bytes"] + index,
        "memory_total_bytes": FAKE["memory_total_bytes"] + index,
        "utilization_percent": FAKE["util_gpu"] + index,
        "memory_utilization_percent": FAKE["util_memory"] + index,
        "temperature_celsius": FAKE["temp_c"] + index,
        "power_watts": (FAKE["power_mw"] + index) / 1000,
        "power_limit_watts": (FAKE["power_limit_mw"] + index) / 1000,
        "clocks_event_reasons": FAKE["clocks_event_reasons"] + index,
    }
    return reading | dropped


GAUGED = (  # the fields with a gauge each (power_limit_watts: left out below)
    "memory_used_bytes",
    "memory_total_bytes",
    "utilization_percent",
    "memory_utilization_percent",
    "temperature_celsius",
    "power_watts",
)


def compile_fake(directory: Path, *flags: str) -> Path:
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("needs a C compiler (cc) to build the fake NVML")
    subprocess.run(
        [
            compiler,
            "-shared",
            "-fPIC",
            "-O1",
            *flags,
            "-o",
            str(directory / "libnvidia-ml.so.1"),
            str(FAKE_SOURCE),
        ],
        check=True,
        timeout=60,
    )
    return directory


@pytest.fixture(scope="module")
def fake_nvml(tmp_path_factory) -> Path:
    """The folder holding the fake ``libnvidia-ml.so.1``."""
    pytest.importorskip("pynvml", reason="needs nvidia-ml-py (the gpu extra)")
    return compile_fake(tmp_path_factory.mktemp("fake-nvml"))


@pytest.fixture(scope="module")
def old_driver_nvml(tmp_path_factory) -> Path:
    """The fake as a driver from before nvmlDeviceGetTemperatureV and ...GetCurrentClocksEventReasons."""
    pytest.importorskip("pynvml", reason="needs nvidia-ml-py (the gpu extra)")
    return compile_fake(tmp_path_factory.mktemp("fake-nvml-old"), "-DFAKE_NVML_OLD_DRIVER")


def system_has_nvml() -> bool:
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False
    return True


def fake_env(library: Path | None, **fake) -> dict[str, str]:
    """This environment with the fake's settings (FAKE and ``fake``) and ``library`` first on the loader's path
    (None: the path as it is, where a container may name the driver's folder)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FAKE_NVML_")}
    if library is not None:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(library), env.get("LD_LIBRARY_PATH")]))
    env |= {f"FAKE_NVML_{key.upper()}": str(value) for key, value in (FAKE | fake).items()}
    return env


READ = """
import dataclasses, json, logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(message)s")
from cosystream.nvml import Nvml, NvmlUnavailable
try:
    nvml = Nvml()
except NvmlUnavailable as err:
    print(json.dumps({"unavailable": str(err)}))
else:
    print(json.dumps({"describe": nvml.describe(), "readings": [dataclasses.asdict(r) for r in nvml.read()]}))
    nvml.close()
"""


def read_nvml(library: Path | None, prelude: str = "", **fake) -> tuple[dict, str]:
    """Open NVML and read it once more in a fresh process: its JSON and its log."""
    done = subprocess.run(
        [sys.executable, "-c", prelude + READ],
        env=fake_env(library, **fake),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout), done.stderr


def test_the_reader_reads_what_nvml_says(fake_nvml):
    result, log = read_nvml(fake_nvml)
    assert result["readings"] == [expected(0), expected(1)]
    assert result["describe"] == "2 GPU(s) (NVIDIA H200) through NVML, driver 570.86.15"
    assert "left out" not in log


def test_a_field_nvml_does_not_support_is_left_out_and_the_rest_stands(fake_nvml):
    result, log = read_nvml(
        fake_nvml, not_supported="nvmlDeviceGetPowerUsage,nvmlDeviceGetCurrentClocksEventReasons"
    )
    # NOT_SUPPORTED is the device's answer, not a missing function: no fallback to the throttle-reasons call.
    assert result["readings"] == [expected(i, power_watts=None, clocks_event_reasons=None) for i in (0, 1)]
    # Said once per device and field at opening, not again at the next reading.
    for index in (0, 1):
        assert log.count(f"GPU {index} (NVIDIA H200): NVML gives no power (Not Supported); left out") == 1
        assert log.count(f"GPU {index} (NVIDIA H200): NVML gives no clocks event reasons (Not Supported)") == 1


def test_a_device_nvml_gives_no_handle_for_is_left_out_and_the_others_stand(fake_nvml):
    result, log = read_nvml(fake_nvml, no_handle=0)
    assert result["readings"] == [expected(1)]
    assert "GPU 0: NVML gives no handle (Insufficient Permissions); left out" in log
    assert read_nvml(fake_nvml, no_handle=0, devices=1)[0] == {"unavailable": "NVML gives no handle to any GPU"}


def test_an_older_driver_is_read_through_the_older_calls(old_driver_nvml):
    result, log = read_nvml(old_driver_nvml)
    assert result["readings"] == [expected(0), expected(1)]
    assert "left out" not in log


@pytest.mark.gpu
def test_a_real_gpu_is_read():
    """The driver's own NVML (benchmarks/gpu_check.sh runs this on the GPU machine)."""
    pytest.importorskip("pynvml", reason="needs nvidia-ml-py (the gpu extra)")
    if not system_has_nvml():
        pytest.skip("needs NVML (an NVIDIA driver: libnvidia-ml.so.1)")
    result, _ = read_nvml(None)
    assert "readings" in result, result
    for reading in result["readings"]:
        assert reading["name"] and reading["uuid"], reading
        assert 0 < reading["memory_used_bytes"] <= reading["memory_total_bytes"], reading
        for field in ("utilization_percent", "memory_utilization_percent"):
            assert reading[field] is None or 0 <= reading[field] <= 100, reading
        assert reading["temperature_celsius"] is None or 0 < reading["temperature_celsius"] < 120, reading
        assert reading["power_watts"] is None or 0 < reading["power_watts"] < 2000, reading


@pytest.mark.parametrize(
    ("case", "fake", "why"),
    [
        ("no nvidia-ml-py", {}, "nvidia-ml-py is not installed (pip install 'cosystream[gpu]')"),
        ("no driver library", {}, "no NVIDIA driver here: libnvidia-ml.so.1 not found"),
        ("nvmlInit fails", {"init_error": 9}, "NVML did not start: Driver Not Loaded"),
        ("no device", {"devices": 0}, "NVML sees no GPU"),
    ],
)
def test_nothing_to_read_says_why(request, case, fake, why):
    prelude, library = "", None
    if case == "no nvidia-ml-py":
        prelude = "import sys; sys.modules['pynvml'] = None\n"  # import pynvml raises ImportError
    elif case == "no driver library":
        pytest.importorskip("pynvml", reason="needs nvidia-ml-py (the gpu extra)")
        if system_has_nvml():
            pytest.skip("this machine has NVML (libnvidia-ml.so.1)")
    else:
        library = request.getfixturevalue("fake_nvml")
    result, _ = read_nvml(library, prelude, **fake)
    assert result == {"unavailable": why}


class _Readings:
    def __init__(self, readings: list[GpuReading]):
        self.readings = readings

    def read(self) -> list[GpuReading]:
        if isinstance(self.readings, Exception):
            raise self.readings
        return self.readings


def test_the_collector_leaves_out_what_it_cannot_read_and_never_fails_the_scrape():
    from prometheus_client import CollectorRegistry, Gauge, generate_latest

    registry = CollectorRegistry()
    Gauge("cosystream_test_other", "Another metric.", registry=registry).set(1)
    nvml = _Readings([GpuReading(0, "NVIDIA H200", "GPU-x", memory_used_bytes=5, clocks_event_reasons=0x4)])
    registry.register(GpuCollector(nvml))
    text = generate_latest(registry).decode()
    assert 'cosystream_gpu_memory_used_bytes{gpu="0",name="NVIDIA H200",uuid="GPU-x"} 5.0' in text
    assert (
        'cosystream_gpu_clocks_event_reason{gpu="0",name="NVIDIA H200",reason="sw_power_cap",uuid="GPU-x"} 1.0'
        in text
    )
    assert 'reason="gpu_idle",uuid="GPU-x"} 0.0' in text
    assert "cosystream_gpu_power_watts" not in text  # not even its HELP line
    nvml.readings = RuntimeError("the GPU fell off the bus")
    text = generate_latest(registry).decode()
    assert "cosystream_gpu_" not in text
    assert "cosystream_test_other 1.0" in text


SERVE_METRICS = """
import os, sys, urllib.request
from cosystream.metrics import serve_metrics
port = int(sys.argv[1])
serve_metrics(port, "127.0.0.1", gpu_gauges=sys.argv[2] == "on")
print(urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode())
"""


@pytest.mark.parametrize("gauges", ["on", "off"])
def test_serve_metrics_with_and_without_the_gpu_gauges(fake_nvml, tmp_path, gauges):
    """The supervisor's endpoint (multiprocess mode, as serve runs it); off is ``serve --no-gpu-gauges``."""
    env = fake_env(fake_nvml) | {"PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", SERVE_METRICS, str(free_port()), gauges],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    if gauges == "on":
        assert (
            'cosystream_gpu_temperature_celsius{gpu="1",name="NVIDIA H200",uuid="GPU-fake-0001"} 65.0'
            in done.stdout
        )
    else:
        assert "cosystream_gpu_" not in done.stdout


def test_serve_shows_the_gpu_gauges(fake_nvml, monkeypatch):
    """``cosystream serve`` (a CPU engine) on a machine whose NVML is the fake: /metrics has each GPU's gauges,
    the field the fake does not support left out."""
    for key, value in fake_env(fake_nvml, not_supported="nvmlDeviceGetEnforcedPowerLimit").items():
        monkeypatch.setenv(key, value)
    with Served("--frontends", "1", "--max-sessions", "4", "--device", "cpu") as served:
        for index in (0, 1):
            want = expected(index)
            gpu = {"gpu": str(index), "uuid": want["uuid"]}  # (and name: Served.metric's own first argument)
            assert served.metric("cosystream_gpu_memory_used_bytes", **gpu) == want["memory_used_bytes"]
            assert served.metric("cosystream_gpu_memory_total_bytes", **gpu) == want["memory_total_bytes"]
            assert served.metric("cosystream_gpu_utilization_percent", **gpu) == want["utilization_percent"]
            assert (
                served.metric("cosystream_gpu_memory_utilization_percent", **gpu)
                == want["memory_utilization_percent"]
            )
            assert served.metric("cosystream_gpu_temperature_celsius", **gpu) == want["temperature_celsius"]
            assert served.metric("cosystream_gpu_power_watts", **gpu) == pytest.approx(want["power_watts"])
            for reason, bit in CLOCKS_EVENT_REASONS.items():
                active = bool(want["clocks_event_reasons"] & bit)
                assert served.metric("cosystream_gpu_clocks_event_reason", **gpu, reason=reason) == active, reason
        text = urllib.request.urlopen(served.metrics_url, timeout=10).read().decode()
        assert 'cosystream_gpu_temperature_celsius{gpu="0",name="NVIDIA H200",uuid="GPU-fake-0000"} 64.0' in text
        assert "cosystream_gpu_power_limit_watts" not in text
        assert "cosystream_active_sessions" in text
        want = expected(1)
        assert gpu_gauges(served.metrics_url)["1"] == {  # what benchmarks/gpu_check.sh records
            "name": "NVIDIA H200",
            **{k: want[k] for k in GAUGED},
            "clocks_events": [r for r, bit in CLOCKS_EVENT_REASONS.items() if want["clocks_event_reasons"] & bit],
        }
        log = "".join(served.log)
        assert "GPU gauges on /metrics: 2 GPU(s) (NVIDIA H200) through NVML, driver 570.86.15" in log
        assert "GPU 0 (NVIDIA H200): NVML gives no power limit (Not Supported); left out" in log


def test_serve_without_nvml_has_no_gpu_series_and_serves():
    """A plain CPU machine: no GPU series at all, one line saying why, and serving as ever."""
    if system_has_nvml():
        pytest.skip("this machine has NVML (libnvidia-ml.so.1)")
    with Served("--frontends", "1", "--max-sessions", "4") as served:
        text = urllib.request.urlopen(served.metrics_url, timeout=10).read().decode()
        assert "cosystream_gpu_" not in text
        assert "cosystream_active_sessions" in text
        config = pb.StreamingRecognizeRequest(
            config=pb.StreamingConfig(encoding=pb.LINEAR16, sample_rate_hz=16000)
        )
        audio = pb.StreamingRecognizeRequest(audio=b"\0" * 16000)  # 0.5 s of silence
        list(served.stub().StreamingRecognize(iter([config, audio]), timeout=30))
        log = "".join(served.log)
        assert log.count("GPU gauges: none on /metrics (") == 1, log
