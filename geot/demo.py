"""The README's demo: a GCN on geot layers vs the same GCN in plain PyG.

Trains the standard 2-layer GCN (hidden 16, dropout 0.5 on the hidden
layer, Adam lr 0.01, weight decay 5e-4, 200 epochs) on Cora when its file is found (geot.data's
search path, or PyG's Planetoid under $GEOT_PLANETOID_ROOT if already
downloaded), else on a generated graph with planted classes; on the GPU when
there is one. Prints test accuracy of both, their time per training epoch
(median over the training run) and per inference pass (median of 10), both
measured the same way for both models, and checks geot's fused op
against a float64 reference. Run: ``python -m geot.demo [--nodes N]``.
"""
import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

import geot
from geot.data import data_dirs, load_dataset


class GCN(torch.nn.Module):
    def __init__(self, conv_class, in_channels: int, hidden: int, num_classes: int):
        super().__init__()
        self.conv1 = conv_class(in_channels, hidden, cached=True)
        self.conv2 = conv_class(hidden, num_classes, cached=True)

    def forward(self, x, edge_index):
        # Dropout on the hidden layer only: on CPU, drawing the mask of Cora's
        # 1433-wide input costs three times the rest of a training step.
        x = F.dropout(self.conv1(x, edge_index).relu(), p=0.5, training=self.training)
        return self.conv2(x, edge_index)


def planted_graph(num_nodes: int, num_classes: int = 7, avg_degree: int = 8, features: int = 128, seed: int = 0):
    """Random graph whose edges mostly join nodes of one class (80%), with
    noisy class-dependent features and a Planetoid-like split."""
    gen = torch.Generator().manual_seed(seed)
    y = torch.randint(0, num_classes, (num_nodes,), generator=gen)
    by_class = torch.argsort(y)
    class_start = torch.searchsorted(y[by_class], torch.arange(num_classes))
    class_size = torch.bincount(y, minlength=num_classes)
    dst = torch.randint(0, num_nodes, (num_nodes * avg_degree,), generator=gen)
    same = by_class[class_start[y[dst]] + (torch.rand(dst.numel(), generator=gen) * class_size[y[dst]]).long()]
    src = torch.where(torch.rand(dst.numel(), generator=gen) < 0.8, same,
                      torch.randint(0, num_nodes, (dst.numel(),), generator=gen))
    centers = torch.randn(num_classes, features, generator=gen)
    x = centers[y] + 3.0 * torch.randn(num_nodes, features, generator=gen)
    split = torch.randperm(num_nodes, generator=gen)
    masks = {name: torch.zeros(num_nodes, dtype=torch.bool) for name in ("train_mask", "val_mask", "test_mask")}
    masks["train_mask"][split[: 20 * num_classes]] = True
    masks["test_mask"][split[-min(1000, num_nodes // 2):]] = True
    return {"edge_index": torch.stack([src, dst]), "num_nodes": num_nodes, "x": x, "y": y, **masks}


def planetoid_cora():
    """Cora from PyG's Planetoid files when already on disk (never downloads)."""
    root = os.environ.get("GEOT_PLANETOID_ROOT", os.path.join("data", "Planetoid"))
    if not os.path.isdir(os.path.join(root, "Cora", "raw")):
        return None
    from torch_geometric.datasets import Planetoid

    cora = Planetoid(root, "Cora")[0]
    return {key: cora[key] for key in ("edge_index", "x", "y", "train_mask", "val_mask", "test_mask")} | {
        "num_nodes": cora.num_nodes}


def train_gcn(data, conv_class, epochs: int = 200, progress=None):
    """Trains the standard GCN. Returns the model, its test accuracy and the
    median ms per training epoch."""
    model = GCN(conv_class, data["x"].size(1), 16, int(data["y"].max()) + 1).to(data["x"].device)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=5e-4)
    epoch_ms = []
    for _ in range(epochs):
        epoch_ms.append(timed_ms(lambda: train_step(model, optimizer, data)))
        if progress is not None:
            progress.update()
    return model, accuracy(model, data), statistics.median(epoch_ms[1:] or epoch_ms)


def train_step(model, optimizer, data) -> None:
    model.train()
    optimizer.zero_grad()
    out = model(data["x"], data["edge_index"])
    F.cross_entropy(out[data["train_mask"]], data["y"][data["train_mask"]]).backward()
    optimizer.step()


@torch.no_grad()
def accuracy(model, data) -> float:
    model.eval()
    predicted = model(data["x"], data["edge_index"]).argmax(dim=-1)
    mask = data["test_mask"]
    return float((predicted[mask] == data["y"][mask]).float().mean())


def timed_ms(fn) -> float:
    """Wall time of fn() in ms, synchronized on GPU."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return (time.perf_counter() - start) * 1e3


@torch.no_grad()
def inference_ms(model, data, reps: int = 10) -> float:
    """Median ms of an inference pass, after one warm-up pass."""
    model.eval()
    model(data["x"], data["edge_index"])
    return statistics.median(timed_ms(lambda: model(data["x"], data["edge_index"])) for _ in range(reps))


def check_ops(data) -> float:
    """Largest relative error of geot's fused gather-reduce vs float64 torch."""
    dst, perm = torch.sort(data["edge_index"][1], stable=True)
    src = data["edge_index"][0, perm]
    x = torch.randn(data["num_nodes"], 32, device=src.device)
    weight = torch.rand(src.numel(), device=src.device)
    worst = 0.0
    for reduce in ("sum", "mean", "max"):
        got = geot.index_weight_segment_reduce(src, dst, weight, x, reduce, data["num_nodes"])
        messages = (weight[:, None] * x[src]).double()
        expect = torch.zeros(data["num_nodes"], 32, dtype=torch.float64, device=src.device).scatter_reduce_(
            0, dst[:, None].expand_as(messages), messages, {"max": "amax"}.get(reduce, reduce), include_self=False)
        worst = max(worst, float((got.double() - expect).norm() / expect.norm()))
    return worst


def load_data(args):
    if args.nodes is None:
        data, name = load_dataset("cora"), "Cora"
        if data is None:
            data = planetoid_cora()
        if data is not None:
            return data, name
        searched = f"searched {', '.join(data_dirs())}" if data_dirs() else "set $GEOT_DATA to its directory"
        print(f"cora.npz not found ({searched}): using a generated graph")
    nodes = args.nodes or (200_000 if torch.cuda.is_available() else 20_000)
    return planted_graph(nodes), f"generated graph ({nodes} nodes, planted classes)"


class _NoProgress:
    """Stands in for tqdm when it is not installed."""

    def __init__(self, *args, **kwargs):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def update(self, n=1):
        pass

    def set_postfix_str(self, text):
        print(f"training {text}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=None,
                        help="train on a generated graph of this many nodes instead of Cora")
    parser.add_argument("--epochs", type=int, default=200)
    args = parser.parse_args()

    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = _NoProgress
    try:
        from torch_geometric.nn import GCNConv as PyGGCNConv
    except ImportError:
        raise SystemExit("geot.demo compares geot's layers with PyG's: pip install torch-geometric") from None

    import geot.nn

    device = "cuda" if torch.cuda.is_available() and geot.cuda_built else "cpu"
    data, name = load_data(args)
    data = {key: value.to(device) if isinstance(value, torch.Tensor) else value for key, value in data.items()}
    print(f"geot demo on {device}: 2-layer GCN on {name}, "
          f"{data['num_nodes']} nodes, {data['edge_index'].size(1)} edges")
    error = check_ops(data)
    print(f"geot.index_weight_segment_reduce vs float64 torch: relative error {error:.1e}")

    results = {}
    with tqdm(total=2 * args.epochs, desc="training", unit="epoch") as progress:
        for label, conv_class in (("PyG", PyGGCNConv), ("geot", geot.nn.GCNConv)):
            torch.manual_seed(0)
            progress.set_postfix_str(label)
            model, acc, train_ms = train_gcn(data, conv_class, args.epochs, progress)
            results[label] = (acc, train_ms, inference_ms(model, data))

    print(f"{'':<6} {'test acc':>9} {'train ms/epoch':>15} {'inference ms':>13}")
    for label, (acc, train_ms, infer_ms) in results.items():
        print(f"{label:<6} {acc:>9.3f} {train_ms:>15.3f} {infer_ms:>13.3f}")
    (_, pyg_train, pyg_infer), (_, geot_train, geot_infer) = results["PyG"], results["geot"]
    print(f"geot speedup over PyG: training {pyg_train / geot_train:.2f}x, inference {pyg_infer / geot_infer:.2f}x")
    assert error < 1e-5, "geot disagrees with the reference"


if __name__ == "__main__":
    main()
