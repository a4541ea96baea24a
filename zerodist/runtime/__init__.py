"""DeepSpeed's `deepspeed.runtime` names that scripts reach for, so `import zerodist as deepspeed`
runs them: `deepspeed.runtime.utils.set_random_seed` (DeepSpeedExamples' pipeline example)."""

from zerodist.runtime import utils

__all__ = ["utils"]
