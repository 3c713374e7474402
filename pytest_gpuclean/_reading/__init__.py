"""What the machine says, unjudged: /proc, psutil, the GPUs through NVML or simulated devices."""

