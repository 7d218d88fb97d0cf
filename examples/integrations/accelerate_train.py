"""Hugging Face Accelerate on switchml, through the DDP comm hook.

    torchrun --nproc-per-node 2 examples/integrations/accelerate_train.py --hook
    torchrun --nproc-per-node 2 examples/integrations/accelerate_train.py      # the reference

(``accelerate launch --cpu`` starts one process; several CPU processes come from
torchrun, which Accelerate documents, or from an MPI configuration.)

Accelerate on the CPU only runs gloo (or MPI) groups, so the switch comes in as a
DDP communication hook on the prepared model: one added line.
"""

import os
import sys

import torch
from accelerate import Accelerator

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import BATCH, arguments, dataset, model, report, switch_results  # noqa: E402

import switchml.torch  # noqa: E402


def main():
    parser = arguments(__doc__)
    parser.add_argument("--hook", action="store_true", help="gradients through the switch")
    args = parser.parse_args()
    accelerator = Accelerator(cpu=True)
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(dataset(), batch_size=BATCH)
    net, optimizer, loader = accelerator.prepare(net, optimizer, loader)
    state = None
    if args.hook:
        state = switchml.torch.HookState()
        net.register_comm_hook(state, switchml.torch.allreduce_hook)
    for x, y in loader:
        loss = torch.nn.functional.cross_entropy(net(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    mean_loss = accelerator.reduce(loss.detach(), "mean").item()
    if accelerator.is_main_process:
        print(f"accelerate ({'hook' if args.hook else 'gloo'}): loss {mean_loss:.4f}")
    report(args.json, accelerator.process_index, accelerator.unwrap_model(net).parameters(),
           loss=mean_loss, switch_results=switch_results(state))
    if state is not None:
        state.close()
    accelerator.wait_for_everyone()
    accelerator.end_training()  # destroys the process group: no rank exits mid-collective


if __name__ == "__main__":
    main()
