"""trainer/kernels: the trainer's Triton kernels (GPU only; each module says which torch code it replaces)."""
