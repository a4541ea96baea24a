"""DeepSpeed's CIFAR-10 tutorial script, run by zerodist: only the import line differs.

    zerodist run --nproc 2 examples/deepspeed_tutorial.py --deepspeed --deepspeed_config examples/ds_config.json

It is written the way DeepSpeed's training/cifar/cifar10_deepspeed.py is (argparse with
`deepspeed.add_config_arguments`, `deepspeed.init_distributed`, `deepspeed.initialize(args=...)`,
the engine's accessors, checkpoints with `client_state`), on CIFAR-shaped synthetic images so it
needs no download. examples/ds_config.json is the tutorial's config, legacy keys included
(`"cpu_offload": false`, `"prescale_gradients": false`, ...); change its ZeRO stage to 0-3.

After one epoch it saves a checkpoint; after the second it loads that checkpoint back and trains
the second epoch again, which must give the same losses. With `--results FILE`, rank 0 writes the
losses and what the engine reported as JSON (tests/engine/test_deepspeed_tutorial.py compares them with a
one-process PyTorch run).
"""

import argparse
import json

import torch
import torch.nn as nn
import torch.nn.functional as F

import zerodist as deepspeed  # the only change from a DeepSpeed script: `import deepspeed`
from zerodist import comm as dist


def add_argument():
    parser = argparse.ArgumentParser(description="CIFAR")
    parser.add_argument("-e", "--epochs", default=2, type=int, help="number of total epochs (default: 2)")
    parser.add_argument("--local_rank", type=int, default=-1, help="local rank passed from distributed launcher")
    parser.add_argument("--log-interval", type=int, default=2, help="output logging information at a given interval")
    parser.add_argument("--samples", type=int, default=64, help="synthetic training images")
    parser.add_argument("--checkpoint_dir", default="checkpoints", help="where the epoch-1 checkpoint goes")
    parser.add_argument("--results", default=None, help="rank 0 writes losses and engine facts here (JSON)")
    # Include DeepSpeed configuration arguments
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def cifar_like(samples, seed=1234):
    """CIFAR-10's shapes (3x32x32 images in [-1, 1], 10 classes), drawn from a fixed seed."""
    generator = torch.Generator().manual_seed(seed)
    images = torch.rand(samples, 3, 32, 32, generator=generator) * 2 - 1
    labels = torch.randint(0, 10, (samples,), generator=generator)
    return torch.utils.data.TensorDataset(images, labels)


class Net(nn.Module):
    def __init__(self):
        super(Net, self).__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.view(-1, 16 * 5 * 5)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


def train_epoch(model_engine, trainloader, criterion, args, epoch):
    """One pass; returns the global batch's loss of each step (the mean over ranks)."""
    losses, running_loss = [], 0.0
    for i, data in enumerate(trainloader):
        inputs, labels = data[0].to(model_engine.device), data[1].to(model_engine.device)
        if model_engine.bfloat16_enabled():
            inputs = inputs.to(torch.bfloat16)
        outputs = model_engine(inputs)
        loss = criterion(outputs, labels)
        model_engine.backward(loss)
        model_engine.step()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        losses.append(global_loss.item() / dist.get_world_size())
        running_loss += loss.item()
        if model_engine.local_rank == 0 and i % args.log_interval == args.log_interval - 1:
            print("[%d, %5d] loss: %.3f" % (epoch + 1, i + 1, running_loss / args.log_interval))
            running_loss = 0.0
    return losses


def evaluate(net, model_engine, criterion, args):
    """The tutorial tests the model itself (`net`, not the engine) on held-out images; at ZeRO-3 its
    parameters are gathered around its forward as the engine's are (every rank must call it)."""
    images, labels = cifar_like(args.samples // 2, seed=4321).tensors
    if model_engine.bfloat16_enabled():
        images = images.to(torch.bfloat16)
    net.eval()
    with torch.no_grad():
        outputs = net(images.to(model_engine.device))
    net.train()
    loss = criterion(outputs.float(), labels.to(model_engine.device)).item()
    accuracy = (outputs.argmax(1) == labels.to(model_engine.device)).float().mean().item()
    return loss, accuracy


def engine_facts(model_engine, net):
    """What DeepSpeed scripts ask the engine; each is checked by the test against DeepSpeed's meaning."""
    names = [name for name, _ in model_engine.named_parameters()]
    # At ZeRO-3 the parameters are partitioned: gather them to read their values (a no-op below stage 3).
    with deepspeed.zero.GatheredParameters(list(model_engine.parameters())):
        state_dict_keys = list(model_engine.state_dict().keys())
    return {
        "is_module": isinstance(model_engine, nn.Module),
        "parameter_count": sum(1 for _ in model_engine.parameters()),
        "named_parameters": names,
        "state_dict_keys": state_dict_keys,
        "fall_through": model_engine.fc1 is net.fc1,
        "local_rank": model_engine.local_rank,
        "global_rank": model_engine.global_rank,
        "world_size": model_engine.world_size,
        "device": str(model_engine.device),
        "train_micro_batch_size_per_gpu": model_engine.train_micro_batch_size_per_gpu(),
        "train_batch_size": model_engine.train_batch_size(),
        "gradient_accumulation_steps": model_engine.gradient_accumulation_steps(),
        "fp16_enabled": model_engine.fp16_enabled(),
        "bfloat16_enabled": model_engine.bfloat16_enabled(),
        "zero_optimization_stage": model_engine.zero_optimization_stage(),
        "global_samples": model_engine.global_samples,
        "global_steps": model_engine.global_steps,
        "was_step_applied": model_engine.was_step_applied(),
    }


def main():
    args = add_argument()
    deepspeed.init_distributed(dist_backend="gloo")

    torch.manual_seed(0)  # every rank builds the same initial weights
    net = Net()
    trainset = cifar_like(args.samples)
    parameters = filter(lambda p: p.requires_grad, net.parameters())

    # Initialize DeepSpeed to use the following features
    # 1) Distributed model
    # 2) Distributed data loader
    # 3) DeepSpeed optimizer
    model_engine, optimizer, trainloader, __ = deepspeed.initialize(
        args=args, model=net, model_parameters=parameters, training_data=trainset)
    criterion = nn.CrossEntropyLoss()
    facts_before = engine_facts(model_engine, net)

    losses = train_epoch(model_engine, trainloader, criterion, args, 0)
    model_engine.save_checkpoint(args.checkpoint_dir, client_state={"epoch": 0, "losses": losses})
    for epoch in range(1, args.epochs):
        losses += train_epoch(model_engine, trainloader, criterion, args, epoch)
    facts_after = engine_facts(model_engine, net)

    # Back to the end of epoch 1, as a restarted job would be, and train the same epochs again.
    load_path, client_state = model_engine.load_checkpoint(args.checkpoint_dir)
    resumed = []
    for epoch in range(client_state["epoch"] + 1, args.epochs):
        resumed += train_epoch(model_engine, trainloader, criterion, args, epoch)

    test_loss, accuracy = evaluate(net, model_engine, criterion, args)
    if model_engine.global_rank == 0:
        print("Finished Training")
        print("Accuracy of the network on the %d test images: %d %%" % (args.samples // 2, 100 * accuracy))
        if args.results:
            saved = {"epoch": client_state["epoch"], "losses": client_state["losses"]}
            with open(args.results, "w") as file:
                json.dump({"losses": losses, "resumed_losses": resumed, "client_state": saved,
                           "load_path": load_path, "args_local_rank": args.local_rank,
                           "test_loss": test_loss, "accuracy": accuracy,
                           "before": facts_before, "after": facts_after}, file)


if __name__ == "__main__":
    main()
