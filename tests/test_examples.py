"""The example layers (examples/rgcn.py, examples/gat.py) against their
plain-torch versions: outputs and parameter gradients, on CPU; and the
multi-GPU example (examples/multi_gpu.py) against one process."""
import os
import sys
import warnings

import pytest
import torch

import geot.nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))

import gat  # noqa: E402
import rgcn  # noqa: E402


def _assert_same_grads(layer, loss_fn, ref_fn):
    loss_fn().backward()
    grads = {name: p.grad.clone() for name, p in layer.named_parameters()}
    layer.zero_grad()
    ref_fn().backward()
    for name, p in layer.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-9, atol=1e-9, msg=f"gradient of {name}")


def test_rgcn_matches_plain_torch():
    edge_index, edge_type = rgcn.random_graph(60, 400, 4)
    edge_type[edge_type == 2] = 3  # relation 2 without edges
    x = torch.randn(60, 7, dtype=torch.float64)
    layer = rgcn.RGCNConv(7, 5, 4).double()
    out = layer(x, edge_index, edge_type)
    torch.testing.assert_close(out, rgcn.rgcn_reference(layer, x, edge_index, edge_type))
    g = torch.randn_like(out)
    _assert_same_grads(layer, lambda: (layer(x, edge_index, edge_type) * g).sum(),
                       lambda: (rgcn.rgcn_reference(layer, x, edge_index, edge_type) * g).sum())


def test_gat_matches_plain_torch():
    N, E = 50, 300
    dst = torch.randint(0, N, (E,)).sort().values
    edge_index = torch.stack([torch.randint(0, N, (E,)), dst])
    x = torch.randn(N, 6, dtype=torch.float64)
    layer = gat.GATConv(6, 3, heads=4).double()
    out = layer(x, edge_index)
    torch.testing.assert_close(out, gat.gat_reference(layer, x, edge_index))
    g = torch.randn_like(out)
    _assert_same_grads(layer, lambda: (layer(x, edge_index) * g).sum(),
                       lambda: (gat.gat_reference(layer, x, edge_index) * g).sum())


def test_multi_gpu_example_matches_one_process(tmp_path):
    """examples/multi_gpu.py: DDP over 2 processes (NCCL where 2 GPUs are
    visible, else gloo on the CPU) takes the steps one process takes alone,
    and --csv keeps the result as a row bench/report.py reads."""
    import subprocess
    import pandas as pd
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "multi_gpu.py")
    csv_path = tmp_path / "multi_gpu.csv"
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", script,
         "--nodes", "20000", "--batch", "256", "--steps", "6", "--hidden", "64", "--check", "--csv", str(csv_path)],
        capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "parameters match after 6 steps" in result.stdout, result.stdout
    row = pd.read_csv(csv_path).iloc[0]
    assert (row["processes"], row["batch"], row["steps"]) == (2, 256, 6)
    assert row["efficiency"] == pytest.approx(row["single_ms"] / (2 * row["ms"])) and row["max_param_gap"] < 1e-3


def test_hetero_rgat_example_learns():
    """examples/hetero_rgat.py: both models fit the planted labels (messages must pass to learn them)."""
    import hetero_rgat
    for model in ("rgat", "hgt"):
        losses, accuracy = hetero_rgat.train(model, epochs=30)
        assert losses[-1] < 0.5 * losses[0] and accuracy > 0.8, (model, losses[0], losses[-1], accuracy)


def test_hetero_rgat_example_learns_compiled():
    """examples/hetero_rgat.py --compile: both models train under torch.compile on geot (no fallback to
    PyG's forward) and fit the planted labels."""
    import hetero_rgat
    for model in ("rgat", "hgt"):
        torch._dynamo.reset()
        with warnings.catch_warnings():
            warnings.simplefilter("error", geot.nn.GeotFallbackWarning)
            losses, accuracy = hetero_rgat.train(model, epochs=30, compile_backend="aot_eager")
        assert losses[-1] < 0.5 * losses[0] and accuracy > 0.8, (model, losses[0], losses[-1], accuracy)
