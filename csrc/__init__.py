"""CUDA sources of the kvtier client, shipped as package data (``kvtier.csrc``) and compiled at
run time through NVRTC (see client/cuda.py); ``make nvcc-check`` compiles them in CI."""
