"""LoRA runs of the coordinator's served models: which version, which devices, and rollout.

``POST /v1/training/runs {"model": ID, "method": "lora"}`` fine-tunes the active version of
served model ``ID`` (a decoder exported by ``fedshard export``, or the encoder of ``fedshard
export minilm``: see :func:`~coordinator.training.lora.plan.lora_objective`). Its devices are
the local SuperNodes of the training target's ``text_client_data`` (one per directory of text
records), each with its own node key registered with the run's SuperLink, which admits no other
node; or, with ``fedshard coordinator --superlink-port``, the paired agents' own SuperNodes
(:func:`paired_lora_federation`), which get the served version from the coordinator first.
The new version is verified (its manifest signature, against fedshard's CA) and rolled out
live through the deployer, health-checked through the data plane on a prefill (decoders) or
one tokenized sentence (encoders); ``rollback`` returns to the version it was trained from.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from pathlib import Path

import numpy as np

from coordinator.deploy.deployer import Deployer
from coordinator.deploy.store import DeploymentStore, VersionRecord
from coordinator.training.errors import LoraTargetError
from coordinator.training.flower import SuperLink
from coordinator.training.lora.runner import LoraFederation, LoraTarget
from coordinator.training.manager import Runner, RunReporter
from coordinator.training.version import MANIFEST_FILE, Version
from coordinator.trust.ca import CertificateAuthority
from protocols.decoder import INPUT_IDS, MODEL_FILE, TOKENIZER_FILE
from protocols.lora import MINILM_ENCODER
from protocols.manifest import Manifest
from protocols.training import TrainingRunRequest
from protocols.training_copy import TrainingCopyOffer

log = logging.getLogger(__name__)

HEALTH_PROMPT = (2, 3, 5, 7, 11, 13)
"""Token ids of the prefill a rolled-out decoder version is health-checked with."""
ENCODER_HEALTH_IDS = (101, 1037, 2235, 3899, 102)
"""``[CLS] a small dog [SEP]`` in BERT's uncased vocabulary: a rolled-out encoder version's
health check (an embedding request's feeds)."""


def served_lora_target(
    model_id: str,
    state_dir: Path,
    deployer: Deployer,
    store: DeploymentStore,
    data_dirs: tuple[Path, ...],
    budgets: tuple[int, ...],
    agents: int | None = None,
    cache_root: Path | None = None,
) -> LoraTarget:
    """The active version of served model ``model_id``, trained on one local SuperNode per
    text dir or (``agents``) on that many paired agents' own SuperNodes; UnknownModelError
    (404) when it is not served, LoraTargetError (400) when its model file is gone or no device
    holds text (an export that is neither a decoder nor an encoder fails when planned)."""
    active = store.active(model_id)
    version_dir = deployer.segment_dir(model_id, active.plan_version)
    source = Path(active.source)
    model_file = source / MODEL_FILE if source.is_dir() else source
    if not model_file.is_file():
        raise LoraTargetError(f"{model_id}: its model file {model_file} is gone")
    tokenizer_file = _tokenizer_file(model_id, store.model(model_id).tokenizer_dir, model_file)
    if not data_dirs and agents is None:
        raise LoraTargetError(
            "no device holds text records: list text_client_data in the training target"
        )
    return LoraTarget(
        model_id=model_id,
        version_dir=version_dir,
        model_file=model_file,
        tokenizer_file=tokenizer_file,
        versions_root=state_dir / "training" / "versions" / model_id,
        population=len(data_dirs) if agents is None else agents,
        data_dirs=data_dirs,
        budgets=budgets or tuple(1 << 30 for _ in data_dirs),
        cache_root=cache_root,
    )


def _tokenizer_file(model_id: str, tokenizer_dir: str | None, model_file: Path) -> Path:
    """The served model's tokenizer: its deployment's, the one beside its model file, or (for
    ``all-minilm-l6-v2``, as ``/v1/embeddings`` finds it) the one its package ships."""
    if tokenizer_dir:
        return Path(tokenizer_dir) / TOKENIZER_FILE
    beside = model_file.parent / TOKENIZER_FILE
    if beside.is_file() or model_id != MINILM_ENCODER:
        return beside
    from partitioner.errors import GraphError
    from partitioner.models.packaged import minilm_dir

    try:
        return minilm_dir() / TOKENIZER_FILE
    except GraphError:
        return beside


def health_samples(version_dir: Path) -> dict[str, np.ndarray]:
    """The feeds a rolled-out version is health-checked with: a decoder's prefill (the
    manifest lists KV sessions), or one sentence's ``input_ids``, mask and zero token types."""
    manifest = Manifest.from_json((version_dir / MANIFEST_FILE).read_bytes())
    if manifest.sessions is not None:
        return {INPUT_IDS: np.asarray([HEALTH_PROMPT], dtype=np.int64)}
    ids = np.asarray([ENCODER_HEALTH_IDS], dtype=np.int64)
    fill = {"attention_mask": np.ones_like(ids), "token_type_ids": np.zeros_like(ids)}
    names = [t.name for t in manifest.model.inputs]
    return {n: ids if n == INPUT_IDS else fill[n] for n in names if n in fill or n == INPUT_IDS}


class DecoderPublisher:
    """Rolls a LoRA version out to its served model: signature verified, then deployed."""

    def __init__(self, deployer: Deployer, store: DeploymentStore, ca_cert_pem: bytes) -> None:
        self.deployer = deployer
        self.store = store
        self.ca_cert_pem = ca_cert_pem

    def __call__(self, model_id: str, version: Version) -> VersionRecord:
        """Verify, deploy beside the live version, health-check, switch; the version served."""
        from coordinator.training.rollout import verify_signature

        verify_signature(version.path, self.ca_cert_pem)
        samples = health_samples(version.path)
        objective = self.store.active(model_id).objective
        return self.deployer.deploy_version(model_id, version.path, samples, objective)


def local_lora_federation(ca: CertificateAuthority) -> LoraFederation:
    """A SuperLink with node authentication and one authenticated local SuperNode per text
    data dir of the target."""
    from coordinator.training.local_agents import start_local_agents
    from coordinator.training.runner import authenticated_superlink

    @contextmanager
    def start(run_dir: Path, segments: Path, target: LoraTarget) -> Iterator[SuperLink]:
        with ExitStack() as stack:
            link, keys = stack.enter_context(
                authenticated_superlink(run_dir, ca, len(target.data_dirs))
            )
            stack.enter_context(
                start_local_agents(
                    link,
                    segments,
                    target.data_dirs,
                    target.budgets,
                    run_dir,
                    keys,
                    cache_root=target.cache_root,
                )
            )
            yield link

    return start


def paired_lora_federation(
    ca: CertificateAuthority,
    port: int,
    host: str,
    node_keys: Callable[[], Mapping[str, str]],
    send: Callable[[TrainingCopyOffer, Path, int], list[str]],
) -> LoraFederation:
    """The paired agents' own SuperNodes train: the run's staged version is sent to them first
    (:mod:`coordinator.training.copies`: signed, hash-checked, only missing files), then a
    SuperLink on ``host:port`` admits the node keys of exactly the agents that hold it."""
    from coordinator.training.copies import signed_offer, training_copy
    from coordinator.training.runner import paired_superlink

    @contextmanager
    def start(run_dir: Path, segments: Path, target: LoraTarget) -> Iterator[SuperLink]:
        copy_id = f"{target.model_id}-{target.version_dir.name}"
        offer = signed_offer(training_copy(copy_id, segments, [TOKENIZER_FILE]), ca.sign)
        held = set(send(offer, segments, target.population))
        keys = {name: key for name, key in node_keys().items() if name in held}
        with paired_superlink(
            run_dir, ca, keys, target.population, port, host, current=node_keys
        ) as link:
            yield link

    return start


class MethodRunner:
    """Sends ``lora`` requests to one runner and everything else to another."""

    def __init__(self, shards: Runner, lora: Runner | None) -> None:
        self.shards = shards
        self.lora = lora

    def run(
        self, run_id: str, request: TrainingRunRequest, report: RunReporter, stop: threading.Event
    ) -> None:
        """Run ``request`` on the runner of its method."""
        if request.resolved_method != "lora":
            self.shards.run(run_id, request, report, stop)
            return
        if self.lora is None:
            raise LoraTargetError("this coordinator runs no LoRA fine-tuning")
        self.lora.run(run_id, request, report, stop)
