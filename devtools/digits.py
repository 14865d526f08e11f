"""The reference fine-tuning task: scikit-learn's digits, a small CNN, cut into four segments.

- The data: 30 % held out on the coordinator; from the rest, a public pre-training pool that
  holds only classes 0-4, and the remainder split across the clients non-IID (a Dirichlet(alpha)
  share of every class per client, fixed seed).
- The model is built here with torch, pre-trained on the public pool (half of the classes, so
  fine-tuning has something to gain), exported with ``torch.onnx.export`` and cut before every
  weighted layer: ``conv1`` | ``conv2, pool, flatten`` | ``fc1`` | ``fc2``.

The agents never import this module: they rebuild trainable shards from the ONNX segments
(:mod:`edge_agent.training.onnx_torch`), so the architecture is written down once.
"""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from coordinator.training.cli import LocalTask
from coordinator.training.heldout import save_arrays
from coordinator.training.segments import cut_chain, trainable_names
from coordinator.training.version import Version
from hostkit.files import write_atomic
from protocols.manifest import MANIFEST_FILE, Manifest, ModelInfo, SegmentEntry, TensorInfo
from protocols.plan import Objective
from protocols.training import TRAIN_DATA_FILE, TrainingTargetSpec

TEST_FILE = "test.npz"
MODEL_FILE = "digits-cnn.onnx"
"""The pre-trained model as one ONNX file (what ``fedshard deploy`` or the API deploys)."""
PRETRAIN_CLASSES = 5
INPUT_NAME = "image"
OUTPUT_NAME = "logits"


@dataclass(frozen=True)
class DigitsSplit:
    """Held-out test set, public pre-training pool and one private set per client."""

    test: tuple[np.ndarray, np.ndarray]
    pretrain: tuple[np.ndarray, np.ndarray]
    clients: list[tuple[np.ndarray, np.ndarray]]


def load_digits_split(
    num_clients: int = 3, alpha: float = 0.5, seed: int = 0, pretrain_fraction: float = 0.25
) -> DigitsSplit:
    """Split scikit-learn's bundled digits (no download) as described in the module doc."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.images.astype(np.float32) / 16.0)[:, None, :, :]
    y = digits.target.astype(np.int64)
    x_rest, x_test, y_rest, y_test = train_test_split(
        x, y, test_size=0.3, random_state=seed, stratify=y
    )
    x_pool, x_priv, y_pool, y_priv = train_test_split(
        x_rest, y_rest, train_size=pretrain_fraction, random_state=seed, stratify=y_rest
    )
    keep = y_pool < PRETRAIN_CLASSES
    parts = dirichlet_split(y_priv, num_clients, alpha, seed)
    return DigitsSplit(
        test=(x_test, y_test),
        pretrain=(x_pool[keep], y_pool[keep]),
        clients=[(x_priv[p], y_priv[p]) for p in parts],
    )


def dirichlet_split(
    labels: np.ndarray, num_clients: int, alpha: float, seed: int, min_size: int = 10
) -> list[np.ndarray]:
    """Indices per client: each class shared out by a Dirichlet(alpha) draw (reproducible).

    Draws again (same generator) until every client has at least ``min_size`` examples.
    """
    rng = np.random.default_rng(seed)
    for _ in range(100):
        parts: list[list[int]] = [[] for _ in range(num_clients)]
        for cls in np.unique(labels):
            idx = rng.permutation(np.flatnonzero(labels == cls))
            shares = rng.dirichlet(np.full(num_clients, alpha))
            cuts = (np.cumsum(shares)[:-1] * len(idx)).astype(int)
            for client, chunk in enumerate(np.split(idx, cuts)):
                parts[client].extend(chunk.tolist())
        if min(len(p) for p in parts) >= min_size:
            return [np.sort(np.array(p, dtype=np.int64)) for p in parts]
    raise ValueError(f"cannot give every client {min_size} examples with alpha={alpha}")


def build_cnn(seed: int = 0):  # type: ignore[no-untyped-def]
    """The small CNN (torch ``nn.Module``): 2 conv layers, 2 linear layers, 10 classes."""
    import torch
    from torch import nn

    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(256, 32),
        nn.ReLU(),
        nn.Linear(32, 10),
    )


def pretrain(model, x: np.ndarray, y: np.ndarray, epochs: int = 30, seed: int = 0) -> None:  # type: ignore[no-untyped-def]
    """Plain Adam training on the public pool (which holds only the first classes)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    model.train()
    for _ in range(epochs):
        order = torch.randperm(len(xt), generator=gen)
        for start in range(0, len(xt), 32):
            batch = order[start : start + 32]
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(xt[batch]), yt[batch])
            loss.backward()  # type: ignore[no-untyped-call]
            opt.step()
    model.eval()


def export_onnx(model) -> onnx.ModelProto:  # type: ignore[no-untyped-def]
    """``torch.onnx.export`` with a dynamic batch dimension."""
    import torch

    buf = io.BytesIO()
    torch.onnx.export(
        model,
        (torch.zeros(2, 1, 8, 8),),
        buf,  # type: ignore[arg-type]
        input_names=[INPUT_NAME],
        output_names=[OUTPUT_NAME],
        dynamic_axes={INPUT_NAME: {0: "batch"}, OUTPUT_NAME: {0: "batch"}},
        dynamo=False,
    )
    return onnx.load_from_string(buf.getvalue())


def layer_boundaries(model: onnx.ModelProto) -> list[str]:
    """Cut before every weighted node but the first: the tensor feeding it is a boundary.

    Found from the graph's structure (which nodes read an initializer), never from names.
    """
    weights = {t.name for t in model.graph.initializer if t.data_type == onnx.TensorProto.FLOAT}
    boundaries = []
    seen_weighted = False
    for node in model.graph.node:
        if any(name in weights for name in node.input):
            if seen_weighted:
                boundaries.append(node.input[0])
            seen_weighted = True
    return boundaries


def write_initial_version(
    model: onnx.ModelProto,
    out_dir: Path,
    devices: list[str],
    name: str = "digits-cnn",
    boundaries: list[str] | None = None,
) -> Version:
    """Cut ``model`` at ``boundaries`` (default: every layer, :func:`layer_boundaries`) and
    write a version directory with a manifest; segment ``i`` goes to ``devices[i % n]``."""
    segments = cut_chain(model, layer_boundaries(model) if boundaries is None else boundaries)
    full = model.SerializeToString()
    entries = []
    for i, seg in enumerate(segments):
        data = seg.SerializeToString()
        file = f"segment_{i}.onnx"
        write_atomic(out_dir / file, data)
        params = sum(
            int(np.prod(t.dims)) * 4
            for t in seg.graph.initializer
            if t.name in trainable_names(seg)
        )
        entries.append(
            SegmentEntry(
                index=i,
                device=devices[i % len(devices)],
                file=file,
                sha256=hashlib.sha256(data).hexdigest(),
                inputs=[v.name for v in seg.graph.input],
                outputs=[v.name for v in seg.graph.output],
                param_bytes=params,
                predicted_memory_bytes=params,
                predicted_compute_s=0.0,
            )
        )
    manifest = Manifest(
        model=ModelInfo(
            name=name,
            sha256=hashlib.sha256(full).hexdigest(),
            param_bytes=sum(e.param_bytes for e in entries),
            inputs=[TensorInfo(name=INPUT_NAME, dtype="float32", shape=["batch", 1, 8, 8])],
            outputs=[TensorInfo(name=OUTPUT_NAME, dtype="float32", shape=["batch", 10])],
        ),
        objective=Objective.THROUGHPUT,
        bottleneck_s=0.0,
        latency_s=0.0,
        segments=entries,
    )
    write_atomic(out_dir / MANIFEST_FILE, manifest.to_json().encode())
    return Version.load(out_dir)


@dataclass(frozen=True)
class PreparedTask:
    """Everything a run needs on disk: first version, test set, one data dir per client, and
    the pre-trained model as one ONNX file."""

    version_dir: Path
    test_file: Path
    client_dirs: list[Path]
    model_file: Path


def prepare_task(
    root: Path, num_clients: int = 3, alpha: float = 0.5, seed: int = 0, pretrain_epochs: int = 30
) -> PreparedTask:
    """Build, pre-train, export and cut the CNN; write the data (``root/clients/<i>``)."""
    split = load_digits_split(num_clients, alpha, seed)
    model = build_cnn(seed)
    pretrain(model, *split.pretrain, epochs=pretrain_epochs, seed=seed)
    exported = export_onnx(model)
    write_atomic(root / MODEL_FILE, exported.SerializeToString())
    version = write_initial_version(
        exported, root / "versions" / "v0001", [f"agent-{i}" for i in range(num_clients)]
    )
    save_arrays(root / TEST_FILE, *split.test)
    dirs = []
    for i, (x, y) in enumerate(split.clients):
        save_arrays(root / "clients" / str(i) / TRAIN_DATA_FILE, x, y)
        dirs.append(root / "clients" / str(i))
    return PreparedTask(version.path, root / TEST_FILE, dirs, root / MODEL_FILE)


def reference_task(root: Path, num_clients: int) -> LocalTask:
    """:func:`prepare_task` as ``fedshard train`` runs it without ``--version``."""
    task = prepare_task(root, num_clients=num_clients)
    return LocalTask(task.version_dir, root / TEST_FILE, task.client_dirs)


REFERENCE_MODEL_ID = "digits-cnn"
LOCAL_BUDGETS = (50_000, 1 << 30, 1 << 30)
"""The first local device fits only the head shard's training; the others fit more."""
READY_FILE = "ready"
TARGET_FILE = "target.json"


def reference_task_dir(state_dir: Path) -> Path:
    """Where the reference task lives under a coordinator's state dir."""
    return state_dir / "training" / "task"


def prepared_task(root: Path) -> tuple[Path, Path, list[Path]]:
    """(first version, held-out file, client data dirs) of the reference task, built once."""
    if not (root / READY_FILE).is_file():
        task = prepare_task(root, num_clients=len(LOCAL_BUDGETS))
        (root / READY_FILE).write_text("prepared\n")
        return task.version_dir, task.test_file, task.client_dirs
    clients = [root / "clients" / str(i) for i in range(len(LOCAL_BUDGETS))]
    return root / "versions" / "v0001", root / TEST_FILE, clients


def write_reference_target(state_dir: Path) -> Path:
    """Prepare the reference task under ``state_dir`` (once) and write its target file.

    The file is what ``fedshard coordinator --training-target`` reads: the digits CNN, served as
    :data:`REFERENCE_MODEL_ID` when deployed (``STATE/training/task/digits-cnn.onnx``), trained
    by one local SuperNode per non-IID data split.
    """
    root = reference_task_dir(state_dir)
    version_dir, test_file, clients = prepared_task(root)
    spec = TrainingTargetSpec(
        model_id=REFERENCE_MODEL_ID,
        version_dir=str(version_dir.relative_to(root)),
        test_file=str(test_file.relative_to(root)),
        client_data=[str(c.relative_to(root)) for c in clients],
        budgets=list(LOCAL_BUDGETS),
    )
    write_atomic(root / TARGET_FILE, spec.model_dump_json(indent=2).encode())
    return root / TARGET_FILE
