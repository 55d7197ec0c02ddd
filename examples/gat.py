"""A GAT layer on geot: attention scores per edge and head, geot.edge_softmax
over each node's incoming edges, then the weighted sum of the neighbours'
features with geot.index_weight_segment_reduce ([E, H] weights, x [N, H, C]).

    alpha_ij = softmax over j of leaky_relu(a_src . h_j + a_dst . h_i)
    out_i    = concat over heads of sum over j of alpha_ij * h_j

Demo (CPU, or GPU if present), from the repository root:
``PYTHONPATH=. python examples/gat.py``.
"""
import torch
import torch.nn.functional as F

import geot


class GATConv(torch.nn.Module):
    def __init__(self, in_channels: int, out_channels: int, heads: int = 4, negative_slope: float = 0.2):
        super().__init__()
        self.heads, self.out_channels, self.negative_slope = heads, out_channels, negative_slope
        self.lin = torch.nn.Linear(in_channels, heads * out_channels, bias=False)
        self.att_src = torch.nn.Parameter(torch.randn(1, heads, out_channels) * 0.1)
        self.att_dst = torch.nn.Parameter(torch.randn(1, heads, out_channels) * 0.1)

    def scores(self, x: torch.Tensor, edge_index: torch.Tensor):
        """h [N, H, C] and the raw attention scores [E, H]."""
        src, dst = edge_index
        h = self.lin(x).view(-1, self.heads, self.out_channels)
        a_src, a_dst = (h * self.att_src).sum(-1), (h * self.att_dst).sum(-1)
        return h, F.leaky_relu(a_src.index_select(0, src) + a_dst.index_select(0, dst), self.negative_slope)

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        """edge_index [2, E] sorted by destination (row 1)."""
        src, dst = edge_index
        h, score = self.scores(x, edge_index)
        alpha = geot.edge_softmax(score, dst, x.shape[0])
        out = geot.index_weight_segment_reduce(src, dst, alpha, h, "sum", x.shape[0])
        return out.reshape(x.shape[0], self.heads * self.out_channels)


def gat_reference(layer: GATConv, x, edge_index):
    """The same layer in plain torch: scatter max, exp, index_add."""
    src, dst = edge_index
    h, score = layer.scores(x, edge_index)
    N, H = x.shape[0], layer.heads
    top = torch.full((N, H), float("-inf"), dtype=x.dtype, device=x.device).scatter_reduce(
        0, dst[:, None].expand_as(score), score, "amax")
    e = (score - top[dst]).exp()
    alpha = e / torch.zeros(N, H, dtype=x.dtype, device=x.device).index_add(0, dst, e)[dst]
    out = torch.zeros_like(h).index_add(0, dst, alpha[..., None] * h[src])
    return out.reshape(N, H * layer.out_channels)


if __name__ == "__main__":
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    N, E = 1000, 8000
    dst = torch.randint(0, N, (E,), device=device).sort().values
    edge_index = torch.stack([torch.randint(0, N, (E,), device=device), dst])
    x = torch.randn(N, 32, device=device)
    layer = GATConv(32, 8, heads=4).to(device)
    out = layer(x, edge_index)
    err = (out - gat_reference(layer, x, edge_index)).abs().max().item()
    print(f"GAT out {tuple(out.shape)}, max difference to plain torch {err:.2e}")
