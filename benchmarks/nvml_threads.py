"""Which NVML step leaves a thread (or descriptors) in the process."""
import os
import pynvml


def state(label):
    threads = sorted(open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task"))
    fds = sorted(os.readlink(f"/proc/self/fd/{f}") for f in os.listdir("/proc/self/fd"))
    print(f"{label}: {len(threads)} threads {threads}; fds {[f for f in fds if 'nvidia' in f]}")


state("start")
pynvml.nvmlInit()
state("nvmlInit")
h = pynvml.nvmlDeviceGetHandleByIndex(0)
pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
pynvml.nvmlDeviceGetComputeRunningProcesses(h)
state("memory and processes read")
es = pynvml.nvmlEventSetCreate()
state("nvmlEventSetCreate")
pynvml.nvmlDeviceRegisterEvents(h, pynvml.nvmlEventTypeXidCriticalError, es)
state("RegisterEvents Xid")
try:
    pynvml.nvmlEventSetWait_v2(es, 0)
except pynvml.NVMLError as e:
    print("wait:", e)
state("EventSetWait 0")
pynvml.nvmlEventSetFree(es)
state("EventSetFree")
pynvml.nvmlShutdown()
state("nvmlShutdown")
