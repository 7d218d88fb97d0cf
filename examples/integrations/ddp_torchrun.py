"""Plain DDP under torchrun, the one-line change: ``init_process_group("switchml")``.

    torchrun --nproc-per-node 2 examples/integrations/ddp_torchrun.py --backend switchml
"""

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import arguments, leave, model, report, sharded_loader, switch_results  # noqa: E402

import switchml.torch  # noqa: E402,F401  registers the "switchml" backend


def main():
    parser = arguments(__doc__)
    parser.add_argument("--backend", default="switchml")
    args = parser.parse_args()
    dist.init_process_group(args.backend)
    net = model()
    ddp = torch.nn.parallel.DistributedDataParallel(net)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for x, y in sharded_loader():
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    mean = loss.detach().clone()
    dist.all_reduce(mean, op=dist.ReduceOp.AVG)
    if dist.get_rank() == 0:
        print(f"ddp ({args.backend}): mean loss {mean.item():.4f}")
    report(args.json, dist.get_rank(), net.parameters(), loss=mean.item(),
           switch_results=switch_results())
    del ddp  # before the group ends: see common.leave
    leave()


if __name__ == "__main__":
    main()
