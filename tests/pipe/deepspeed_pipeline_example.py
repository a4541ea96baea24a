"""DeepSpeedExamples' training/pipeline_parallelism/train.py, written again in our own words and run
under `import zerodist as deepspeed`, launched by torchrun:

    torchrun --nproc-per-node 2 tests/pipe/deepspeed_pipeline_example.py --deepspeed_config ds.json \\
        --backend gloo -p 2 --steps 6 [--results out.json]      # -p 0: the data-parallel path

Both of the example's paths, with every `deepspeed.` name it reaches: `add_config_arguments`,
`init_distributed(dist_backend=)`, `runtime.utils.set_random_seed`, `pipe.PipelineModule`,
`utils.RepeatingLoader`, `initialize(args=, model=, model_parameters=, training_data=)` (whose
loader the data-parallel path uses and the pipeline path's `train_batch()` reads by itself),
`engine.device`, `engine.gradient_accumulation_steps()`, `engine(inputs)`, `engine.backward`,
`engine.step` and `engine.train_batch()` without an iterator.

What differs from the original, and why (docs/pipeline.md, "DeepSpeed's example", lists the
edits a user makes): the imports name zerodist; random images replace CIFAR-10 (no download; the
torchvision wheel on PyPI is CUDA-only and its ops do not load on CPU torch); a small AlexNet is
written out here (torchvision's layout: features, avgpool, flatten, classifier) without its
Dropout layers, so that the test can compare the losses with one process exactly (each stage
would draw dropout masks from its own generator); no `torch.cuda.set_device` (it fails on CPU
torch); `--results` writes every rank's losses for the test.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist

import zerodist as deepspeed
from zerodist.pipe import PipelineModule
from zerodist.utils import RepeatingLoader

IMAGES, IMAGE_SIZE, CLASSES = 128, 16, 10


class SmallAlexNet(torch.nn.Module):
    """AlexNet's shape at a fraction of its size: convolutions and pools, an adaptive average pool,
    then fully connected layers (in-place ReLUs as in torchvision's, one of them at a likely cut)."""

    def __init__(self, num_classes: int = CLASSES):
        super().__init__()
        relu = lambda: torch.nn.ReLU(inplace=True)  # noqa: E731
        self.features = torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, kernel_size=3, padding=1), relu(), torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(8, 16, kernel_size=3, padding=1), relu(), torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(16, 16, kernel_size=3, padding=1), relu())
        self.avgpool = torch.nn.AdaptiveAvgPool2d((2, 2))
        self.classifier = torch.nn.Sequential(torch.nn.Linear(64, 48), relu(), torch.nn.Linear(48, 32), relu(),
                                              torch.nn.Linear(32, num_classes))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.avgpool(self.features(images)), 1))


def random_images(seed: int = 0) -> torch.utils.data.TensorDataset:
    """What stands in for CIFAR-10: the same images and labels on every rank."""
    generator = torch.Generator().manual_seed(seed)
    return torch.utils.data.TensorDataset(torch.randn(IMAGES, 3, IMAGE_SIZE, IMAGE_SIZE, generator=generator),
                                          torch.randint(0, CLASSES, (IMAGES,), generator=generator))


def as_layers(model: SmallAlexNet) -> list:
    """The model as a flat list of layers, a plain function among them (the example's join_layers)."""
    return [*model.features, model.avgpool, lambda x: torch.flatten(x, 1), *model.classifier]


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="DeepSpeedExamples' pipeline example under zerodist")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the launcher")
    parser.add_argument("-s", "--steps", type=int, default=10, help="optimizer steps to run")
    parser.add_argument("-p", "--pipeline-parallel-size", type=int, default=2, help="0: plain data parallelism")
    parser.add_argument("--backend", type=str, default="nccl", help="torch.distributed backend")
    parser.add_argument("--seed", type=int, default=1138)
    parser.add_argument("--results", type=str, default=None, help="write every rank's losses here (JSON)")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def data_parallel(args: argparse.Namespace) -> list[float]:
    """The example's train_base: engine(inputs), backward and step on every micro-batch."""
    torch.manual_seed(args.seed)
    model = SmallAlexNet()
    engine, _, loader, _ = deepspeed.initialize(args=args, model=model, training_data=random_images(),
                                                model_parameters=[p for p in model.parameters() if p.requires_grad])
    batches = iter(RepeatingLoader(loader))
    criterion = torch.nn.CrossEntropyLoss()
    losses = []
    for micro_step in range(args.steps * engine.gradient_accumulation_steps()):
        images, labels = next(batches)
        loss = criterion(engine(images.to(engine.device)), labels.to(engine.device))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if dist.get_rank() == 0 and micro_step % engine.gradient_accumulation_steps() == 0:
            print(f"micro-step {micro_step}: loss {loss.item():.4f}")
    return losses


def pipeline(args: argparse.Namespace) -> list[float]:
    """The example's train_pipe: a PipelineModule of the model's layers, train_batch() reading the
    loader initialize() made."""
    torch.manual_seed(args.seed)
    deepspeed.runtime.utils.set_random_seed(args.seed)
    model = PipelineModule(layers=as_layers(SmallAlexNet()), loss_fn=torch.nn.CrossEntropyLoss(),
                           num_stages=args.pipeline_parallel_size, partition_method="parameters",
                           activation_checkpoint_interval=0)
    engine, _, _, _ = deepspeed.initialize(args=args, model=model, training_data=random_images(),
                                           model_parameters=[p for p in model.parameters() if p.requires_grad])
    losses = [engine.train_batch().item() for _ in range(args.steps)]
    if dist.get_rank() == 0:
        print(f"{args.steps} steps: first loss {losses[0]:.4f}, last {losses[-1]:.4f}")
    return losses


def main() -> None:
    args = parse_arguments()
    deepspeed.init_distributed(dist_backend=args.backend)
    args.local_rank = int(os.environ["LOCAL_RANK"])
    losses = data_parallel(args) if args.pipeline_parallel_size == 0 else pipeline(args)
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, losses)
    if args.results and dist.get_rank() == 0:
        with open(args.results, "w") as file:
            json.dump(everyone, file)


if __name__ == "__main__":
    main()
