"""Integration: a model deployed from a GGUF file is re-planned and rebuilt from the file when
an agent holding its layers is lost mid-stream.

Three real agents on 127.0.0.1 under caps that let any two hold the tiny Llama GGUF (but no one
of them). A greedy completion is streamed; after some pieces the agent holding the first
stateful stage is SIGKILLed. The coordinator re-plans on the two left, builds their segments
from the same GGUF file (the version keeps its path and weights mode), and the session replays
its tokens: the streamed text is the numpy reference's greedy text on that file.
"""

from __future__ import annotations

import json
import secrets
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from coordinator_helpers import pairing_code, start_coordinator, stop_process, unpaired_agents
from coordinator_helpers import wait_for as wait_until
from generation_lab import GenLab, kill_at_piece, stream_completion
from gguf_lab import BOS, reference_greedy, write_tiny
from tokenizers import Tokenizer

from coordinator.deploy.store import segment_dir

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

MODEL_ID = "tiny-gguf-failover"
CAP = "20MB"
"""Two devices at this cap hold the tiny Llama with its KV cache, one does not."""
PROMPT = "the devices of a local network"
TOKENS = 40


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GenLab]:
    tmp = tmp_path_factory.mktemp("gguf-failover")
    gguf = write_tiny(tmp / "tiny.gguf", "llama", "f32")
    suffix = secrets.token_hex(3)
    coordinator = start_coordinator(tmp)
    try:
        names = [f"f{i}-{suffix}" for i in range(3)]
        with unpaired_agents(tmp, names, "512MiB") as procs:
            with coordinator.client() as api:
                assert wait_until(
                    lambda: set(names) <= {d["name"] for d in api.get("/v1/devices").json()}, 15
                )
            for agent in procs:
                paired = coordinator.cli("pair", agent.name, pairing_code(agent))
                assert paired.returncode == 0, paired.stdout + paired.stderr
            args = ["deploy", str(gguf), "--name", MODEL_ID]
            for name in names:
                args += ["--memory-cap", f"{name}={CAP}"]
            deployed = coordinator.cli(*args)
            assert deployed.returncode == 0, deployed.stdout + deployed.stderr + coordinator.log()
            yield GenLab(coordinator, procs, gguf, ssl.create_default_context(), deployed.stdout)
    finally:
        stop_process(coordinator.proc)


def _live(lab: GenLab) -> dict[str, object]:
    with lab.coordinator.client() as api:
        [record] = [m for m in api.get("/v1/deployments").json() if m["model_id"] == MODEL_ID]
    [live] = [v for v in record["versions"] if v["state"] == "active"]
    return dict(live)


def test_a_stream_survives_losing_a_stage_and_the_file_is_rebuilt(lab: GenLab) -> None:
    first = _live(lab)
    version_dir = segment_dir(lab.coordinator.state_dir, MODEL_ID, int(str(first["plan_version"])))
    tokenizer = Tokenizer.from_file(str(version_dir / "tokenizer.json"))
    prompt = [BOS, *tokenizer.encode(PROMPT, add_special_tokens=False).ids]
    want = tokenizer.decode(reference_greedy(lab.export, prompt, TOKENS))
    manifest = json.loads((version_dir / "manifest.json").read_text())
    victim_name = next(s["device"] for s in manifest["segments"] if s["state"])
    victim = next(a for a in lab.agents if a.name == victim_name)
    body = {"model": MODEL_ID, "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0}
    killed = threading.Event()
    status, text = stream_completion(lab, body, kill_at_piece(victim, 8, killed))
    assert killed.is_set()
    assert (status, text) == (200, want)
    assert wait_until(lambda: _live(lab)["plan_version"] != first["plan_version"], 120)
    live = _live(lab)
    segments = live["segments"]
    assert isinstance(segments, list)
    assert victim_name not in {p["device"] for p in segments}
    assert live["source"] == str(lab.export)  # rebuilt from the same GGUF file
    card = live["card"]
    assert isinstance(card, dict) and card["file"] == Path(str(lab.export)).name
    assert str(live["trigger"]).startswith("failover")
