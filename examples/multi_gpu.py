"""GraphSAGE on geot.nn, trained on several GPUs with DistributedDataParallel.

Each step takes a batch of seed nodes; every process trains on its share of
them: it cuts the seeds' 2-hop subgraph out of the full graph (a new
edge_index every step, which geot sorts without a device->host sync), runs
the model on it and takes the loss at its seeds. DDP averages the
gradients, so N processes with B / N seeds each take the same steps as one
process with B seeds. With ``--check``, the first process then trains a
copy of the initial model alone on the full batches and compares the
parameters, and prints the scaling efficiency: the one-process step time
over N times the N-process step time (1.0: perfect scaling).

    torchrun --nproc_per_node=2 examples/multi_gpu.py [--check [--csv out.csv]] [--steps 50] [--nodes 1000000]

NCCL on one GPU per process where there are enough GPUs; otherwise gloo on
the CPU (slow, but it runs anywhere: the tests use it).
"""
import argparse
import copy
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch_geometric.utils import k_hop_subgraph

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import geot.nn  # noqa: E402
from geot.demo import planted_graph  # noqa: E402


class SAGE(torch.nn.Module):
    def __init__(self, in_channels: int, hidden: int, num_classes: int):
        super().__init__()
        self.conv1 = geot.nn.SAGEConv(in_channels, hidden)
        self.conv2 = geot.nn.SAGEConv(hidden, num_classes)

    def forward(self, x, edge_index):
        return self.conv2(self.conv1(x, edge_index).relu(), edge_index)


def set_up() -> torch.device:
    """Joins the process group; this process's device."""
    world, local_rank = int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available() and torch.cuda.device_count() >= world:
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl")
        return torch.device("cuda", local_rank)
    dist.init_process_group("gloo")
    return torch.device("cpu")


def seed_batches(num_nodes: int, batch: int, steps: int):
    """The seeds of each step (the same in every process: one generator seed)."""
    gen = torch.Generator().manual_seed(1)
    return [torch.randperm(num_nodes, generator=gen)[:batch] for _ in range(steps)]


def train_step(model, optimizer, data, seeds: torch.Tensor) -> float:
    """One step on the seeds' 2-hop subgraph: the model's output at the seeds is its output on the full graph."""
    subset, edge_index, at_seeds, _ = k_hop_subgraph(seeds, 2, data["edge_index"], relabel_nodes=True,
                                                     num_nodes=data["num_nodes"])
    optimizer.zero_grad()
    out = model(data["x"].index_select(0, subset), edge_index)[at_seeds]
    loss = F.cross_entropy(out, data["y"].index_select(0, seeds))
    loss.backward()
    optimizer.step()
    return loss.item()


def train(model, data, batches, share, device) -> float:
    """Trains on each batch's share (a function of the batch); ms per step after the first two steps."""
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    start = None
    for step, batch in enumerate(batches):
        if step == min(2, len(batches) - 1):
            _sync(device)
            start = time.perf_counter()
        train_step(model, optimizer, data, share(batch).to(device))
    _sync(device)
    return (time.perf_counter() - start) * 1e3 / max(len(batches) - 2, 1)


def append_row(path: str, row: dict) -> None:
    """Appends row to the CSV at path (its header first where the file is new)."""
    import csv
    new_file = not os.path.exists(path)
    with open(path, "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(row))
        if new_file:
            writer.writeheader()
        writer.writerow(row)


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1_000_000, help="of the generated graph (10 edges per node)")
    parser.add_argument("--batch", type=int, default=2048, help="seed nodes per step, over all processes")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--check", action="store_true",
                        help="then train alone on the full batches: same parameters? scaling efficiency")
    parser.add_argument("--csv", default=None, help="with --check: append the result as a row to this CSV "
                        "(bench/report.py --add multi_gpu takes it)")
    args = parser.parse_args()
    device = set_up()
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.batch % world:
        parser.error(f"--batch {args.batch} must split evenly over {world} processes")
    data = planted_graph(args.nodes, num_classes=16, avg_degree=10, seed=0)
    data = {key: value.to(device) if isinstance(value, torch.Tensor) else value for key, value in data.items()}
    torch.manual_seed(0)
    model = SAGE(data["x"].size(1), args.hidden, 16).to(device)
    initial = copy.deepcopy(model)
    batches = seed_batches(args.nodes, args.batch, args.steps)
    ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    ms = train(ddp, data, batches, lambda seeds: seeds.chunk(world)[rank], device)
    if rank == 0:
        print(f"{world} processes ({device.type}): {ms:.2f} ms per step, {args.batch // world} seeds each")
    if args.check:
        if rank == 0:
            single_ms = train(initial, data, batches, lambda seeds: seeds, device)
            gap = max((a - b).abs().max().item() for a, b in zip(model.parameters(), initial.parameters()))
            print(f"1 process: {single_ms:.2f} ms per step, {args.batch} seeds")
            print(f"scaling efficiency: {single_ms / (world * ms):.2f}")
            print(f"parameters {'match' if gap < 1e-3 else 'DIFFER'} after {args.steps} steps (max gap {gap:.1e})")
            if args.csv:
                append_row(args.csv, dict(gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                                          nodes=args.nodes, batch=args.batch, processes=world, hidden=args.hidden,
                                          steps=args.steps, ms=ms, single_ms=single_ms,
                                          efficiency=single_ms / (world * ms), max_param_gap=gap))
        dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
