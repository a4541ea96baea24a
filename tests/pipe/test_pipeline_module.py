"""PipelineModule without processes: partitioning, LayerSpec, keys equal to nn.Sequential's."""

from __future__ import annotations

import pytest
import torch

from zerodist.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from zerodist.pipe.module import PartitionError, partition_balanced, partition_layers, partition_uniform
from zerodist.utils import RepeatingLoader

pytestmark = pytest.mark.unit


def test_partition_uniform_and_balanced():
    assert partition_uniform(8, 2) == [0, 4, 8]
    assert partition_uniform(7, 3) == [0, 3, 5, 7]
    assert partition_balanced([1, 1, 1, 1, 4], 2) == [0, 4, 5]
    assert partition_balanced([5, 1, 1, 1, 1, 1], 3) == [0, 1, 3, 6]  # 5 | 2 | 3: evenest after the bottleneck
    with pytest.raises(PartitionError, match="3 layers cannot fill 4 stages"):
        partition_balanced([1, 1, 1], 4)


def test_partition_methods_like_deepspeed():
    layers = [LayerSpec(torch.nn.Linear, 4, 4), torch.nn.ReLU(), LayerSpec(torch.nn.Linear, 4, 64),
              torch.nn.ReLU(), LayerSpec(torch.nn.Linear, 64, 4)]
    assert partition_layers(layers, 2, "uniform") == [0, 3, 5]
    assert partition_layers(layers, 2, "parameters") == [0, 3, 5]  # 20 + 320 | 260
    assert partition_layers(layers, 2, "type:relu") == [0, 2, 5]
    with pytest.raises(PartitionError, match="matches no layer"):
        partition_layers(layers, 2, "type:conv")
    with pytest.raises(PartitionError, match="unknown partition_method 'best'"):
        partition_layers(layers, 2, "best")
    with pytest.raises(PartitionError, match="2 layers cannot be cut into 3"):
        partition_layers(layers[:2], 3, "uniform")


def test_layer_spec_takes_modules_only():
    with pytest.raises(TypeError, match="LayerSpec only supports torch.nn.Module types"):
        LayerSpec(lambda: None)


def test_one_stage_module_is_sequential_with_callables_and_ties():
    torch.manual_seed(0)
    layers = [TiedLayerSpec("e", torch.nn.Linear, 4, 4), lambda x: x * 2, LayerSpec(torch.nn.Linear, 4, 4),
              TiedLayerSpec("e", torch.nn.Linear, 4, 4, forward_fn=lambda m, x: x @ m.weight)]
    module = PipelineModule(layers, num_stages=1, partition_method="uniform")
    assert list(module.state_dict()) == ["0.weight", "0.bias", "2.weight", "2.bias", "3.weight", "3.bias"]
    x = torch.randn(3, 4)
    first, middle = module._modules["0"], module._modules["2"]
    expected = middle(first(x) * 2) @ first.weight
    assert torch.equal(module(x), expected)
    assert module.tied_keys == {"e": [0]}
    with pytest.raises(ValueError, match="must provide num_stages or topology"):
        PipelineModule(layers)


def test_repeating_loader_starts_again():
    loader = RepeatingLoader([1, 2])
    assert [next(loader) for _ in range(5)] == [1, 2, 1, 2, 1]
