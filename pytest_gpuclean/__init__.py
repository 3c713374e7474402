"""pytest-gpuclean: clean GPUs and no stray processes around every GPU test."""

__version__ = "0.1.0"
