"""Per-rank memory for a model under each ZeRO stage: pure arithmetic, no torch, no processes.

[Note: memory model] Ψ parameters on N ranks; a sharded buffer holds ceil(Ψ/N) elements on
every rank (the padding of the last shard is counted). Which buffer is sharded at which stage
is the table of docs/design/zero.md ("Model state per rank"): optimizer state from stage 1,
gradients from stage 2, parameters at 3.

                      parameters   gradients   optimizer state
  mixed (bf16, fp16)  2Ψ           2Ψ          12Ψ = fp32 master 4Ψ + Adam's two states 8Ψ
  fp32                4Ψ           4Ψ           8Ψ = Adam's two states (the master weights
                                                     ARE the parameters: no extra 4Ψ)

which gives 16Ψ at stage 0 and 16Ψ/N at stage 3 in both cases; stage 1: 4Ψ + 12Ψ/N (mixed),
8Ψ + 8Ψ/N (fp32); stage 2: 2Ψ + 14Ψ/N (mixed), 4Ψ + 12Ψ/N (fp32). SGD with momentum keeps one
state (4Ψ) instead of Adam's two.

[Note: offloaded state] With `offload_optimizer: nvme` the per-element optimizer state (Adam's
8Ψ, sharded from stage 1) is on disk, in swap files, and leaves memory, and so does the fp32
master under mixed precision (4Ψ more: 12Ψ/N on disk from stage 1). With `offload_param: nvme`
too (stage 3) the parameter shard leaves memory: at fp32 it is the tensor the optimizer steps
(4Ψ/N more on disk), under mixed precision each gather reads it from the master (nothing more on
disk). What streams them costs `buffer_count` host buffers of one sub-group each: min(buffer_count,
sub-groups) x min(sub_group_size, Ψ/N) x (8 + 4 when values are held) bytes (Adam). Each step reads
and writes every sub-group file once: (8 + 4)Ψ/N bytes per rank each way (each region rounded up to
64 bytes); stage-3 gathers read 4 bytes per shard element more (docs/design/offload.md).
`cpu` changes nothing when the parameters are on the CPU: device and host are one memory.

Frozen parameters (`frozen`: Φ more parameters that no optimizer steps: a LoRA base, a reference or
teacher model) cost their element size and nothing else: no gradient, master or optimizer state.
They are whole on every rank at stages 0-2 and sharded at stage 3 (ceil(Φ/N)), as zerodist shards
them ([Note: frozen parameters at stage 3] in zerodist/zero/apply.py); `offload_param` leaves them
in memory (only the trained shards go to the swap files), and the buckets hold only trained ones.

Communication buckets (transient, an upper bound): one gradient bucket of
min(reduce_bucket_size, Ψ) elements at every stage, plus at stages 1-3 one parameter bucket of
min(allgather_bucket_size, Ψ) elements for the all-gather. Bucket sizes are element counts,
as in DeepSpeed's config (default 5e8 each: 2 GB of fp32 gradients).

Activations (when hidden, layers, seq_len and micro_batch are given) follow Korthikanti et
al. 2022, "Reducing Activation Recomputation in Large Transformer Models", eq. 2, generalised
to an activation element size of e bytes (e = 2 gives their s*b*h*(34 + 5*a*s/h)):

    per layer = s*b*h*(16e + 2) + a*s^2*b*(2e + 1)

(s sequence length, b micro-batch, h hidden, a heads; the "+2" and "+1" are 1-byte dropout
masks). With full activation checkpointing only each layer's input (s*b*h*e) is kept, plus
one layer's full activations while it is recomputed. Embeddings, logits and the loss are not
counted. Attention kernels that never materialise the s^2 scores (flash attention, and
PyTorch's `scaled_dot_product_attention` on CPU, which the benchmark GPT uses) drop the
a*s^2*b term: `flash_attention=True`.
"""

from __future__ import annotations

import dataclasses
import decimal
import re

from zerodist.utils import format_bytes
from zerodist.zero.policy import ShardingPolicy

PARAM_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
OPTIMIZER_STATES = {"adam": 2, "adamw": 2, "sgd": 1}  # fp32 states per parameter (sgd: momentum)
STAGES = (0, 1, 2, 3)
_SUFFIXES = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank for one stage. `activations` is None when the model shape was not given."""

    num_params: int
    world_size: int
    stage: int
    dtype: str
    optimizer: str
    parameters: int
    gradients: int
    optimizer_states: int
    buckets: int
    activations: int | None
    offload: str = "none"  # offload_optimizer.device
    disk: int = 0  # nvme: per-element optimizer state (and master, parameter shard) in swap files, not in memory
    swap_buffers: int = 0  # nvme: the host buffers sub-groups stream through (transient, an upper bound)
    offload_param: str = "none"  # offload_param.device
    frozen: int = 0  # Φ: parameters no optimizer steps, beside the num_params (Ψ) it does

    @property
    def model_states(self) -> int:
        """Parameters + gradients + optimizer state in memory: docs/design/zero.md's table (with nvme
        offload the optimizer's per-element state is on disk, `disk`, and only the master stays)."""
        return self.parameters + self.gradients + self.optimizer_states

    @property
    def total(self) -> int:
        """Memory (device and host: one on a CPU machine); disk not included."""
        return self.model_states + self.buckets + self.swap_buffers + (self.activations or 0)


def shard_numel(num_params: int, world_size: int) -> int:
    """Elements of one rank's shard: ceil(Ψ/N), the last shard padded."""
    return -(-num_params // world_size)


def estimate_memory(
    num_params: int,
    *,
    world_size: int,
    stage: int,
    dtype: str = "fp32",
    optimizer: str = "adam",
    hidden: int | None = None,
    layers: int | None = None,
    seq_len: int | None = None,
    micro_batch: int | None = None,
    heads: int | None = None,
    activation_checkpointing: bool = False,
    flash_attention: bool = False,
    reduce_bucket_size: float = 5e8,
    allgather_bucket_size: float = 5e8,
    offload_optimizer: str = "none",
    sub_group_size: float = 1e9,
    buffer_count: int = 4,
    offload_param: str = "none",
    frozen: int = 0,
) -> MemoryEstimate:
    """Per-rank bytes of `num_params` trained parameters, and `frozen` more that no optimizer steps,
    on `world_size` ranks at ZeRO `stage`.

    See [Note: memory model] for every formula, and [Note: offloaded state] for `offload_optimizer`.
    """
    _check(num_params, world_size, stage, dtype, optimizer)
    if not isinstance(frozen, int) or frozen < 0:
        raise ValueError(f"the frozen parameter count must be a whole number >= 0, got {frozen!r}")
    if offload_optimizer not in ("none", "cpu", "nvme") or offload_param not in ("none", "cpu", "nvme"):
        raise ValueError(f"offload_optimizer and offload_param must be none, cpu or nvme, got {offload_optimizer!r} "
                         f"and {offload_param!r}")
    if offload_param == "nvme" and stage != 3:
        offload_param = "none"  # parameters are offloaded at stage 3 only (the config refuses it elsewhere)
    if offload_param == "nvme" and offload_optimizer != "nvme":
        raise ValueError("offload_param nvme needs offload_optimizer nvme (the shards live in its swap files)")
    full, shard = num_params, shard_numel(num_params, world_size)
    element = PARAM_BYTES[dtype]
    master = 4 if element != 4 else 0  # fp32 training updates the parameters themselves
    optimizer_per_param = master + 4 * OPTIMIZER_STATES[optimizer]
    policy = ShardingPolicy.from_stage(stage)
    buckets = min(int(reduce_bucket_size), full) * element
    if policy.shard_optimizer_state:
        buckets += min(int(allgather_bucket_size), full) * element
    shape = (hidden, layers, seq_len, micro_batch)
    activations = None
    if any(v is not None for v in shape):
        activations = activation_bytes(
            hidden=hidden, layers=layers, seq_len=seq_len, micro_batch=micro_batch, heads=heads,
            dtype=dtype, checkpointing=activation_checkpointing, flash_attention=flash_attention,
        )
    stepped = shard if policy.shard_optimizer_state else full
    disk = swap_buffers = 0
    if offload_optimizer == "nvme" and stage == 0:
        offload_optimizer = "none"  # offload needs ZeRO stage 1-3 (the config refuses it at stage 0)
    values = 4 if offload_param == "nvme" or master else 0  # fp32 stepped values held in the files too
    if offload_optimizer == "nvme":
        disk = stepped * (4 * OPTIMIZER_STATES[optimizer] + values)
        optimizer_per_param = 0
        sub_group = stepped if sub_group_size <= 0 else min(int(sub_group_size), stepped)
        buffers = max(1, min(buffer_count, -(-stepped // max(1, sub_group))))  # never more than sub-groups
        swap_buffers = buffers * sub_group * (4 * OPTIMIZER_STATES[optimizer] + values)
    held_frozen = (shard_numel(frozen, world_size) if policy.shard_parameters and frozen else frozen) * element
    return MemoryEstimate(
        num_params, world_size, stage, dtype, optimizer,
        parameters=(0 if offload_param == "nvme" else (shard if policy.shard_parameters else full) * element)
        + held_frozen,
        gradients=(shard if policy.shard_gradients else full) * element,
        optimizer_states=stepped * optimizer_per_param,
        buckets=buckets,
        activations=activations,
        offload=offload_optimizer, disk=disk, swap_buffers=swap_buffers, offload_param=offload_param,
        frozen=frozen,
    )


def estimate_all_stages(num_params: int, **kwargs) -> list[MemoryEstimate]:
    """`estimate_memory` for stages 0-3 (same keyword arguments, without `stage`)."""
    return [estimate_memory(num_params, stage=stage, **kwargs) for stage in STAGES]


def activation_bytes(
    *,
    hidden: int | None,
    layers: int | None,
    seq_len: int | None,
    micro_batch: int | None,
    heads: int | None = None,
    dtype: str = "bf16",
    checkpointing: bool = False,
    flash_attention: bool = False,
) -> int:
    """Activation bytes of a transformer's layers on one rank (see [Note: memory model])."""
    given = {"hidden": hidden, "layers": layers, "seq_len": seq_len, "micro_batch": micro_batch}
    missing = [name for name, value in given.items() if value is None]
    if missing:
        raise ValueError(f"activation estimate needs hidden, layers, seq_len and micro_batch; missing {', '.join(missing)}")
    bad = [f"{name}={value}" for name, value in given.items() if not isinstance(value, int) or value < 1]
    if bad:
        raise ValueError(f"activation estimate: {', '.join(bad)} must be positive integers")
    assert hidden is not None and layers is not None and seq_len is not None and micro_batch is not None  # checked
    heads = heads if heads is not None else max(1, hidden // 64)  # head dim 64 when not given
    e, s, b, h = PARAM_BYTES[dtype], seq_len, micro_batch, hidden
    per_layer = s * b * h * (16 * e + 2) + (0 if flash_attention else heads * s * s * b * (2 * e + 1))
    if checkpointing:
        return layers * s * b * h * e + per_layer
    return layers * per_layer


def parse_count(text: str | int | float) -> int:
    """'7B' -> 7_000_000_000, '125M', '1.5T', '350k', '7e9', '1_000' (decimal suffixes K M B/G T)."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = decimal.Decimal(text)
    else:
        match = re.fullmatch(r"\s*([0-9][0-9_]*(?:\.[0-9]+)?(?:e[0-9]+)?)\s*([kmbgt]?)\s*", str(text).lower())
        if match is None:
            raise ValueError(f"cannot read {text!r} as a count: use a number with an optional K, M, B or T suffix (e.g. 7B)")
        # Decimal, so '1.1B' is 1_100_000_000 and not a float's 1_100_000_000.0000002
        value = decimal.Decimal(match.group(1).replace("_", "")) * _SUFFIXES[match.group(2)]
    if value < 1 or value != value.to_integral_value():
        raise ValueError(f"a parameter count must be a positive whole number, got {text!r}")
    return int(value)


def formula(stage: int, dtype: str, optimizer: str = "adam", offload: str = "none", offload_param: str = "none",
            frozen: bool = False) -> str:
    """The per-rank model-state formula in memory, e.g. '4Ψ + 12Ψ/N' (stage 1, mixed precision, Adam);
    with nvme offload, what is on disk after it: '4Ψ + 4Ψ/N (+ 8Ψ/N on disk)' (stage 2, fp32); with
    `frozen` parameters Φ, their term: '16Ψ/N + 2Φ/N' (stage 3, mixed)."""
    element = PARAM_BYTES[dtype]
    master = 4 if element != 4 else 0
    states = 4 * OPTIMIZER_STATES[optimizer] + (master + (4 if offload_param == "nvme" and not master else 0)
                                                 if offload == "nvme" else 0)
    optimizer_per_param = 0 if offload == "nvme" else master + states
    policy = ShardingPolicy.from_stage(stage)
    replicated = sharded = 0
    param_element = 0 if offload_param == "nvme" else element
    for per_param, is_sharded in ((param_element, policy.shard_parameters), (element, policy.shard_gradients),
                                  (optimizer_per_param, policy.shard_optimizer_state)):
        if is_sharded:
            sharded += per_param
        else:
            replicated += per_param
    parts = ([f"{replicated}Ψ"] if replicated else []) + ([f"{sharded}Ψ/N"] if sharded else [])
    if frozen:
        parts.append(f"{element}Φ{'/N' if policy.shard_parameters else ''}")
    text = " + ".join(parts) or "0"
    if offload == "nvme":
        text += f" (+ {states}Ψ{'/N' if policy.shard_optimizer_state else ''} on disk)"
    return text


def format_table(estimates: list[MemoryEstimate]) -> str:
    """A table of per-rank bytes in binary units, one row per estimate."""
    swapping = any(e.offload == "nvme" for e in estimates)
    extra = f"  {'swap bufs':>10}  {'disk':>10}" if swapping else ""
    header = (f"{'stage':>5}  {'params':>10}  {'grads':>10}  {'optimizer':>10}  {'buckets':>10}  "
              f"{'activations':>11}{extra}  {'total':>10}  model states")
    lines = [header]
    for e in estimates:
        activations = "-" if e.activations is None else format_bytes(e.activations)
        columns = f"  {format_bytes(e.swap_buffers):>10}  {format_bytes(e.disk):>10}" if swapping else ""
        lines.append(
            f"{e.stage:>5}  {format_bytes(e.parameters):>10}  {format_bytes(e.gradients):>10}  "
            f"{format_bytes(e.optimizer_states):>10}  {format_bytes(e.buckets):>10}  {activations:>11}{columns}  "
            f"{format_bytes(e.total):>10}  {formula(e.stage, e.dtype, e.optimizer, e.offload, e.offload_param, bool(e.frozen))} = "
            f"{format_bytes(e.model_states)}"
        )
    return "\n".join(lines)


def _check(num_params: int, world_size: int, stage: int, dtype: str, optimizer: str) -> None:
    if not isinstance(num_params, int) or num_params < 1:
        raise ValueError(f"num_params must be a positive integer, got {num_params!r}")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if stage not in STAGES:
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage!r}")
    if dtype not in PARAM_BYTES:
        raise ValueError(f"dtype must be one of {', '.join(PARAM_BYTES)}, got {dtype!r}")
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZER_STATES)}, got {optimizer!r}")
