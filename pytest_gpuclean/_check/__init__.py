"""One check, pass after pass (observe, decide, act), the reaping, and the GPUs' health."""

