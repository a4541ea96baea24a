"""Models used by the demo, the benchmarks and the tests: a small byte-level GPT and a toy MLP.

Imports only torch, the standard library and ``zerodist.utils`` (it sits beside the layers).
"""

from zerodist.models.gpt import GPT, GPT_PRESETS, Block, CausalSelfAttention, GPTConfig, MLP, gpt_config
from zerodist.models.toy import count_parameters, make_mlp

__all__ = [
    "GPT",
    "GPT_PRESETS",
    "Block",
    "CausalSelfAttention",
    "GPTConfig",
    "MLP",
    "count_parameters",
    "gpt_config",
    "make_mlp",
]
