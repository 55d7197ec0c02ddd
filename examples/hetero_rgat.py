"""Node classification on a heterogeneous graph (a generated ``HeteroData``
of authors, papers and venues) with geot.nn's HGTConv on the dicts and
RGATConv on the homogeneous view (``HeteroData.to_homogeneous``). The
labels are planted: a paper's class is the venue it appears in, so both
models must pass messages to learn it.

Demo (CPU, or GPU if present), from the repository root:
``PYTHONPATH=. python examples/hetero_rgat.py [--model rgat|hgt] [--epochs 40] [--compile]``
(``--compile``: the model under ``torch.compile``, with no eager call first).
"""
import argparse

import torch
import torch.nn.functional as F
from torch_geometric.data import HeteroData

import geot.nn

CLASSES = 4


def generated_data(papers: int = 300, authors: int = 200, seed: int = 0) -> HeteroData:
    """Papers each in one of CLASSES venues (their label), written by random authors; features are noise."""
    gen = torch.Generator().manual_seed(seed)
    data = HeteroData()
    venue = torch.randint(0, CLASSES, (papers,), generator=gen)
    data["paper"].x = torch.randn(papers, 16, generator=gen)
    data["paper"].y = venue
    data["author"].x = torch.randn(authors, 16, generator=gen)
    data["venue"].x = torch.randn(CLASSES, 16, generator=gen)
    writes = torch.stack([torch.randint(0, authors, (3 * papers,), generator=gen),
                          torch.randint(0, papers, (3 * papers,), generator=gen)])
    data["author", "writes", "paper"].edge_index = writes
    data["paper", "written_by", "author"].edge_index = writes.flip(0)
    data["venue", "publishes", "paper"].edge_index = torch.stack([venue, torch.arange(papers)])
    data["paper", "appears_in", "venue"].edge_index = torch.stack([torch.arange(papers), venue])
    return data


class HGT(torch.nn.Module):
    def __init__(self, metadata, hidden: int = 32, heads: int = 2):
        super().__init__()
        self.conv1 = geot.nn.HGTConv(16, hidden, metadata, heads=heads)
        self.conv2 = geot.nn.HGTConv(hidden, hidden, metadata, heads=heads)
        self.out = torch.nn.Linear(hidden, CLASSES)

    def forward(self, data: HeteroData) -> torch.Tensor:
        x_dict = self.conv1(data.x_dict, data.edge_index_dict)
        x_dict = self.conv2({t: F.relu(x) for t, x in x_dict.items()}, data.edge_index_dict)
        return self.out(x_dict["paper"])


class RGAT(torch.nn.Module):
    def __init__(self, num_relations: int, hidden: int = 32, heads: int = 2):
        super().__init__()
        self.conv1 = geot.nn.RGATConv(16, hidden // heads, num_relations, heads=heads)
        self.conv2 = geot.nn.RGATConv(hidden, hidden // heads, num_relations, heads=heads)
        self.out = torch.nn.Linear(hidden, CLASSES)

    def forward(self, homogeneous) -> torch.Tensor:
        x = F.relu(self.conv1(homogeneous.x, homogeneous.edge_index, homogeneous.edge_type))
        x = self.conv2(x, homogeneous.edge_index, homogeneous.edge_type)
        return self.out(x[homogeneous.node_type == homogeneous.paper_type])


def train(model_name: str = "rgat", epochs: int = 40, device="cpu", seed: int = 0, compile_backend=None):
    """Trains one model, compiled with compile_backend if given ("inductor": torch.compile's default);
    returns (losses per epoch, training accuracy at the end)."""
    torch.manual_seed(seed)
    data = generated_data(seed=seed).to(device)
    if model_name == "hgt":
        model, inputs = HGT(data.metadata()), data
    else:
        inputs = data.to_homogeneous()
        inputs.paper_type = data.node_types.index("paper")
        model = RGAT(len(data.edge_types))
    model = model.to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    if compile_backend is not None:
        model = torch.compile(model, backend=compile_backend)
    labels, losses = data["paper"].y, []
    for _ in range(epochs):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(inputs), labels)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    with torch.no_grad():
        accuracy = float((model(inputs).argmax(-1) == labels).float().mean())
    return losses, accuracy


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["rgat", "hgt"], default="rgat")
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--compile", action="store_true", help="train the model under torch.compile")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    losses, accuracy = train(args.model, args.epochs, device, compile_backend="inductor" if args.compile else None)
    print(f"{args.model}: loss {losses[0]:.3f} -> {losses[-1]:.3f}, training accuracy {accuracy:.2f}")
