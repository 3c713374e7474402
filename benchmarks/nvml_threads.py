"""Which NVML step leaves a thread or descriptors in the process: run on a GPU machine (docs/guest.md lists
what it found among the exceptions on real GPUs)."""

import os

import pynvml


def _fds() -> list[str]:
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            found.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            continue  # (the listing's own descriptor, closed by now)
    return sorted(found)


def state(label: str) -> None:
    tasks = os.listdir("/proc/self/task")
    names = []
    for task in tasks:
        with open(f"/proc/self/task/{task}/comm") as f:
            names.append(f.read().strip())
    nvidia = [f for f in _fds() if "nvidia" in f]
    print(f"{label}: {len(tasks)} threads {sorted(names)}; {len(nvidia)} NVIDIA descriptors {nvidia}")


state("start")
pynvml.nvmlInit()
state("nvmlInit")
handle = pynvml.nvmlDeviceGetHandleByIndex(0)
pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
state("memory and processes read")
events = pynvml.nvmlEventSetCreate()
state("nvmlEventSetCreate")
pynvml.nvmlDeviceRegisterEvents(handle, pynvml.nvmlEventTypeXidCriticalError, events)
state("nvmlDeviceRegisterEvents (Xid)")
try:
    pynvml.nvmlEventSetWait_v2(events, 0)
except pynvml.NVMLError as exc:
    print("nvmlEventSetWait_v2(0):", exc)
state("nvmlEventSetWait_v2(0)")
pynvml.nvmlEventSetFree(events)
state("nvmlEventSetFree")
pynvml.nvmlShutdown()
state("nvmlShutdown")
