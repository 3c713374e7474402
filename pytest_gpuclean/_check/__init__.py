"""The check: one check, pass after pass (observe -> decide -> act), what lasts between checks, the
reaping, and the GPUs' health."""

