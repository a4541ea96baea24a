"""``deepspeed.runtime.pipe.module``: zerodist's ``PipelineModule``, ``LayerSpec`` and ``TiedLayerSpec``
(docs/pipeline.md) under DeepSpeed's module path."""

from zerodist.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from zerodist.pipe.module import PartitionError
from zerodist.runtime.pipe.topology import PipeDataParallelTopology, PipeModelDataParallelTopology

__all__ = ["LayerSpec", "PartitionError", "PipeDataParallelTopology", "PipeModelDataParallelTopology",
           "PipelineModule", "TiedLayerSpec"]
