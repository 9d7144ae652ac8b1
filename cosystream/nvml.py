"""Reading the GPUs through NVML (the NVIDIA driver's management library), for the GPU gauges on ``/metrics``.

Through the official bindings, ``nvidia-ml-py`` (import name ``pynvml``), an optional dependency
(``pip install 'cosystream[gpu]'``). :class:`Nvml` opens NVML once; each :meth:`Nvml.read` returns a plain
:class:`GpuReading` per device, read at that moment: ``cosystream.metrics`` calls it when ``/metrics`` is
scraped, so nothing samples in the background and the engine pays nothing.

NVML counts devices in PCI bus order, the order of ``nvidia-smi``; CUDA's ``cuda:N`` is the same device only
with ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` and no ``CUDA_VISIBLE_DEVICES`` (the UUID names a device either way).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

CLOCKS_EVENT_REASONS: dict[str, int] = {
    "gpu_idle": 0x1,
    "applications_clocks_setting": 0x2,
    "sw_power_cap": 0x4,
    "hw_slowdown": 0x8,
    "sync_boost": 0x10,
    "sw_thermal_slowdown": 0x20,
    "hw_thermal_slowdown": 0x40,
    "hw_power_brake_slowdown": 0x80,
    "display_clock_setting": 0x100,
    "board_limit": 0x200,
    "reliability": 0x400,
}
"""NVML's clocks event reasons (formerly throttle reasons) by name: the bits of
``nvmlDeviceGetCurrentClocksEventReasons``. ``gpu_idle`` and ``applications_clocks_setting`` are not
slowdowns; ``sw_power_cap``, the thermal ones and ``hw_slowdown`` are."""


class NvmlUnavailable(RuntimeError):
    """NVML cannot be read here; the message says why, in one line."""


@dataclass(frozen=True, slots=True)
class GpuReading:
    """One device at one moment. A field NVML did not give (``NOT_SUPPORTED`` on this device, no permission,
    the GPU lost) is None, and the other fields stand."""

    index: int  # NVML's (PCI bus order)
    name: str
    uuid: str
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    utilization_percent: int | None = None  # time a kernel ran, over NVML's last sample period (1/6 to 1 s)
    memory_utilization_percent: int | None = None  # time device memory was read or written, likewise
    temperature_celsius: int | None = None
    power_watts: float | None = None
    power_limit_watts: float | None = None  # the enforced limit
    clocks_event_reasons: int | None = None  # the bitmask: CLOCKS_EVENT_REASONS names its bits

    def active_clocks_events(self) -> dict[str, bool] | None:
        """Each named reason, True while it holds the clocks (None when the bitmask could not be read)."""
        if self.clocks_event_reasons is None:
            return None
        return {name: bool(self.clocks_event_reasons & bit) for name, bit in CLOCKS_EVENT_REASONS.items()}


@dataclass(frozen=True, slots=True)
class _Call:
    function: str  # pynvml's wrapper, named as the C function it calls
    fields: Callable[[Any], dict[str, Any]]  # its result -> GpuReading fields
    args: tuple = ()


NVML_TEMPERATURE_GPU = 0  # the sensor on the die


def _temperature(celsius: int) -> dict[str, Any]:
    return {"temperature_celsius": celsius}


def _clocks(reasons: int) -> dict[str, Any]:
    return {"clocks_event_reasons": reasons}


# What one reading asks NVML, per device: each read's calls newest first; a driver older than the first
# (FUNCTION_NOT_FOUND) gets the next, from then on.
_READS: dict[str, tuple[_Call, ...]] = {
    "memory": (
        _Call("nvmlDeviceGetMemoryInfo", lambda m: {"memory_used_bytes": m.used, "memory_total_bytes": m.total}),
    ),
    "utilization": (
        _Call(
            "nvmlDeviceGetUtilizationRates",
            lambda u: {"utilization_percent": u.gpu, "memory_utilization_percent": u.memory},
        ),
    ),
    "temperature": (
        _Call("nvmlDeviceGetTemperatureV", _temperature, (NVML_TEMPERATURE_GPU,)),
        _Call("nvmlDeviceGetTemperature", _temperature, (NVML_TEMPERATURE_GPU,)),
    ),
    "power": (_Call("nvmlDeviceGetPowerUsage", lambda mw: {"power_watts": mw / 1000}),),
    "power limit": (_Call("nvmlDeviceGetEnforcedPowerLimit", lambda mw: {"power_limit_watts": mw / 1000}),),
    "clocks event reasons": (
        _Call("nvmlDeviceGetCurrentClocksEventReasons", _clocks),
        _Call("nvmlDeviceGetCurrentClocksThrottleReasons", _clocks),
    ),
}


@dataclass(frozen=True, slots=True)
class _Device:
    index: int
    name: str
    uuid: str
    handle: Any


class Nvml:
    """NVML, initialized once for the life of the process. Raises :class:`NvmlUnavailable` when there is
    nothing to read: no nvidia-ml-py, no driver library (``libnvidia-ml.so.1``), ``nvmlInit`` failing, or no
    device. Reads every device once on opening, so a field a device does not give is logged at start-up
    (each field and error once, at INFO)."""

    def __init__(self) -> None:
        try:
            import pynvml
        except ImportError:
            raise NvmlUnavailable("nvidia-ml-py is not installed (pip install 'cosystream[gpu]')") from None
        self._nv = pynvml
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as err:
            if err.value == pynvml.NVML_ERROR_LIBRARY_NOT_FOUND:
                raise NvmlUnavailable("no NVIDIA driver here: libnvidia-ml.so.1 not found") from None
            raise NvmlUnavailable(f"NVML did not start: {err}") from None
        try:
            count = pynvml.nvmlDeviceGetCount()
        except pynvml.NVMLError as err:
            self.close()
            raise NvmlUnavailable(f"NVML could not count the GPUs: {err}") from None
        handles = {}
        for i in range(count):
            try:
                handles[i] = pynvml.nvmlDeviceGetHandleByIndex(i)
            except pynvml.NVMLError as err:  # (no permission for that one, say): the others stand
                log.info("GPU %d: NVML gives no handle (%s); left out", i, err)
        if not handles:
            self.close()
            raise NvmlUnavailable("NVML sees no GPU" if not count else "NVML gives no handle to any GPU")
        self.driver = self._text(pynvml.nvmlSystemGetDriverVersion)
        self.devices = tuple(
            _Device(i, self._text(pynvml.nvmlDeviceGetName, h), self._text(pynvml.nvmlDeviceGetUUID, h), h)
            for i, h in handles.items()
        )
        self._choice: dict[str, int] = {}  # per read, the index of the call this driver has
        self._logged: set[tuple[int, str, int]] = set()
        self.read()

    def _text(self, function: Callable, *args: Any) -> str:
        try:
            value = function(*args)
        except self._nv.NVMLError:
            return "unknown"
        return value.decode() if isinstance(value, bytes) else str(value)

    def describe(self) -> str:
        """One line: how many GPUs, their names, the driver."""
        names = sorted({device.name for device in self.devices})
        return f"{len(self.devices)} GPU(s) ({', '.join(names)}) through NVML, driver {self.driver}"

    def read(self) -> list[GpuReading]:
        """Every device, now."""
        readings = []
        for device in self.devices:
            fields: dict[str, Any] = {}
            for read, calls in _READS.items():
                fields |= self._ask(device, read, calls)
            readings.append(GpuReading(device.index, device.name, device.uuid, **fields))
        return readings

    def _ask(self, device: _Device, read: str, calls: tuple[_Call, ...]) -> dict[str, Any]:
        """One read's fields for ``device``, or none (logged once per device, read and error)."""
        nv = self._nv
        for i in range(self._choice.get(read, 0), len(calls)):
            call = calls[i]
            function = getattr(nv, call.function, None)  # an older nvidia-ml-py may not wrap it
            try:
                if function is None:
                    raise nv.NVMLError(nv.NVML_ERROR_FUNCTION_NOT_FOUND)
                return call.fields(function(device.handle, *call.args))
            except nv.NVMLError as err:
                if err.value == nv.NVML_ERROR_FUNCTION_NOT_FOUND and i + 1 < len(calls):
                    self._choice[read] = i + 1
                    continue
                if (device.index, read, err.value) not in self._logged:
                    self._logged.add((device.index, read, err.value))
                    log.info("GPU %d (%s): NVML gives no %s (%s); left out", device.index, device.name, read, err)
                return {}
        return {}

    def close(self) -> None:
        with contextlib.suppress(self._nv.NVMLError):
            self._nv.nvmlShutdown()
