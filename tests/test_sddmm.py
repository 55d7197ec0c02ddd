"""geot.sddmm against a float64 reference (gathers and the op), gradcheck, errors."""
import pytest
import torch

import geot
from conftest import DTYPES

OPS = ["dot", "add", "sub", "mul", "div"]
TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}


def reference(src, dst, a, b, op):
    a, b = a.detach().cpu().double(), b.detach().cpu().double()
    left, right = a[src.cpu().long()], b[dst.cpu().long()]
    if op == "dot":
        return (left * right).sum(-1)
    return {"add": left + right, "sub": left - right, "mul": left * right, "div": left / right}[op]


def edges(num_src, num_dst, num_edges, device, generator):
    """Any order, duplicated edges included; some rows of each side without edges."""
    src = torch.randint(0, max(num_src - 2, 1), (num_edges,), generator=generator)
    dst = torch.randint(0, max(num_dst - 2, 1), (num_edges,), generator=generator)
    return torch.cat([src, src[:3]]).to(device), torch.cat([dst, dst[:3]]).to(device)


# (rows per side, trailing shape)
SHAPES = {"F1": (1,), "F7": (7,), "F64": (64,), "H3C5": (3, 5), "H1C4": (1, 4)}


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_reference(op, shape, dtype, device):
    generator = torch.Generator().manual_seed(0)
    src, dst = edges(11, 9, 60, device, generator)
    a = torch.randn(11, *SHAPES[shape], generator=generator, dtype=torch.float64).to(device, dtype)
    b = (torch.rand(9, *SHAPES[shape], generator=generator, dtype=torch.float64) + 0.5).to(device, dtype)
    out = geot.sddmm(src, dst, a, b, op)
    want = reference(src, dst, a, b, op)
    assert out.dtype == dtype and out.shape == want.shape
    tol = TOL[dtype] * (SHAPES[shape][-1] if op == "dot" else 1)
    torch.testing.assert_close(out.cpu().double(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("op", OPS)
def test_no_edges(op, device):
    index = torch.zeros(0, dtype=torch.long, device=device)
    a, b = torch.randn(4, 3, device=device, requires_grad=True), torch.randn(5, 3, device=device, requires_grad=True)
    out = geot.sddmm(index, index, a, b, op)
    assert out.shape == ((0,) if op == "dot" else (0, 3))
    out.sum().backward()
    assert (a.grad == 0).all() and (b.grad == 0).all()


@pytest.mark.parametrize("shape", ["F7", "H3C5"])
@pytest.mark.parametrize("op", OPS)
def test_gradcheck(op, shape, device):
    generator = torch.Generator().manual_seed(1)
    src, dst = edges(6, 5, 20, device, generator)
    a = torch.randn(6, *SHAPES[shape], generator=generator, dtype=torch.float64).to(device).requires_grad_()
    b = (torch.rand(5, *SHAPES[shape], generator=generator, dtype=torch.float64) + 0.5).to(device).requires_grad_()
    # CUDA's backward scatters with float atomics: two runs may differ in the last bits (gradcheck's
    # reentrancy check); float64 rounding differences stay far below this.
    nondet_tol = 1e-12 if device == "cuda" else 0.0
    assert torch.autograd.gradcheck(lambda a, b: geot.sddmm(src, dst, a, b, op), (a, b), nondet_tol=nondet_tol)
    # Second derivatives (a gradient penalty): dot's backward scatters with geot::index_scatter_sum,
    # whose own formula makes that differentiable again.
    assert torch.autograd.gradgradcheck(lambda a, b: geot.sddmm(src, dst, a, b, op), (a, b), nondet_tol=nondet_tol)


def test_a_hub_row_gathers_its_gradient(device):
    """Every edge of one source: the gradient of its row sums over all of them (atomics on CUDA)."""
    src = torch.zeros(5000, dtype=torch.long, device=device)
    dst = torch.arange(5000, device=device) % 37
    a = torch.randn(1, 16, device=device, dtype=torch.float64, requires_grad=True)
    b = torch.randn(37, 16, device=device, dtype=torch.float64)
    grad = torch.randn(5000, device=device, dtype=torch.float64)
    geot.sddmm(src, dst, a, b).backward(grad)
    torch.testing.assert_close(a.grad[0], (grad[:, None] * b[dst]).sum(0))


def test_compiles(device):
    torch._dynamo.reset()
    generator = torch.Generator().manual_seed(2)
    src, dst = edges(8, 8, 30, device, generator)
    a = torch.randn(8, 4, device=device, requires_grad=True)
    decoder = torch.compile(lambda a: geot.sddmm(src, dst, a, a).sigmoid(), fullgraph=True, backend="aot_eager")
    out = decoder(a)
    out.sum().backward()
    torch.testing.assert_close(out, (a[src] * a[dst]).sum(-1).sigmoid())


def test_errors(device):
    index = torch.tensor([0, 1], device=device)
    a, b = torch.randn(2, 3, device=device), torch.randn(2, 3, device=device)
    with pytest.raises(ValueError, match="op must be one of"):
        geot.sddmm(index, index, a, b, "max")
    with pytest.raises(TypeError, match="src_index must be a 1-D int32 or int64 tensor"):
        geot.sddmm(index.float(), index, a, b)
    with pytest.raises(ValueError, match="same length"):
        geot.sddmm(index, index[:1], a, b)
    with pytest.raises(ValueError, match="same row shape and dtype"):
        geot.sddmm(index, index, a, b[:, :2])
    with pytest.raises(TypeError, match="b must be a float tensor"):
        geot.sddmm(index, index, a, b[:, 0])
    for op in ("dot", "mul"):
        with pytest.raises(ValueError, match="src_index has values"):
            geot.sddmm(torch.tensor([0, 2], device=device), index, a, b, op)
        with pytest.raises(ValueError, match="dst_index has"):
            geot.sddmm(index, torch.tensor([0, -1], device=device), a, b, op)


def test_edge_dot_op_checks(device):
    """geot::edge_dot (sddmm's dot) passes torch's op checks, its autograd formula included."""
    src, dst = torch.tensor([0, 2, 1, 2], device=device), torch.tensor([1, 1, 0, 2], device=device)
    a, b = (torch.randn(3, 2, 4, device=device, requires_grad=True) for _ in range(2))
    torch.library.opcheck(torch.ops.geot.edge_dot.default, (src, dst, a, b, 2))


def additive_reference(src, dst, a, b, att, slope):
    """geot::edge_additive_score in float64: att[h] . leaky_relu(a[dst, h] + b[src, h])."""
    heads = att.shape[-2]
    rows = [t.detach().cpu().double().reshape(t.size(0), heads, -1) for t in (a, b)]
    z = rows[0][dst.cpu().long()] + rows[1][src.cpu().long()]
    return (torch.nn.functional.leaky_relu(z, slope) * att.detach().cpu().double().reshape(heads, -1)).sum(-1)


# (heads, channels per head): one head, narrow heads, odd widths, a head wider than a warp's vectors
ADDITIVE_SHAPES = [(1, 1), (1, 64), (3, 5), (8, 16), (2, 300)]


@pytest.mark.parametrize("heads,channels", ADDITIVE_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_additive_score_matches_reference(heads, channels, dtype, device):
    """GATv2's scores (geot::edge_additive_score) on edges in any order, duplicates and unused rows included."""
    generator = torch.Generator().manual_seed(2)
    src, dst = edges(13, 9, 70, device, generator)
    a = torch.randn(9, heads, channels, generator=generator, dtype=torch.float64).to(device, dtype)
    b = torch.randn(13, heads, channels, generator=generator, dtype=torch.float64).to(device, dtype)
    att = torch.randn(1, heads, channels, generator=generator, dtype=torch.float64).to(device, dtype)
    out = torch.ops.geot.edge_additive_score(src, dst, a, b, att, 0.2, heads)
    want = additive_reference(src, dst, a, b, att, 0.2)
    assert out.dtype == dtype and out.shape == (src.numel(), heads)
    tol = TOL[dtype] * channels
    torch.testing.assert_close(out.cpu().double(), want, rtol=tol, atol=tol)


def test_additive_score_gradcheck(device):
    generator = torch.Generator().manual_seed(3)
    src, dst = edges(6, 5, 25, device, generator)
    a, b, att = (torch.randn(*shape, generator=generator, dtype=torch.float64).to(device).requires_grad_()
                 for shape in ((5, 3, 4), (6, 3, 4), (1, 3, 4)))
    torch.autograd.gradcheck(lambda a, b, att: torch.ops.geot.edge_additive_score(src, dst, a, b, att, 0.2, 3),
                             (a, b, att))


def test_additive_score_op_checks(device):
    """geot::edge_additive_score passes torch's op checks (fake kernel, autograd formula); no edges gives
    [0, H] and zero gradients; bad att names the argument."""
    src, dst = torch.tensor([0, 2, 1, 2], device=device), torch.tensor([1, 1, 0, 2], device=device)
    a, b, att = (torch.randn(3, 2, 4, device=device, requires_grad=True) for _ in range(3))
    torch.library.opcheck(torch.ops.geot.edge_additive_score.default, (src, dst, a, b, att[:1], 0.2, 2))
    none = src[:0]
    out = torch.ops.geot.edge_additive_score(none, none, a, b, att[:1], 0.2, 2)
    assert out.shape == (0, 2)
    out.sum().backward()
    assert (a.grad == 0).all() and (b.grad == 0).all()
    with pytest.raises(ValueError, match="att must hold one value per feature"):
        torch.ops.geot.edge_additive_score(src, dst, a, b, att, 0.2, 2)
    with pytest.raises(TypeError, match="att must have the dtype"):
        torch.ops.geot.edge_additive_score(src, dst, a, b, att[:1].double(), 0.2, 2)
