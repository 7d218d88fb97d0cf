"""Train a bag-of-words text classifier whose gradients are block-sparse, with DDP.

    torchrun --nproc-per-node 4 examples/train_sparse.py --backend switchml --sparse true
    torchrun --nproc-per-node 4 examples/train_sparse.py --backend switchml --sparse false
    torchrun --nproc-per-node 4 examples/train_sparse.py --backend gloo

The model is an embedding table (``--vocab`` rows of ``--dim`` values) averaged
over a document's words, then a linear classifier.  A batch touches only the rows
of its words, so the table's gradient, almost all of what DDP allreduces, is zero
outside a few percent of its blocks: what the sparse path skips.  The data are
generated: each class has a few topic words that its documents use among
background words drawn from the whole vocabulary.
"""

import ddp_common
import torch
from torch.utils.data import TensorDataset


def documents(count: int, args, generator: torch.Generator):
    """``count`` documents of ``--words`` word ids with their class labels."""
    topics = torch.randperm(args.vocab, generator=torch.Generator().manual_seed(1234))
    topics = topics[: args.classes * args.topic_words].reshape(args.classes, args.topic_words)
    labels = torch.randint(0, args.classes, (count,), generator=generator)
    words = torch.randint(0, args.vocab, (count, args.words), generator=generator)
    on_topic = torch.rand(count, args.words, generator=generator) < args.topic_share
    picks = torch.randint(0, args.topic_words, (count, args.words), generator=generator)
    words = torch.where(on_topic, topics[labels[:, None], picks], words)
    return words, labels


class BagOfWords(torch.nn.Module):
    def __init__(self, vocab: int, dim: int, classes: int):
        super().__init__()
        # dense gradients (sparse=False): DDP's buckets hold the whole table
        self.embedding = torch.nn.EmbeddingBag(vocab, dim, mode="mean")
        self.classify = torch.nn.Linear(dim, classes)

    def forward(self, words):
        return self.classify(self.embedding(words))


def main():
    p = ddp_common.parser(__doc__.splitlines()[0], epochs=3, batch_size=32, lr=10.0)
    p.add_argument("--vocab", type=int, default=400_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--classes", type=int, default=8)
    p.add_argument("--words", type=int, default=20, help="words per document")
    p.add_argument("--topic-words", type=int, default=50, help="topic words per class")
    p.add_argument("--topic-share", type=float, default=0.25,
                   help="share of a document's words drawn from its class's topic")
    p.add_argument("--train-docs", type=int, default=8192)
    p.add_argument("--test-docs", type=int, default=2048)
    args = p.parse_args()
    ddp_common.init(args)
    data = torch.Generator().manual_seed(args.seed)
    train = TensorDataset(*documents(args.train_docs, args, data))
    test = documents(args.test_docs, args, data)
    torch.manual_seed(args.seed)
    model = BagOfWords(args.vocab, args.dim, args.classes)
    durations = []
    ddp, state = ddp_common.wrap(model, args, durations)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr)
    ddp_common.train(model, ddp, state, opt, ddp_common.loader(train, args), test, args, durations,
                     torch.nn.functional.cross_entropy)
    del ddp  # before the group ends: see ddp_common.finish
    ddp_common.finish(state)


if __name__ == "__main__":
    main()
