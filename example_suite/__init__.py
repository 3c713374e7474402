"""Tensor-parallel hidden-state extraction with vLLM, tested under gpuclean (docs/example_suite.md)."""
