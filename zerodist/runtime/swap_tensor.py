"""``deepspeed.runtime.swap_tensor``: the one constant scripts and tests size tensors by."""

# DeepSpeed's smallest tensor it swaps to NVMe (its MIN_AIO_BYTES): 1 MiB.
MIN_SWAPPABLE_BYTES = 1024**2

__all__ = ["MIN_SWAPPABLE_BYTES"]
