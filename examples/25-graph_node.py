"""Node classification on a graph with a two-layer GCN (uses DGL when installed: `pip install dgl`).

The whole graph is one batch: `((graph, features), (labels, mask))`. The mask selects the nodes a stage
scores (train / validation / test), so the loss function and metric read it from the nested label. The
graph is synthetic (three communities that are densely linked inside, sparsely across; node features
carry a weak class signal, so neighbours help).

Without DGL the script says how to install it and runs the same model written in plain PyTorch (a
normalised dense adjacency matrix instead of `dgl.nn.GraphConv`).

Run: `python examples/25-graph_node.py` (or `--small` for a smaller graph and fewer epochs).
"""

import argparse

import torch
from torch import nn
from torch.nn import functional as F

from deepepochs import Trainer, set_seed
from deepepochs.metrics import accuracy


def community_graph(n, classes=3, p_in=0.05, p_out=0.004, seed=0):
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, classes, (n,), generator=g)
    same = labels[:, None] == labels[None, :]
    adj = torch.rand(n, n, generator=g) < torch.where(same, p_in, p_out)
    adj = torch.triu(adj, diagonal=1)
    adj = adj | adj.T
    features = 0.4 * F.one_hot(labels, 16).float() + torch.randn(n, 16, generator=g)
    split = torch.rand(n, generator=g)
    masks = {"train": split < 0.3, "val": (split >= 0.3) & (split < 0.6), "test": split >= 0.6}
    return adj, features, labels, masks


class DenseGCN(nn.Module):
    """GCN on a dense adjacency: H' = relu(A_hat H W), A_hat = D^-1/2 (A + I) D^-1/2."""

    def __init__(self, dims):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))

    @staticmethod
    def normalise(adj):
        a = adj.float() + torch.eye(adj.shape[0])
        d = a.sum(dim=1).rsqrt()
        return d[:, None] * a * d[None, :]

    def forward(self, a_hat, h):
        for i, layer in enumerate(self.layers):
            h = a_hat @ layer(h)
            h = F.relu(h) if i < len(self.layers) - 1 else h
        return h


class DGLGCN(nn.Module):
    def __init__(self, dims):
        super().__init__()
        from dgl.nn import GraphConv

        self.layers = nn.ModuleList(GraphConv(a, b) for a, b in zip(dims[:-1], dims[1:]))

    def forward(self, graph, h):
        for i, layer in enumerate(self.layers):
            h = layer(graph, h)
            h = F.relu(h) if i < len(self.layers) - 1 else h
        return h


def masked_ce(logits, labels_and_mask):
    labels, mask = labels_and_mask
    return F.cross_entropy(logits[mask], labels[mask])


def masked_accuracy(logits, labels_and_mask):
    labels, mask = labels_and_mask
    return accuracy(logits[mask], labels[mask])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="a smaller graph and fewer epochs")
    args = parser.parse_args()
    n, epochs = (300, 20) if args.small else (1500, 100)
    set_seed(0)
    adj, features, labels, masks = community_graph(n)
    dims = [16, 32, 3]
    try:
        import dgl

        src, dst = adj.nonzero(as_tuple=True)
        graph = dgl.add_self_loop(dgl.graph((src, dst), num_nodes=n))
        model = DGLGCN(dims)
        print(f"DGL {dgl.__version__}: {graph.num_nodes()} nodes, {graph.num_edges()} edges")
    except ImportError:
        print("DGL is not installed (pip install dgl; see https://www.dgl.ai/pages/start.html for CUDA builds);"
              " running the same GCN in plain PyTorch instead.")
        graph = DenseGCN.normalise(adj)
        model = DenseGCN(dims)
    batch = {stage: [((graph, features), (labels, mask))] for stage, mask in masks.items()}  # one batch each
    with Trainer(model, masked_ce, torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=5e-4),
                 epochs=epochs, metrics=[masked_accuracy], log_batch=False, show_info=False) as trainer:
        records = trainer.fit(batch["train"], batch["val"], val_freq=10 if epochs >= 50 else 5)
        results = trainer.test(batch["test"])
    print(f"val accuracy by validation {[round(v, 3) for v in records['val']['masked_accuracy']]}")
    print(f"test accuracy {results['masked_accuracy']:.3f} on {int(masks['test'].sum())} unseen nodes")


if __name__ == "__main__":
    main()
