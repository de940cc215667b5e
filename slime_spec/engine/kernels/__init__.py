"""Triton kernels for the embedded engine's CUDA decode path (SGLang's names: a low-M `gemv` for
`--bf16-gemm-backend gemv`, a `decode_attention` for `--attention-backend triton`).

A batch-1 decode step of a 0.7B model is bound by reading its weights: cuBLAS's kernels for one row reach a
fraction of the memory bandwidth on 1536-wide matrices, and SDPA needs the keys gathered out of the static
cache first. Both kernels read their operands once, in place, and run inside captured CUDA graphs. Triton is
imported lazily: the CPU path never needs it, and tests run the kernels in Triton's interpreter.
"""
