"""``deepspeed.runtime.pipe``: DeepSpeed's pipeline module, topology and schedule paths under zerodist."""

from zerodist.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from zerodist.runtime.pipe.topology import ProcessTopology

__all__ = ["LayerSpec", "PipelineModule", "ProcessTopology", "TiedLayerSpec"]
