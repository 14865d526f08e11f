"""LoRA runs of served models, fast parts: the request's validation and defaults, the API's typed
errors, the LoRA ServerApp's strategy (an empty round fails the run, per-device epsilon and
token-weighted loss are recorded), the API's view of the record, plan settings, and dispatch."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient
from flwr.common import Code, FitRes, Status, ndarrays_to_parameters
from pydantic import ValidationError

from coordinator.errors import UnknownModelError
from coordinator.fleet.registry import DeviceRegistry
from coordinator.training.errors import LoraTargetError, TrainingRunError
from coordinator.training.lora.plan import first_layer_of, lora_settings
from coordinator.training.lora.records import LoraRecord, LoraRound, LoraRunConfig, token_weighted
from coordinator.training.lora.runner import _RoundReports, check_converged, run_round
from coordinator.training.lora.server_app import LoraFedAvg
from coordinator.training.lora.target import MethodRunner
from coordinator.training.manager import RunReporter, TrainingRuns
from coordinator.trust.ca import CertificateAuthority
from coordinator.trust.pairing import Pairing
from protocols.lora import AdapterSpec, LoraPlan, SegmentRef
from protocols.training import (
    LoraOptions,
    RunRound,
    TrainingRunRequest,
    TrainingTargetSpec,
)

TOKEN = "t0ken"
SHA = "0" * 64


def test_a_request_naming_a_model_is_a_lora_run() -> None:
    req = TrainingRunRequest(rounds=2, model="tiny-llama")
    assert req.resolved_method == "lora" and req.lora is None
    assert TrainingRunRequest(rounds=2).resolved_method == "shards"
    with pytest.raises(ValidationError, match="needs the served model"):
        TrainingRunRequest(rounds=1, method="lora")
    with pytest.raises(ValidationError, match="method lora"):
        TrainingRunRequest(rounds=1, method="shards", model="m")
    with pytest.raises(ValidationError, match="rollout_every"):
        TrainingRunRequest(rounds=2, model="m", rollout_every=1)
    with pytest.raises(ValidationError):
        TrainingRunRequest(rounds=1, model="m", lora={"rank": 0})  # type: ignore[arg-type]
    with pytest.raises(ValidationError):
        TrainingRunRequest(rounds=1, model="m", lora={"rank": 65})  # type: ignore[arg-type]


def test_lora_settings_defaults_and_refusals() -> None:
    s = lora_settings(None)
    assert (s.rank, s.alpha, s.scale) == (8, 16.0, 2.0)
    assert lora_settings(LoraOptions(rank=4, alpha=4.0)).scale == 1.0
    assert lora_settings(LoraOptions(target_modules=["q_proj"])).target_modules == ["q_proj"]
    with pytest.raises(LoraTargetError, match="unknown target modules"):
        lora_settings(LoraOptions(target_modules=["attn.c_attn"]))
    assert first_layer_of(None, 4) == 2
    assert first_layer_of(LoraOptions(first_layer=0), 4) == 0
    with pytest.raises(LoraTargetError, match="has 4 layers"):
        first_layer_of(LoraOptions(first_layer=4), 4)


def test_a_target_may_list_only_text_devices() -> None:
    spec = TrainingTargetSpec(model_id="m", text_client_data=["a", "b", "c"])
    assert spec.version_dir is None
    with pytest.raises(ValidationError, match="go together"):
        TrainingTargetSpec(model_id="m", version_dir="v", text_client_data=["a"])
    with pytest.raises(ValidationError, match="text_client_data"):
        TrainingTargetSpec(model_id="m")


class _Proxy:
    def __init__(self, node_id: int) -> None:
        self.node_id = node_id
        self.cid = str(node_id)


def _fit(node: int, loss: float, tokens: int, eps: float, arrays: list[np.ndarray]) -> Any:
    metrics = {
        "held-out-loss": loss,
        "held-out-tokens": tokens,
        "epsilon": eps,
        "train-loss": loss,
        "upload-bytes": 100.0,
        "trained-shard-bytes": 10_000.0,
    }
    res = FitRes(Status(Code.OK, ""), ndarrays_to_parameters(arrays), 1, metrics)
    return (_Proxy(node), res)


def _plan() -> LoraPlan:
    return LoraPlan(
        run="r",
        architecture="LlamaForCausalLM",
        config="{}",
        first_layer=0,
        boundary="h",
        segments=[SegmentRef(index=0, sha256=SHA)],
        trainable=[0],
        weight_map={},
        adapters=[
            AdapterSpec(module="model.layers.0.self_attn.q_proj", out_features=3, in_features=2)
        ],
        tokenizer_sha256=SHA,
    )


def _config(tmp: Path, secagg: bool = False) -> LoraRunConfig:
    return LoraRunConfig(
        plan_file=str(tmp / "plan.json"),
        record_file=str(tmp / "record.json"),
        weights_file=str(tmp / "w.npz"),
        rounds=2,
        secagg=secagg,
        num_shares=3,
        reconstruction_threshold=2,
        stage_timeout_s=10,
        min_clients=2,
    )


def test_the_strategy_averages_adapters_and_records_each_device(tmp_path: Path) -> None:
    strategy = LoraFedAvg(_plan(), _config(tmp_path), tmp_path / "record.json")
    a = [np.ones((8, 2), np.float32), np.zeros((3, 8), np.float32)]
    b = [3 * np.ones((8, 2), np.float32), np.ones((3, 8), np.float32)]
    results = [_fit(1, 2.0, 100, 1.5, a), _fit(2, 4.0, 300, 2.5, b)]
    params, _ = strategy.aggregate_fit(1, results, [])
    assert params is not None
    np.testing.assert_allclose(strategy.latest[0], 2.0)
    saved = LoraRecord.from_json((tmp_path / "record.json").read_bytes())
    [r] = saved.rounds
    assert r.held_out_loss == pytest.approx(3.5) and r.held_out_tokens == 400
    assert r.epsilon == {"1": 1.5, "2": 2.5} and r.clients == 2
    assert saved.epsilon_per_device == [1.5, 2.5] and saved.baseline_loss == pytest.approx(3.5)
    strategy.check_recorded(1)


def test_under_dp_and_secagg_the_held_out_figures_come_only_from_the_aggregate(
    tmp_path: Path,
) -> None:
    """A DP run under SecAgg+: each round's held-out loss and recall@1 are read from the
    aggregated statistics array (stripped from the adapters); the round after the last trains
    nothing and gives the final figures the same way; no clear evaluation is asked for."""
    from flwr.common import FitIns
    from flwr.server.client_manager import SimpleClientManager

    from protocols.lora import EVALUATE_ONLY_KEY, RecordDp, stats_array

    plan = _plan().model_copy(update={"dp": RecordDp()})
    strategy = LoraFedAvg(plan, _config(tmp_path, secagg=True), tmp_path / "record.json")
    assert strategy.flower_rounds == 3  # two rounds and the evaluate-only one
    adapters = [np.ones((8, 2), np.float32), np.zeros((3, 8), np.float32)]

    def aggregated(loss: float, recall: float) -> list[Any]:
        # what SecAgg+ hands the strategy: every result holds the unmasked mean, and only the
        # metrics the table lets leave a device under DP (no held-out figure among them)
        stats = np.mean(
            [stats_array(loss - 1, recall - 0.1), stats_array(loss + 1, recall + 0.1)], 0
        )
        arrays = [*adapters, stats]
        res = [FitRes(Status(Code.OK, ""), ndarrays_to_parameters(arrays), 1, {"epsilon": 1.0})
               for _ in range(2)]  # fmt: skip
        return [(_Proxy(n), r) for n, r in zip((1, 2), res, strict=True)]

    strategy.aggregate_fit(1, aggregated(4.0, 0.4), [])
    assert len(strategy.latest) == 2  # the statistics are not an adapter
    [r] = strategy.record.rounds
    assert r.held_out_loss == pytest.approx(4.0, rel=1e-5)
    assert r.held_out_recall == pytest.approx(0.4, rel=1e-5) and r.held_out_tokens == 0

    class Manager(SimpleClientManager):
        def num_available(self) -> int:
            return 2

        def sample(self, *args: Any, **kwargs: Any) -> list[Any]:
            return [_Proxy(1), _Proxy(2)]

    params, manager = ndarrays_to_parameters(adapters), Manager()
    strategy.aggregate_fit(2, aggregated(3.0, 0.5), [])
    second = strategy.configure_fit(2, params, manager)
    assert not any(EVALUATE_ONLY_KEY in i.config for _, i in second)
    assert strategy.configure_evaluate(2, params, manager) == []  # no clear evaluation
    final = strategy.configure_fit(3, params, manager)
    assert all(isinstance(i, FitIns) and i.config[EVALUATE_ONLY_KEY] is True for _, i in final)
    latest = strategy.latest
    strategy.aggregate_fit(3, aggregated(2.5, 0.6), [])
    assert strategy.latest is latest and len(strategy.record.rounds) == 2  # nothing trained
    saved = LoraRecord.from_json((tmp_path / "record.json").read_bytes())
    assert saved.final_loss == pytest.approx(2.5, rel=1e-5)
    assert saved.final_recall == pytest.approx(0.6, rel=1e-5)
    assert saved.baseline_recall == pytest.approx(0.4, rel=1e-5)
    # without DP nothing changes: two rounds, the final evaluation in clear
    plain = LoraFedAvg(_plan(), _config(tmp_path, secagg=True), None)
    assert plain.flower_rounds == 2 and not plain.evaluates(3)


def test_a_round_without_a_successful_client_fails_the_run(tmp_path: Path) -> None:
    strategy = LoraFedAvg(_plan(), _config(tmp_path), tmp_path / "record.json")
    with pytest.raises(TrainingRunError, match="0 client"):
        strategy.aggregate_fit(1, [], [RuntimeError("out of memory")])
    saved = LoraRecord.from_json((tmp_path / "record.json").read_bytes())
    assert saved.error is not None and "out of memory" in saved.error and not saved.finished
    fresh = LoraFedAvg(_plan(), _config(tmp_path), None)
    with pytest.raises(TrainingRunError, match="round 1 produced no aggregate"):
        fresh.check_recorded(1)  # SecAgg+ ended round 1 before aggregating


def test_rounds_are_reported_with_the_loss_after_them() -> None:
    def rnd(n: int, loss: float) -> LoraRound:
        eps = {"1": 0.5 * n, "2": 0.4 * n}
        return LoraRound(
            round=n, clients=2, failures=0, held_out_loss=loss, held_out_tokens=10,
            train_loss=loss, epsilon=eps, upload_bytes_per_client=50.0,
            trained_shard_bytes=1e4, seconds=1.0,
        )  # fmt: skip

    running = LoraRecord(rounds=[rnd(1, 4.0), rnd(2, 3.0)])
    sent: list[RunRound] = []

    class Report:
        def round(self, metrics: RunRound) -> None:
            sent.append(metrics)

    reports = _RoundReports(Report())  # type: ignore[arg-type]
    reports.update(running)
    assert [r.round for r in sent] == [1] and sent[0].loss == 3.0
    reports.update(running.model_copy(update={"finished": True, "final_loss": 2.5}))
    assert [r.round for r in sent] == [1, 2] and sent[1].loss == 2.5
    assert sent[1].epsilon == 1.0 and sent[1].bytes_uploaded == 100 and sent[1].accuracy is None
    assert run_round(running, 0).loss == 3.0
    assert token_weighted([]) == (None, 0)


class _Recording:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def run(
        self, run_id: str, request: TrainingRunRequest, report: RunReporter, stop: threading.Event
    ) -> None:
        self.calls.append(request.resolved_method)


def test_requests_go_to_the_runner_of_their_method() -> None:
    shards, lora = _Recording(), _Recording()
    runner = MethodRunner(shards, lora)
    stop = threading.Event()
    runner.run("a", TrainingRunRequest(rounds=1), None, stop)  # type: ignore[arg-type]
    runner.run("b", TrainingRunRequest(rounds=1, model="m"), None, stop)  # type: ignore[arg-type]
    assert shards.calls == ["shards"] and lora.calls == ["lora"]
    with pytest.raises(LoraTargetError):
        MethodRunner(shards, None).run("c", TrainingRunRequest(rounds=1, model="m"), None, stop)  # type: ignore[arg-type]


def test_the_api_refuses_unknown_and_untrainable_models_with_typed_errors(tmp_path: Path) -> None:
    from coordinator.http.app import Services, create_app

    def ready(request: TrainingRunRequest) -> None:
        if request.model == "nope":
            raise UnknownModelError("no model 'nope' is deployed")
        if request.model == "minilm":
            raise LoraTargetError("minilm is not a fedshard decoder export")

    runs = TrainingRuns(_Recording(), ready=ready)
    pairing = Pairing(tmp_path, CertificateAuthority.open(tmp_path))
    app = create_app(Services(TOKEN, DeviceRegistry(), pairing, training=runs))
    with TestClient(app, headers={"Authorization": f"Bearer {TOKEN}"}) as api:
        missing = api.post("/v1/training/runs", json={"rounds": 1, "model": "nope"})
        assert missing.status_code == 404 and "nope" in missing.text
        wrong = api.post("/v1/training/runs", json={"rounds": 1, "model": "minilm"})
        assert wrong.status_code == 400 and "not a fedshard decoder" in wrong.text
        bad = api.post("/v1/training/runs", json={"rounds": 1, "method": "lora"})
        assert bad.status_code == 400
        ok = api.post("/v1/training/runs", json={"rounds": 1, "model": "tiny-llama"})
        assert ok.status_code == 200
        run_id = ok.json()["run_id"]
        status = api.get(f"/v1/training/runs/{run_id}").json()
        assert status["method"] == "lora" and status["model_id"] == "tiny-llama"


def test_the_lineage_sums_epsilon_over_the_runs_of_its_ancestry(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from coordinator.training.lora.version import _total_epsilon
    from coordinator.training.records import Lineage, TrainingSettings

    parent: Any = SimpleNamespace(path=tmp_path)
    assert _total_epsilon(parent, 3.0) == 3.0  # the base: no lineage
    settings = TrainingSettings(
        rounds=2, secagg=True, clipping_norm=1.0, noise_multiplier=1.0, delta=1e-5,
        trainable_shards=[1], local_epochs=2, learning_rate=0.02, batch_size=16, min_clients=3,
    )  # fmt: skip
    lineage = Lineage(
        parent_version="v1", parent_model_sha256=SHA, trained_segments=[1], rounds=2,
        clients_per_round=[3, 3], epsilon=5.0, delta=1e-5, settings=settings, metrics=[],
        epsilon_total=6.5,
    )  # fmt: skip
    (tmp_path / "lineage.json").write_text(lineage.to_json())
    assert _total_epsilon(parent, 3.0) == pytest.approx(9.5)
    assert _total_epsilon(parent, None) is None


def test_fedshard_train_model_posts_a_valid_lora_request() -> None:
    import argparse

    from coordinator.training.cli import register
    from coordinator.training.lora.cli import lora_body

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["train", "--model", "tiny-llama", "--rounds", "2", "--rank", "4"])
    body = lora_body(args)
    request = TrainingRunRequest.model_validate(body)
    assert request.resolved_method == "lora" and request.model == "tiny-llama"
    assert request.lora == LoraOptions(rank=4) and request.dp and request.secure_aggregation
    off = lora_body(parser.parse_args(["train", "--model", "m", "--noise-multiplier", "0"]))
    assert off["dp"] is False


def _decoder_manifest() -> Any:
    """A one-segment manifest of a decoder (it lists KV sessions): health-checked by prefill."""
    from protocols.manifest import DEFAULT_SESSIONS, Manifest, ModelInfo, SegmentEntry

    segment = SegmentEntry(
        index=0, device="d0", file="segment_0.onnx", sha256="0" * 64, inputs=[], outputs=[],
        param_bytes=1, predicted_memory_bytes=1, predicted_compute_s=0.0,
    )  # fmt: skip
    model = ModelInfo(name="toy", sha256="0" * 64, param_bytes=1, inputs=[], outputs=[])
    return Manifest(
        model=model, objective="throughput", bottleneck_s=0.0, latency_s=0.0,
        segments=[segment], sessions=DEFAULT_SESSIONS,
    )  # fmt: skip


def test_a_version_is_deployed_only_when_its_signature_verifies(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from coordinator.training.errors import RolloutError
    from coordinator.training.lora.target import DecoderPublisher

    ca = CertificateAuthority.open(tmp_path / "ca")
    other = CertificateAuthority.open(tmp_path / "other")
    deployed: list[Path] = []

    class Deployer:
        def deploy_version(self, model_id: str, path: Path, samples: Any, objective: Any) -> Any:
            deployed.append(path)
            assert samples["input_ids"].shape[0] == 1
            return SimpleNamespace(plan_version=7)

    store: Any = SimpleNamespace(active=lambda model_id: SimpleNamespace(objective="throughput"))
    publish = DecoderPublisher(Deployer(), store, ca.cert_pem)  # type: ignore[arg-type]
    version: Any = SimpleNamespace(path=tmp_path / "v0002")
    version.path.mkdir()
    manifest = _decoder_manifest().to_json().encode()
    (version.path / "manifest.json").write_bytes(manifest)
    with pytest.raises(RolloutError, match="unsigned"):
        publish("m", version)
    (version.path / "manifest.json.sig").write_bytes(other.sign(manifest))
    with pytest.raises(RolloutError, match="does not verify"):
        publish("m", version)
    assert deployed == []
    (version.path / "manifest.json.sig").write_bytes(ca.sign(manifest))
    assert publish("m", version).plan_version == 7 and deployed == [version.path]


def test_following_a_run_whose_round_failed_raises_its_reason(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from coordinator.training.lora.runner import follow

    link: Any = SimpleNamespace(process=SimpleNamespace(poll=lambda: None), log_path=tmp_path)
    record = tmp_path / "record.json"
    LoraRecord(error="round 1: 0 client(s) succeeded; failures: node 7: EmptyDataError").save(
        record
    )
    seen: list[LoraRecord] = []
    with pytest.raises(TrainingRunError, match="EmptyDataError"):
        follow(link, record, seen.append, 30, lambda: False)
    assert seen and seen[0].error is not None
    LoraRecord(finished=True, final_loss=1.0).save(record)
    assert follow(link, record, seen.append, 30, lambda: False).final_loss == 1.0


def test_a_run_whose_training_diverged_is_not_rolled_out() -> None:
    """Merged NaN adapters would pass the deploy's health check (the chain is compared with the
    version's own outputs), so the runner refuses them before merging."""
    healthy = [np.ones((4, 8), np.float32), np.zeros((8, 4), np.float32)]
    finished = LoraRecord(final_loss=3.2, final_tokens=40, finished=True)
    check_converged(finished, healthy)
    check_converged(LoraRecord(finished=True), healthy)  # no held-out records: nothing to judge
    blown = [healthy[0], np.full((8, 4), np.nan, np.float32)]
    with pytest.raises(TrainingRunError, match=r"diverged \(1 of 2 adapter arrays"):
        check_converged(finished, blown)
    with pytest.raises(ValidationError):  # a record cannot even hold a loss that is not finite
        LoraRecord(final_loss=float("inf"), finished=True)
