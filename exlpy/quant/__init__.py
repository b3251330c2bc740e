"""Quantized linears: EXL2 (spec §3.1-3.5) and GPTQ (spec §3.6), packed on the GPU, references in torch."""
