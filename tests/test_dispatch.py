"""The Autograd kernel of geot's ops (csrc/python_autograd.cpp): calls that
record a gradient run the Python formula, the rest stay in C++."""
import contextlib

import pytest
import torch

import geot
from geot import _C, _ops
from reference import random_index, random_src


def test_every_listed_op_has_its_formula():
    assert sorted(_C.python_autograd_ops()) == sorted(_ops.FORMULAS)


@contextlib.contextmanager
def counting_formula_calls(name):
    """A list that gets an entry per call of the op's Python formula."""
    calls, formula = [], _ops.FORMULAS[name]

    def counted(*args):
        calls.append(1)
        return formula.apply(*args)

    _C.set_python_autograd(name, counted)
    try:
        yield calls
    finally:
        _C.set_python_autograd(name, formula.apply)


def _graph(device):
    """120 edges from 15 sources into 20 destinations, sorted by destination."""
    dst = random_index(120, 20)
    return torch.randint(0, 15, (120,)).to(device), dst.to(device)


def _reduce(src, dst, x):
    return torch.ops.geot.index_segment_reduce(src, dst, x, None, 20, "sum")


def test_calls_recording_no_gradient_skip_the_formula(device):
    src, dst = _graph(device)
    x = random_src(15, (8,), torch.float32, device)
    with counting_formula_calls("index_segment_reduce") as calls:
        with torch.no_grad():
            _reduce(src, dst, x.requires_grad_())
        assert not calls
        out = _reduce(src, dst, x.detach())
        assert not calls and out.grad_fn is None
        out = _reduce(src, dst, x)
        assert len(calls) == 1 and out.grad_fn is not None
    out.sum().backward()
    expected = torch.zeros_like(x).index_add_(0, src.long(), torch.ones(src.numel(), 8, device=device))
    torch.testing.assert_close(x.grad, expected)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_training_runs_no_formula(device, backend):
    """A compiled graph's forward and backward run with grad mode off: after
    the tracing call, its geot ops never enter Python."""
    torch._dynamo.reset()
    src, dst = _graph(device)
    t = geot.transpose_index(src, dst)
    w = random_src(src.numel(), (), torch.float32, device)

    def step(x):
        h = geot.index_weight_segment_reduce(src, dst, w, x, "sum", 20, transposed=t)
        return geot.segment_reduce(dst, h.index_select(0, dst.long()), "mean", 20).relu().sum()

    compiled = torch.compile(step, backend=backend, fullgraph=True)
    x = random_src(15, (8,), torch.float32, device).requires_grad_()
    compiled(x).backward()
    first = x.grad.clone()
    with counting_formula_calls("index_segment_reduce") as fused, counting_formula_calls("segment_reduce") as plain:
        x.grad = None
        compiled(x).backward()
    assert not fused and not plain
    torch.testing.assert_close(x.grad, first)
    x.grad = None
    step(x).backward()
    torch.testing.assert_close(first, x.grad, rtol=1e-5, atol=1e-5)


def test_compiled_inference_runs_no_formula(device):
    """Under no_grad no call records a gradient, from tracing on."""
    torch._dynamo.reset()
    src, dst = _graph(device)
    x = random_src(15, (8,), torch.float32, device).requires_grad_()
    compiled = torch.compile(lambda x: _reduce(src, dst, x).relu(), fullgraph=True)
    with counting_formula_calls("index_segment_reduce") as calls, torch.no_grad():
        outs = [compiled(x) for _ in range(2)]
        assert not calls
        torch.testing.assert_close(outs[1], _reduce(src, dst, x).relu())
