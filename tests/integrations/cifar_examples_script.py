"""DeepSpeedExamples' training/cifar/cifar10_deepspeed.py, cut to what it asks of DeepSpeed's surface.

Two kinds of lines differ from the original: `import deepspeed` / `from deepspeed.accelerator import
get_accelerator` name zerodist, and the dataset is a seeded stand-in for CIFAR-10 (no download).
Everything the script does with DeepSpeed is kept: `add_config_arguments`, `init_distributed()`,
`deepspeed.moe.layer.MoE` reached without importing `deepspeed.moe` first, the MoE parameter groups,
`initialize(args=..., model_parameters=..., training_data=...)`, `get_accelerator().device_name(local_rank)`
for the inputs' device, and the bf16/fp16 casts of its inputs. Rank 0 writes its losses as JSON.
"""

import argparse
import json

import torch
import torch.nn as nn
import torch.nn.functional as F

import zerodist as deepspeed  # was: import deepspeed
from zerodist.accelerator import get_accelerator  # was: from deepspeed.accelerator import get_accelerator


def add_argument():
    parser = argparse.ArgumentParser(description="CIFAR")
    parser.add_argument("--epochs", default=1, type=int)
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--moe", default=False, action="store_true")
    parser.add_argument("--ep-world-size", default=1, type=int)
    parser.add_argument("--num-experts", type=int, nargs="+", default=[1])
    parser.add_argument("--top-k", default=1, type=int)
    parser.add_argument("--min-capacity", default=0, type=int)
    parser.add_argument("--moe-param-group", default=False, action="store_true")
    parser.add_argument("--stage", default=0, type=int)
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    parser.add_argument("--results", default=None)
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def cifar_stand_in(samples=64):  # was: torchvision.datasets.CIFAR10(root="./data", ...)
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(samples, 3, 32, 32, generator=generator)
    labels = torch.randint(0, 10, (samples,), generator=generator)
    return torch.utils.data.TensorDataset(images, labels)


class Net(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.moe = args.moe
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        if args.moe:
            fc3 = nn.Linear(84, 84)
            self.moe_layer_list = nn.ModuleList([
                deepspeed.moe.layer.MoE(hidden_size=84, expert=fc3, num_experts=n_e, ep_size=args.ep_world_size,
                                        k=args.top_k, min_capacity=args.min_capacity)
                for n_e in args.num_experts])
            self.fc4 = nn.Linear(84, 10)
        else:
            self.fc3 = nn.Linear(84, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        if self.moe:
            for layer in self.moe_layer_list:
                x, _, _ = layer(x)
            return self.fc4(x)
        return self.fc3(x)


def main():
    args = add_argument()
    deepspeed.init_distributed()
    torch.manual_seed(0)
    net = Net(args)
    parameters = filter(lambda p: p.requires_grad, net.parameters())
    if args.moe_param_group:
        from zerodist.moe.utils import split_params_into_different_moe_groups_for_optimizer

        parameters = split_params_into_different_moe_groups_for_optimizer(
            {"params": list(net.parameters()), "name": "parameters"})
    ds_config = {"train_batch_size": 16, "steps_per_print": 2000, "gradient_clipping": 1.0,
                 "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8,
                                                          "weight_decay": 3e-7}},
                 "bf16": {"enabled": args.dtype == "bf16"}, "fp16": {"enabled": args.dtype == "fp16"},
                 "zero_optimization": {"stage": args.stage, "stage3_param_persistence_threshold": 0}}
    model_engine, optimizer, trainloader, _ = deepspeed.initialize(
        args=args, model=net, model_parameters=parameters, training_data=cifar_stand_in(), config=ds_config)
    local_device = get_accelerator().device_name(model_engine.local_rank)
    local_rank = model_engine.local_rank
    target_dtype = torch.bfloat16 if model_engine.bfloat16_enabled() else (
        torch.half if model_engine.fp16_enabled() else None)
    criterion = nn.CrossEntropyLoss()
    losses = []
    for _ in range(args.epochs):
        for data in trainloader:
            inputs, labels = data[0].to(local_device), data[1].to(local_device)
            if target_dtype is not None:
                inputs = inputs.to(target_dtype)
            loss = criterion(model_engine(inputs), labels)
            model_engine.backward(loss)
            model_engine.step()
            losses.append(loss.item())
    if local_rank == 0 and args.results:
        accelerator = get_accelerator()
        with open(args.results, "w") as file:
            json.dump({"losses": losses, "device": local_device, "backend": accelerator.communication_backend_name(),
                       "current_device_name": accelerator.current_device_name()}, file)


if __name__ == "__main__":
    main()
