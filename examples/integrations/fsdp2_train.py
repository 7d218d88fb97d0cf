"""FSDP2 (``fully_shard``) on the switchml backend, averaging its loss over the ranks.

    torchrun --nproc-per-node 2 examples/integrations/fsdp2_train.py --backend switchml
    torchrun --nproc-per-node 2 examples/integrations/fsdp2_train.py --backend gloo

FSDP2's reduce-scatter and all-gather go to the backend's inner gloo group; the
script's own scalar ``dist.all_reduce`` of the loss goes through the switch.
"""

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import arguments, leave, model, report, sharded_loader, switch_results  # noqa: E402

import switchml.torch  # noqa: E402,F401  registers the "switchml" backend


def main():
    parser = arguments(__doc__)
    parser.add_argument("--backend", default="switchml")
    args = parser.parse_args()
    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    net = model()
    for layer in net:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(net)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    losses = []
    for x, y in sharded_loader():
        loss = torch.nn.functional.cross_entropy(net(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)  # a 0-d tensor: what every training loop logs
        losses.append(mean.item() / world)
    full = [p.full_tensor() for p in net.parameters()]
    if rank == 0:
        print(f"fsdp2 ({args.backend}): mean loss {losses[-1]:.4f}")
    report(args.json, rank, full, loss=losses[-1], switch_results=switch_results())
    leave()


if __name__ == "__main__":
    main()
