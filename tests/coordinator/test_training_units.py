"""Federated fine-tuning, fast parts: shard-wise FedAvg, accounting, data split, rollout, shards."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.training.accounting import RoundAccountant
from coordinator.training.shardavg import (
    ShardLayout,
    shardwise_fedavg,
    shardwise_rescale,
    weighted_average,
)
from devtools.digits import dirichlet_split, load_digits_split


@settings(max_examples=50, deadline=None)
@given(
    st.integers(min_value=1, max_value=5),
    st.lists(st.sets(st.sampled_from([1, 2, 3])), min_size=1, max_size=5),
    st.integers(min_value=0, max_value=2**16),
)
def test_rescaled_all_client_average_equals_shardwise_fedavg(
    _unused: int, shard_sets: list[set[int]], seed: int
) -> None:
    """What the server recovers from the (secure) all-client sum equals averaging each shard over
    the clients that trained it; untrained shards keep their global value."""
    rng = np.random.default_rng(seed)
    layout = ShardLayout.from_counts([1, 2, 3], [2, 1, 2])
    global_arrays = [rng.normal(size=(3, 2)) for _ in layout.shard_of_array]
    trained = [frozenset(s) for s in shard_sets]
    weights = [float(rng.integers(1, 50)) for _ in trained]
    clients = [
        [
            g + rng.normal(size=g.shape) if layout.shard_of_array[k] in t else g.copy()
            for k, g in enumerate(global_arrays)
        ]
        for t in trained
    ]
    recovered = shardwise_rescale(
        global_arrays, weighted_average(clients, weights), weights, trained, layout
    )
    direct = shardwise_fedavg(global_arrays, clients, weights, trained, layout)
    for a, b in zip(recovered, direct, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-9)


def test_flower_strategy_averages_each_shard_over_its_trainers() -> None:
    """The real Flower strategy stack (FedAvg inside ShardwiseStrategy) with fake clients."""
    from flwr.common import Code, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays
    from flwr.server.strategy import FedAvg

    from coordinator.training.strategy import ShardwiseStrategy
    from protocols.training import METRIC_TRAINED_SHARDS

    class FakeProxy:
        def __init__(self, node_id: int) -> None:
            self.node_id = node_id

    layout = ShardLayout.from_counts([2, 3], [1, 1])
    g = [np.zeros(2, dtype=np.float32), np.zeros(3, dtype=np.float32)]
    a = [np.full(2, 4.0, np.float32), np.full(3, 1.0, np.float32)]  # trains 2 and 3
    b = [np.zeros(2, np.float32), np.full(3, 3.0, np.float32)]  # trains 3 only
    strategy = ShardwiseStrategy(FedAvg(), layout, lambda arrays: (0.0, 1.0), min_clients=1)
    strategy.inner.configure_fit = lambda *args: []  # type: ignore[method-assign]
    strategy.configure_fit(1, ndarrays_to_parameters(g), None)  # type: ignore[arg-type]
    results = [
        (
            FakeProxy(i),
            FitRes(
                Status(Code.OK, ""),
                ndarrays_to_parameters(arrays),
                num_examples=n,
                metrics={METRIC_TRAINED_SHARDS: shards},
            ),
        )
        for i, (arrays, n, shards) in enumerate([(a, 10, "2,3"), (b, 30, "3")])
    ]
    params, _ = strategy.aggregate_fit(1, results, [])  # type: ignore[arg-type]
    assert params is not None
    new = parameters_to_ndarrays(params)
    np.testing.assert_allclose(new[0], 4.0, rtol=1e-6)  # only client a trained shard 2
    np.testing.assert_allclose(new[1], (10 * 1.0 + 30 * 3.0) / 40, rtol=1e-6)


@pytest.mark.parametrize("clip", [0.5, 1.0, 4.0])
def test_reported_epsilon_equals_a_direct_accountant_call(clip: float) -> None:
    """Per-round epsilon is Flower's RDP accountant; clipping does not enter it, rounds do."""
    from dp_accounting import dp_event
    from dp_accounting.rdp import RdpAccountant as GoogleRdp
    from flwr.serverapp import GaussianPrivacyEvent

    from coordinator.training.accounting import new_accountant

    z, rounds, clients, delta = 1.0, 3, 3, 1e-5
    ours = RoundAccountant(population=clients, delta=delta)
    eps = [ours.record_round(z, clients) for _ in range(rounds)]
    direct = new_accountant(clients, delta)
    direct.compose(GaussianPrivacyEvent(z, clients, clients), count=rounds)
    assert eps[-1] == pytest.approx(direct.get_epsilon(delta), rel=1e-12)
    google = GoogleRdp()
    google.compose(dp_event.GaussianDpEvent(z), count=rounds)
    assert eps[-1] == pytest.approx(google.get_epsilon(delta), rel=1e-6)
    assert eps == sorted(eps) and eps[0] > 0
    assert eps[-1] == pytest.approx(9.01, abs=0.05)  # NOTES: z=1, 3 rounds, delta=1e-5


def test_dirichlet_split_is_reproducible_and_a_partition() -> None:
    labels = np.repeat(np.arange(10), 50)
    a = dirichlet_split(labels, 3, 0.5, seed=7)
    b = dirichlet_split(labels, 3, 0.5, seed=7)
    c = dirichlet_split(labels, 3, 0.5, seed=8)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c, strict=True))
    assert np.array_equal(np.sort(np.concatenate(a)), np.arange(len(labels)))
    counts = np.array([np.bincount(labels[p], minlength=10) for p in a])
    assert (counts.max(axis=0) > 2 * counts.min(axis=0)).any()  # non-IID


def test_digits_split_keeps_test_aside_and_pretrains_on_half_the_classes() -> None:
    one, two = load_digits_split(seed=0), load_digits_split(seed=0)
    assert np.array_equal(one.test[1], two.test[1])
    assert all(np.array_equal(x[1], y[1]) for x, y in zip(one.clients, two.clients, strict=True))
    assert set(np.unique(one.pretrain[1])) == {0, 1, 2, 3, 4}
    total = len(one.test[1]) + len(one.pretrain[1]) + sum(len(c[1]) for c in one.clients)
    assert total <= 1797 and len(one.test[1]) == 540


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def version_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("torch")
    from devtools.digits import build_cnn, export_onnx, write_initial_version

    out = tmp_path_factory.mktemp("version") / "v0001"
    write_initial_version(export_onnx(build_cnn(seed=1)), out, ["a", "b", "c"])
    return out


def test_rollout_rewrites_only_the_trained_segments(version_dir: Path, tmp_path: Path) -> None:
    from coordinator.training.records import Lineage, TrainingSettings
    from coordinator.training.rollout import write_version
    from coordinator.training.segments import run_chain
    from coordinator.training.version import LINEAGE_FILE, Version

    parent = Version.load(version_dir)
    specs = parent.shard_specs([3])
    old = parent.weights(specs)
    new = [a + 0.25 for a in old]
    settings = TrainingSettings(
        rounds=1,
        secagg=True,
        clipping_norm=1.0,
        noise_multiplier=0.5,
        delta=1e-5,
        trainable_shards=[3],
        local_epochs=1,
        learning_rate=0.01,
        batch_size=8,
        min_clients=3,
    )
    lineage = Lineage(
        parent_version=parent.name,
        parent_model_sha256=parent.manifest.model.sha256,
        trained_segments=[3],
        rounds=1,
        clients_per_round=[3],
        epsilon=1.0,
        delta=1e-5,
        settings=settings,
        metrics=[],
    )
    child = write_version(
        parent,
        {3: dict(zip([p.name for p in specs[0].params], new, strict=True))},
        lineage,
        tmp_path / "v0002",
    )
    for entry in parent.manifest.segments[:3]:
        assert _sha(child.path / entry.file) == _sha(parent.path / entry.file)
    assert child.manifest.segments[3].sha256 != parent.manifest.segments[3].sha256
    for p, c in zip(parent.manifest.segments, child.manifest.segments, strict=True):
        assert (p.inputs, p.outputs) == (c.inputs, c.outputs)
    assert Lineage.from_json((child.path / LINEAGE_FILE).read_bytes()).rounds == 1
    # the new version computes exactly the new weights: head = features @ W.T + b
    x = np.random.default_rng(0).random((5, 1, 8, 8), dtype=np.float32)
    env = run_chain(parent.segments[:3], {"image": x})
    features = env[parent.manifest.segments[3].inputs[0]]
    w, b = new
    expected = features @ w.T + b
    got = run_chain(child.segments, {"image": x})["logits"]
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_torch_rebuild_matches_onnx_runtime_segment_by_segment(version_dir: Path) -> None:
    torch = pytest.importorskip("torch")
    from coordinator.training.segments import run_chain
    from coordinator.training.version import Version
    from edge_agent.training.onnx_torch import OnnxSegmentModule

    version = Version.load(version_dir)
    x = np.random.default_rng(1).random((4, 1, 8, 8), dtype=np.float32)
    env = run_chain(version.segments, {"image": x})
    h = torch.from_numpy(x)
    for seg, entry in zip(version.segments, version.manifest.segments, strict=True):
        with torch.no_grad():
            h = OnnxSegmentModule(seg)(h)
        np.testing.assert_allclose(h.numpy(), env[entry.outputs[0]], rtol=1e-5, atol=1e-5)


def test_budget_picks_a_suffix_and_frozen_features_are_cached(
    version_dir: Path, tmp_path: Path
) -> None:
    pytest.importorskip("torch")
    from coordinator.training.heldout import save_arrays
    from coordinator.training.version import Version
    from edge_agent.training.local import LocalSettings, train_locally
    from protocols.training import TrainPlan

    version = Version.load(version_dir)
    plan = TrainPlan(shards=version.shard_specs([2, 3]), local_epochs=1, batch_size=8)
    rng = np.random.default_rng(2)
    save_arrays(
        tmp_path / "data" / "data.npz",
        rng.random((16, 1, 8, 8), dtype=np.float32),
        rng.integers(0, 10, 16),
    )
    arrays = version.weights(plan.shards)
    results = {}
    for budget in (0, 20_000, 10**9):
        settings = LocalSettings(version_dir, tmp_path / "data", tmp_path / "cache", budget)
        results[budget] = train_locally(plan, arrays, settings, seed=0)
    assert results[0].trained == [] and all(
        np.array_equal(a, b) for a, b in zip(results[0].arrays, arrays, strict=True)
    )
    assert results[20_000].trained == [3]
    assert results[10**9].trained == [2, 3]
    small = results[20_000].arrays
    assert np.array_equal(small[0], arrays[0])  # shard 2 sent back unchanged
    assert not np.array_equal(small[2], arrays[2])
    assert len(list((tmp_path / "cache").glob("features-*.npz"))) == 1


def test_train_command_refuses_bad_arguments() -> None:
    import argparse

    from coordinator.training import cli

    parser = argparse.ArgumentParser(prog="fedshard")
    cli.register(parser.add_subparsers(dest="command", required=True))
    for argv in (
        ["train", "--rounds", "0"],
        ["train", "--clip", "0"],
        ["train", "--clients", "2"],
        ["train", "--version", "v"],
        ["train", "--budgets", "1", "2"],
    ):
        args = parser.parse_args(argv)
        assert args.run(args) == 2, argv
    assert parser.parse_args(["train", "--no-secagg", "--clients", "2"]).run is cli.handler


def test_train_on_a_version_needs_paired_agents_node_keys(
    version_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``fedshard train --version`` admits only paired agents: none paired, no SuperLink."""
    import argparse

    from coordinator.training import cli

    parser = argparse.ArgumentParser(prog="fedshard")
    cli.register(parser.add_subparsers(dest="command", required=True))
    argv = ["train", "--version", str(version_dir), "--test-data", str(tmp_path / "t.npz")]
    argv += ["--state-dir", str(tmp_path / "state"), "--work-dir", str(tmp_path / "work")]
    args = parser.parse_args(argv)
    assert args.run(args) == 1
    assert "0 paired agents have a node key; the run needs 3" in capsys.readouterr().out
    assert not list((tmp_path / "work").rglob("superlink.db"))


def test_secagg_parameters_tolerate_one_dropout_among_three() -> None:
    from coordinator.training.driver import secagg_parameters

    assert secagg_parameters(3) == (3, 2)
    shares, threshold = secagg_parameters(10)
    assert shares == 10 and 2 <= threshold < shares


def test_dp_wrapper_survives_a_failed_client_and_calibrates_to_the_rest() -> None:
    """Flower's stock wrapper drops a round with any failure; ours averages who answered."""
    from flwr.common import Code, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays
    from flwr.server.strategy import FedAvg

    from coordinator.training.strategy import NoiseForActualClients

    wrapper = NoiseForActualClients(
        FedAvg(), noise_multiplier=1e-9, clipping_norm=1.0, num_sampled_clients=3
    )
    results = [
        (None, FitRes(Status(Code.OK, ""), ndarrays_to_parameters([np.full(2, v)]), 1, {}))
        for v in (1.0, 3.0)
    ]
    params, _ = wrapper.aggregate_fit(1, results, [RuntimeError("node lost")])  # type: ignore[arg-type]
    assert params is not None and wrapper.num_sampled_clients == 2
    np.testing.assert_allclose(parameters_to_ndarrays(params)[0], 2.0, atol=1e-6)
