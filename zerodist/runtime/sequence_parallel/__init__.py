"""``deepspeed.runtime.sequence_parallel``."""
