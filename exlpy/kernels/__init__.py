"""Compute kernels. Model code calls `exlpy.kernels.ops` only; it picks Triton on CUDA and the torch
references (`exlpy.kernels.reference`) everywhere else."""
