"""rollout/native/kernels: the paged runner's fused operations, in Triton (GPU) and plain torch (the reference and the CPU path)."""
