"""An RGCN layer on geot: one weight per relation, applied to the messages
with geot.segment_matmul, then a mean over each node's incoming edges with
geot.index_segment_reduce.

    h_i = root(x_i) + mean over edges (j -> i, relation r) of x_j @ W_r

Demo (CPU, or GPU if present), from the repository root:
``PYTHONPATH=. python examples/rgcn.py``.
"""
import torch

import geot


class RGCNConv(torch.nn.Module):
    def __init__(self, in_channels: int, out_channels: int, num_relations: int):
        super().__init__()
        self.num_relations = num_relations
        self.weight = torch.nn.Parameter(torch.empty(num_relations, in_channels, out_channels))
        self.root = torch.nn.Linear(in_channels, out_channels)
        torch.nn.init.xavier_uniform_(self.weight)

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor, edge_type: torch.Tensor) -> torch.Tensor:
        """edge_index [2, E] sorted by destination (row 1); edge_type [E]."""
        src, dst = edge_index
        # Messages x_j @ W_r need the edges grouped by relation; the
        # aggregation below reads message e at its place in that order.
        perm, ptr = geot.group_by_type(edge_type, self.num_relations)
        messages = geot.segment_matmul(x.index_select(0, src.index_select(0, perm)), ptr, self.weight)
        place = torch.empty_like(perm)
        place[perm] = torch.arange(perm.numel(), device=perm.device)
        out = geot.index_segment_reduce(place, dst, messages, "mean", x.shape[0])
        return out + self.root(x)


def rgcn_reference(layer: RGCNConv, x, edge_index, edge_type):
    """The same layer in plain torch: a per-edge weight gather and index_add."""
    src, dst = edge_index
    messages = torch.bmm(x[src].unsqueeze(1), layer.weight[edge_type]).squeeze(1)
    total = torch.zeros(x.shape[0], messages.shape[1], dtype=x.dtype, device=x.device).index_add(0, dst, messages)
    degree = torch.bincount(dst, minlength=x.shape[0]).clamp(min=1).to(x.dtype)
    return total / degree[:, None] + layer.root(x)


def random_graph(num_nodes: int, num_edges: int, num_relations: int, device="cpu"):
    dst = torch.randint(0, num_nodes, (num_edges,), device=device).sort().values
    src = torch.randint(0, num_nodes, (num_edges,), device=device)
    return torch.stack([src, dst]), torch.randint(0, num_relations, (num_edges,), device=device)


if __name__ == "__main__":
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    edge_index, edge_type = random_graph(1000, 8000, 5, device)
    x = torch.randn(1000, 32, device=device)
    layer = RGCNConv(32, 16, 5).to(device)
    out = layer(x, edge_index, edge_type)
    err = (out - rgcn_reference(layer, x, edge_index, edge_type)).abs().max().item()
    print(f"RGCN out {tuple(out.shape)}, max difference to plain torch {err:.2e}")
