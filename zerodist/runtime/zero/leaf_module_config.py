"""``deepspeed.runtime.zero.leaf_module_config``: DeepSpeed's default ZeRO-3 leaf-module classes (its MoE
blocks whose experts run data-dependently), for scripts that pass them to ``set_z3_leaf_modules``. The
config's ``zero_optimization.leaf_module`` section is not read here: zerodist's stage 3 gathers each unit
whole already (``deepspeed.utils.set_z3_leaf_modules``)."""

DEFAULT_LEAF_MODULE_CLASSES: list[str] = [
    "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
]
DEFAULT_LEAF_MODULE_NAMES: list[str] = []
DEFAULT_LEAF_MODULE_NAME_SUFFIXES: list[str] = []

__all__ = ["DEFAULT_LEAF_MODULE_CLASSES", "DEFAULT_LEAF_MODULE_NAMES", "DEFAULT_LEAF_MODULE_NAME_SUFFIXES"]
