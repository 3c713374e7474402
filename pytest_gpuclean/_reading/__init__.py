"""Reading: what the machine says, unjudged (/proc, psutil, the GPUs through NVML or simulated
devices, their health)."""

__all__: list[str] = []
