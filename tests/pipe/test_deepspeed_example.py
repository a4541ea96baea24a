"""DeepSpeedExamples' training/pipeline_parallelism/train.py, `train_pipe`, in zerodist's names: a
vision model's layers joined into a list (a lambda among them), a PipelineModule with
CrossEntropyLoss and partition_method="parameters", `initialize(args=..., model=...,
model_parameters=..., training_data=...)`, then `engine.train_batch()` with no iterator. The
dataset is replaced by random images (no torchvision here); the model is a small AlexNet-like one."""

from __future__ import annotations

import argparse

import torch

import zerodist
from tests.harness import run_distributed
from zerodist.pipe import PipelineModule


class SmallAlexNet(torch.nn.Module):
    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.features = torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(inplace=True), torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(8, 16, 3, padding=1), torch.nn.ReLU(inplace=True), torch.nn.MaxPool2d(2))
        self.avgpool = torch.nn.AdaptiveAvgPool2d((2, 2))
        self.classifier = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(inplace=True),
                                              torch.nn.Linear(32, num_classes))


def join_layers(vision_model: SmallAlexNet) -> list:
    return [*vision_model.features, vision_model.avgpool, lambda x: torch.flatten(x, 1),
            *vision_model.classifier]


def example_body(steps: int) -> list[float]:
    torch.manual_seed(1138)
    net = PipelineModule(layers=join_layers(SmallAlexNet()), loss_fn=torch.nn.CrossEntropyLoss(),
                         num_stages=2, partition_method="parameters", activation_checkpoint_interval=0)
    g = torch.Generator().manual_seed(0)
    trainset = torch.utils.data.TensorDataset(torch.randn(64, 3, 16, 16, generator=g),
                                              torch.randint(0, 10, (64,), generator=g))
    args = argparse.Namespace(local_rank=0, deepspeed_config=None, deepspeed=True)
    config = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "steps_per_print": 10**9,
              "optimizer": {"type": "Adam", "params": {"lr": 0.001}}}
    engine, _, _, _ = zerodist.initialize(args=args, model=net, config=config,
                                          model_parameters=[p for p in net.parameters() if p.requires_grad],
                                          training_data=trainset)
    losses = [engine.train_batch().item() for _ in range(steps)]
    engine.destroy()
    return losses


def test_train_pipe_of_the_deepspeed_example_runs_and_learns():
    first, second = run_distributed(example_body, 2, 12)
    assert first == second  # the same loss on both stages
    assert sum(first[-3:]) < sum(first[:3])
