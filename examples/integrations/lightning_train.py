"""PyTorch Lightning on switchml: the backend, or the DDP comm hook on gloo.

    python examples/integrations/lightning_train.py --mode backend   # 2 CPU processes
    python examples/integrations/lightning_train.py --mode hook
    python examples/integrations/lightning_train.py --mode gloo      # the reference

Lightning starts the processes itself.  The one line each mode changes is the
strategy; ``self.log(..., sync_dist=True)`` averages the loss over the ranks
(a 0-d all_reduce) every step.  Lightning registers a strategy's comm hook on
CUDA devices only, so on the CPU the module registers it when training starts.
"""

import os
import sys

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import BATCH, STEPS, arguments, dataset, model, report, switch_results  # noqa: E402

import switchml.torch  # noqa: E402  registers the "switchml" backend


class Classifier(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = model()

    def training_step(self, batch, _index):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        self.log("loss", loss, sync_dist=True)
        return loss

    def on_train_start(self):
        strategy = self.trainer.strategy
        if strategy._ddp_comm_hook is not None and strategy.root_device.type != "cuda":
            strategy.model.register_comm_hook(strategy._ddp_comm_state, strategy._ddp_comm_hook)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def strategy(mode: str) -> DDPStrategy:
    if mode == "backend":
        return DDPStrategy(process_group_backend="switchml")
    if mode == "hook":  # the state is built before the process group exists
        return DDPStrategy(process_group_backend="gloo",
                           ddp_comm_state=switchml.torch.HookState(),
                           ddp_comm_hook=switchml.torch.allreduce_hook)
    return DDPStrategy(process_group_backend="gloo")


def main():
    parser = arguments(__doc__)
    parser.add_argument("--mode", choices=["backend", "hook", "gloo"], default="backend")
    parser.add_argument("--devices", type=int, default=2)
    args = parser.parse_args()
    chosen = strategy(args.mode)
    module = Classifier()
    trainer = L.Trainer(accelerator="cpu", devices=args.devices, strategy=chosen,
                        max_steps=STEPS, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    loader = torch.utils.data.DataLoader(dataset(), batch_size=BATCH)
    trainer.fit(module, loader)
    loss = float(trainer.callback_metrics["loss"])
    state = chosen._ddp_comm_state
    if trainer.global_rank == 0:
        print(f"lightning ({args.mode}): logged loss {loss:.4f} after {STEPS} steps")
    report(args.json, trainer.global_rank, module.parameters(), loss=loss,
           switch_results=switch_results(state))


if __name__ == "__main__":
    main()
