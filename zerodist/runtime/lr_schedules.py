"""``deepspeed.runtime.lr_schedules``: DeepSpeed's schedule names (accelerate checks a scheduler's
class name against ``VALID_LR_SCHEDULES``) and zerodist's schedules of those names."""

from zerodist.engine.schedulers import OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR

LR_RANGE_TEST = "LRRangeTest"
ONE_CYCLE = "OneCycle"
WARMUP_LR = "WarmupLR"
WARMUP_DECAY_LR = "WarmupDecayLR"
WARMUP_COSINE_LR = "WarmupCosineLR"
VALID_LR_SCHEDULES = [LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR]

__all__ = ["VALID_LR_SCHEDULES", "OneCycle", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR"]
