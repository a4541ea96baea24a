"""Two-rank hello world: `zerodist run --nproc 2 examples/hello_all_reduce.py`.

No init call: the first collective initialises the world from torchrun's variables.
"""

import torch

import zerodist.comm as comm

tensor = torch.tensor([float(comm.get_rank() + 1)])
comm.all_reduce(tensor)
gathered = torch.empty(comm.get_world_size())
comm.all_gather(gathered, torch.tensor([float(comm.get_rank())]))
print(f"rank {comm.get_rank()} of {comm.get_world_size()}: sum of (rank + 1) = {tensor.item():g}, "
      f"ranks gathered = {gathered.tolist()}")
