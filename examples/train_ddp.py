"""Train an MLP on scikit-learn's handwritten digits with DDP, on switchml or gloo.

    torchrun --nproc-per-node 4 examples/train_ddp.py --backend switchml
    torchrun --nproc-per-node 4 examples/train_ddp.py --backend gloo

The same seed gives the same initial weights and batches on both backends, so the
runs differ only in how gradients are summed (block floating point through the
switch against float32 in gloo).  Rank 0 prints loss and test accuracy per epoch,
then one summary line: test accuracy, samples/s and allreduce time per step.
"""

import ddp_common
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.utils.data import TensorDataset


def digits(seed: int):
    """Digits (1797 8x8 images, 10 classes) scaled to [0, 1]; 20% held out for testing."""
    data = load_digits()
    x_train, x_test, y_train, y_test = train_test_split(
        data.data / 16.0, data.target, test_size=0.2, random_state=seed, stratify=data.target)
    as_x = lambda a: torch.tensor(a, dtype=torch.float32)  # noqa: E731
    as_y = lambda a: torch.tensor(a, dtype=torch.int64)  # noqa: E731
    return TensorDataset(as_x(x_train), as_y(y_train)), (as_x(x_test), as_y(y_test))


def main():
    p = ddp_common.parser(__doc__.splitlines()[0], epochs=20, batch_size=16, lr=0.05)
    p.add_argument("--hidden", type=int, default=1024, help="width of the two hidden layers")
    args = p.parse_args()
    ddp_common.init(args)
    torch.manual_seed(args.seed)
    train, test = digits(args.seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, args.hidden), torch.nn.ReLU(),
        torch.nn.Linear(args.hidden, args.hidden), torch.nn.ReLU(),
        torch.nn.Linear(args.hidden, 10))
    durations = []
    ddp, state = ddp_common.wrap(model, args, durations)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
    ddp_common.train(model, ddp, state, opt, ddp_common.loader(train, args), test, args, durations,
                     torch.nn.functional.cross_entropy)
    del ddp  # before the group ends: see ddp_common.finish
    ddp_common.finish(state)


if __name__ == "__main__":
    main()
