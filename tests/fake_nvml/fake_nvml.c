/* A fake NVML: a shared library that the real NVML bindings (nvidia-ml-py's pynvml) load in place of the
 * NVIDIA driver's libnvidia-ml.so.1, so the GPU gauges (cosystream/nvml.py, cosystream/metrics.py) are
 * tested on a machine without a GPU, through pynvml's own ctypes calls and struct layouts.
 *
 *   cc -shared -fPIC -o DIR/libnvidia-ml.so.1 tests/fake_nvml/fake_nvml.c
 *   LD_LIBRARY_PATH=DIR python ...      (pynvml does CDLL("libnvidia-ml.so.1"))
 *
 * Built with -DFAKE_NVML_OLD_DRIVER it lacks the calls newer drivers added (nvmlDeviceGetTemperatureV,
 * nvmlDeviceGetCurrentClocksEventReasons), as a driver before them does; the reader falls back to the older
 * ones (nvmlDeviceGetTemperature, nvmlDeviceGetCurrentClocksThrottleReasons).
 *
 * The functions, under the names pynvml resolves (nvmlInit() calls nvmlInitWithFlags, the count and handle
 * calls are the _v2 ones):
 *   nvmlInitWithFlags, nvmlShutdown, nvmlErrorString, nvmlSystemGetDriverVersion,
 *   nvmlDeviceGetCount_v2, nvmlDeviceGetHandleByIndex_v2, nvmlDeviceGetName, nvmlDeviceGetUUID,
 *   nvmlDeviceGetMemoryInfo (nvmlMemory_t: total, free, used, unsigned long long),
 *   nvmlDeviceGetUtilizationRates (nvmlUtilization_t: gpu, memory, unsigned int),
 *   nvmlDeviceGetTemperatureV (nvmlTemperature_v1_t: version, sensorType, int temperature),
 *   nvmlDeviceGetTemperature (unsigned int), nvmlDeviceGetPowerUsage (mW), nvmlDeviceGetEnforcedPowerLimit (mW),
 *   nvmlDeviceGetCurrentClocksEventReasons and nvmlDeviceGetCurrentClocksThrottleReasons (a bitmask).
 *
 * Its values come from environment variables, read at each call; device i reports each number plus i, so a
 * test can tell the devices apart. Defaults in brackets:
 *   FAKE_NVML_DEVICES           how many devices [1]
 *   FAKE_NVML_INIT_ERROR        the nvmlReturn_t nvmlInitWithFlags returns, e.g. 9 (driver not loaded) [0]
 *   FAKE_NVML_NAME              every device's name ["Fake NVML GPU"]; the UUID is GPU-fake-000i
 *   FAKE_NVML_DRIVER            the driver version ["999.1.2"]
 *   FAKE_NVML_MEMORY_TOTAL_BYTES, FAKE_NVML_MEMORY_USED_BYTES          [150000000000, 2000000000]
 *   FAKE_NVML_UTIL_GPU, FAKE_NVML_UTIL_MEMORY (percent)                [40, 20]
 *   FAKE_NVML_TEMP_C                                                   [50]
 *   FAKE_NVML_POWER_MW, FAKE_NVML_POWER_LIMIT_MW                       [150000, 700000]
 *   FAKE_NVML_CLOCKS_EVENT_REASONS (the bitmask, decimal or 0x...)     [0x4: sw_power_cap]
 *   FAKE_NVML_NOT_SUPPORTED     comma-separated function names that return NVML_ERROR_NOT_SUPPORTED (3),
 *                               e.g. nvmlDeviceGetPowerUsage,nvmlDeviceGetUtilizationRates [none]
 *   FAKE_NVML_NO_HANDLE         the index of a device nvmlDeviceGetHandleByIndex_v2 refuses with
 *                               NVML_ERROR_NO_PERMISSION (4), as for a device the process may not open [none]
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int nvmlReturn_t;
enum { NVML_SUCCESS = 0, NVML_ERROR_UNINITIALIZED = 1, NVML_ERROR_INVALID_ARGUMENT = 2,
       NVML_ERROR_NOT_SUPPORTED = 3, NVML_ERROR_NO_PERMISSION = 4 };

#define MAX_DEVICES 64
struct nvmlDevice_st { unsigned int index; };
typedef struct nvmlDevice_st *nvmlDevice_t;
static struct nvmlDevice_st devices[MAX_DEVICES];
static int initialized;

typedef struct { unsigned long long total, free, used; } nvmlMemory_t;
typedef struct { unsigned int gpu, memory; } nvmlUtilization_t;
typedef struct { unsigned int version; unsigned int sensorType; int temperature; } nvmlTemperature_v1_t;

static unsigned long long number(const char *name, unsigned long long fallback) {
    const char *text = getenv(name);
    return text && *text ? strtoull(text, NULL, 0) : fallback;
}

static const char *text(const char *name, const char *fallback) {
    const char *value = getenv(name);
    return value && *value ? value : fallback;
}

static unsigned int device_count(void) {
    unsigned long long n = number("FAKE_NVML_DEVICES", 1);
    return n > MAX_DEVICES ? MAX_DEVICES : (unsigned int)n;
}

/* NVML_SUCCESS, or why `function` cannot answer for `device` now. */
static nvmlReturn_t check(const char *function, nvmlDevice_t device, const void *out) {
    if (!initialized) return NVML_ERROR_UNINITIALIZED;
    if (!device || device < devices || device >= devices + device_count() || !out)
        return NVML_ERROR_INVALID_ARGUMENT;
    const char *listed = getenv("FAKE_NVML_NOT_SUPPORTED");
    size_t length = strlen(function);
    for (const char *at = listed; at && (at = strstr(at, function)); at += length) {
        int starts = at == listed || at[-1] == ',';
        int ends = at[length] == '\0' || at[length] == ',';
        if (starts && ends) return NVML_ERROR_NOT_SUPPORTED;
    }
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    nvmlReturn_t error = (nvmlReturn_t)number("FAKE_NVML_INIT_ERROR", 0);
    if (error) return error;
    for (unsigned int i = 0; i < MAX_DEVICES; i++) devices[i].index = i;
    initialized = 1;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlShutdown(void) {
    if (!initialized) return NVML_ERROR_UNINITIALIZED;
    initialized = 0;
    return NVML_SUCCESS;
}

const char *nvmlErrorString(nvmlReturn_t result) {
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NO_PERMISSION: return "Insufficient Permissions";
    default: return "Unknown Error (fake NVML)";
    }
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    if (!initialized) return NVML_ERROR_UNINITIALIZED;
    snprintf(version, length, "%s", text("FAKE_NVML_DRIVER", "999.1.2"));
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
    if (!initialized) return NVML_ERROR_UNINITIALIZED;
    *count = device_count();
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    if (!initialized) return NVML_ERROR_UNINITIALIZED;
    if (index >= device_count() || !device) return NVML_ERROR_INVALID_ARGUMENT;
    const char *refused = getenv("FAKE_NVML_NO_HANDLE");
    if (refused && *refused && strtoull(refused, NULL, 0) == index) return NVML_ERROR_NO_PERMISSION;
    *device = &devices[index];
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length) {
    nvmlReturn_t ret = check("nvmlDeviceGetName", device, name);
    if (ret == NVML_SUCCESS) snprintf(name, length, "%s", text("FAKE_NVML_NAME", "Fake NVML GPU"));
    return ret;
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length) {
    nvmlReturn_t ret = check("nvmlDeviceGetUUID", device, uuid);
    if (ret == NVML_SUCCESS) snprintf(uuid, length, "GPU-fake-%04u", device->index);
    return ret;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory) {
    nvmlReturn_t ret = check("nvmlDeviceGetMemoryInfo", device, memory);
    if (ret != NVML_SUCCESS) return ret;
    memory->total = number("FAKE_NVML_MEMORY_TOTAL_BYTES", 150000000000ULL) + device->index;
    memory->used = number("FAKE_NVML_MEMORY_USED_BYTES", 2000000000ULL) + device->index;
    memory->free = memory->total - memory->used;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device, nvmlUtilization_t *utilization) {
    nvmlReturn_t ret = check("nvmlDeviceGetUtilizationRates", device, utilization);
    if (ret != NVML_SUCCESS) return ret;
    utilization->gpu = (unsigned int)number("FAKE_NVML_UTIL_GPU", 40) + device->index;
    utilization->memory = (unsigned int)number("FAKE_NVML_UTIL_MEMORY", 20) + device->index;
    return NVML_SUCCESS;
}

static unsigned int temperature_c(nvmlDevice_t device) {
    return (unsigned int)number("FAKE_NVML_TEMP_C", 50) + device->index;
}

nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t device, unsigned int sensor, unsigned int *temperature) {
    nvmlReturn_t ret = check("nvmlDeviceGetTemperature", device, temperature);
    if (ret != NVML_SUCCESS) return ret;
    if (sensor != 0) return NVML_ERROR_INVALID_ARGUMENT; /* only NVML_TEMPERATURE_GPU */
    *temperature = temperature_c(device);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t device, unsigned int *power_mw) {
    nvmlReturn_t ret = check("nvmlDeviceGetPowerUsage", device, power_mw);
    if (ret == NVML_SUCCESS) *power_mw = (unsigned int)number("FAKE_NVML_POWER_MW", 150000) + device->index;
    return ret;
}

nvmlReturn_t nvmlDeviceGetEnforcedPowerLimit(nvmlDevice_t device, unsigned int *limit_mw) {
    nvmlReturn_t ret = check("nvmlDeviceGetEnforcedPowerLimit", device, limit_mw);
    if (ret == NVML_SUCCESS) *limit_mw = (unsigned int)number("FAKE_NVML_POWER_LIMIT_MW", 700000) + device->index;
    return ret;
}

static unsigned long long clocks_event_reasons(nvmlDevice_t device) {
    return number("FAKE_NVML_CLOCKS_EVENT_REASONS", 0x4) + device->index;
}

nvmlReturn_t nvmlDeviceGetCurrentClocksThrottleReasons(nvmlDevice_t device, unsigned long long *reasons) {
    nvmlReturn_t ret = check("nvmlDeviceGetCurrentClocksThrottleReasons", device, reasons);
    if (ret == NVML_SUCCESS) *reasons = clocks_event_reasons(device);
    return ret;
}

#ifndef FAKE_NVML_OLD_DRIVER
nvmlReturn_t nvmlDeviceGetTemperatureV(nvmlDevice_t device, nvmlTemperature_v1_t *temperature) {
    nvmlReturn_t ret = check("nvmlDeviceGetTemperatureV", device, temperature);
    if (ret != NVML_SUCCESS) return ret;
    if (temperature->version != 0x100000C || temperature->sensorType != 0) return NVML_ERROR_INVALID_ARGUMENT;
    temperature->temperature = (int)temperature_c(device);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetCurrentClocksEventReasons(nvmlDevice_t device, unsigned long long *reasons) {
    nvmlReturn_t ret = check("nvmlDeviceGetCurrentClocksEventReasons", device, reasons);
    if (ret == NVML_SUCCESS) *reasons = clocks_event_reasons(device);
    return ret;
}
#endif
