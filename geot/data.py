"""Finding and loading the shared graph files (``<name>.npz``, layout in
``../shared/data/MANIFEST.md``): edge_index [2, E] sorted by destination,
num_nodes and, where present, features, labels and the Planetoid split."""
import os
from typing import Dict, List, Optional

import numpy as np
import torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def in_checkout() -> bool:
    """Whether geot is imported from a source checkout (not an installed wheel)."""
    return os.path.isfile(os.path.join(REPO_ROOT, "setup.py")) and os.path.isdir(os.path.join(REPO_ROOT, "csrc"))


def data_dirs(data_dir: Optional[str] = None) -> List[str]:
    """Directories searched for <name>.npz, in order: data_dir, $GEOT_DATA,
    and in a source checkout <checkout>/../shared/data and <checkout>/.data."""
    dirs = [data_dir] if data_dir else []
    if os.environ.get("GEOT_DATA"):
        dirs.append(os.environ["GEOT_DATA"])
    if in_checkout():
        dirs.append(os.path.normpath(os.path.join(REPO_ROOT, "..", "shared", "data")))
        dirs.append(os.path.join(REPO_ROOT, ".data"))
    return dirs


def find_graph_file(name: str, data_dir: Optional[str] = None) -> Optional[str]:
    for directory in data_dirs(data_dir):
        path = os.path.join(directory, f"{name}.npz")
        if os.path.isfile(path):
            return path
    return None


def load_dataset(name: str, data_dir: Optional[str] = None) -> Optional[Dict[str, torch.Tensor]]:
    """A shared graph as CPU tensors, or None when no file is found.

    Keys: edge_index, num_nodes (int), and where the file has them x (dense
    float32, also when stored as CSR parts), y, train_mask, val_mask, test_mask.
    """
    path = find_graph_file(name, data_dir)
    if path is None:
        return None
    with np.load(path) as z:
        data = {"edge_index": torch.from_numpy(np.asarray(z["edge_index"], dtype=np.int64)),
                "num_nodes": int(z["num_nodes"])}
        for key in ("x", "y", "train_mask", "val_mask", "test_mask"):
            if key in z:
                data[key] = torch.from_numpy(z[key])
        if "x_indptr" in z:
            data["x"] = torch.from_numpy(_dense_from_csr(z["x_indptr"], z["x_indices"], z["x_data"], z["x_shape"]))
    return data


def _dense_from_csr(indptr, indices, values, shape) -> np.ndarray:
    dense = np.zeros(tuple(int(v) for v in shape), dtype=np.float32)
    rows = np.repeat(np.arange(dense.shape[0]), np.diff(indptr))
    dense[rows, indices] = values
    return dense
