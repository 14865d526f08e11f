"""Integration: ``fedshard deploy tiny.gguf`` across two real agents on 127.0.0.1.

A coordinator and two paired agents; a small random Llama GGUF (float weights, byte-level BPE
tokenizer in its metadata) is deployed with ``fedshard deploy`` under caps that need both
agents. The segments are built from the file (no ONNX export exists anywhere), a chat
completion's greedy answer equals the numpy reference's greedy tokens on the same file,
``GET /v1/models`` shows the file, files that are no model or a GGUF of an architecture
fedshard does not serve are refused with 400 and a code naming why, and the segments, probed at
deploy, speculate: greedy text with prompt lookup drafts is the text without.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from coordinator_helpers import (
    CoordinatorProc,
    pairing_code,
    start_coordinator,
    stop_process,
    unpaired_agents,
    wait_for,
)
from gguf import GGUFWriter
from gguf_lab import reference_greedy, write_tiny
from tokenizers import Tokenizer

from coordinator.deploy.store import segment_dir

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

MODEL_ID = "tiny-gguf"
AGENT_MEMORY = "512MiB"
CAP = "20MB"
"""Per-device planning cap: the three float32 blocks (2.4 MB each) with their KV cache (4 MiB
each at 4 sessions of 1024 tokens) and the runtime's overhead fit on no one device (16 MB
each did not fit on two either), so the plan needs both."""
QUESTION = "the devices of a local network"


@dataclass
class GgufLab:
    coordinator: CoordinatorProc
    gguf: Path
    deploy_out: str
    agents: list[str]


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GgufLab]:
    tmp = tmp_path_factory.mktemp("gguf-e2e")
    gguf = write_tiny(tmp / "tiny.gguf", "llama", "f32")
    suffix = secrets.token_hex(3)
    coordinator = start_coordinator(tmp)
    try:
        names = [f"q{i}-{suffix}" for i in range(2)]
        with unpaired_agents(tmp, names, AGENT_MEMORY) as procs:
            with coordinator.client() as api:
                assert wait_for(
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
            yield GgufLab(coordinator, gguf, deployed.stdout, names)
    finally:
        stop_process(coordinator.proc)


def _live(lab: GgufLab) -> dict[str, object]:
    with lab.coordinator.client() as api:
        [record] = [m for m in api.get("/v1/deployments").json() if m["model_id"] == MODEL_ID]
    [live] = [v for v in record["versions"] if v["state"] == "active"]
    return dict(live)


def test_the_stages_are_built_from_the_file_on_both_agents(lab: GgufLab) -> None:
    live = _live(lab)
    segments = live["segments"]
    assert isinstance(segments, list)
    assert {p["device"] for p in segments} == set(lab.agents)
    assert live["source"] == str(lab.gguf)
    version_dir = segment_dir(lab.coordinator.state_dir, MODEL_ID, int(str(live["plan_version"])))
    assert {p.name for p in version_dir.iterdir()} >= {"decoder.json", "tokenizer.json"}
    assert not list(lab.coordinator.state_dir.rglob("model.onnx"))  # no whole-model graph
    assert "tiny.gguf" in lab.deploy_out and "peak resident memory" in lab.deploy_out


def test_models_list_shows_the_file(lab: GgufLab) -> None:
    with lab.coordinator.client() as api:
        models = api.get("/v1/models").json()["data"]
        console = api.get("/v1/console/models").json()
    [model] = [m for m in models if m["id"] == MODEL_ID]
    card = model["gguf"]
    assert card["file"] == "tiny.gguf" and card["name"] == "tiny-llama"
    assert card["architecture"] == "llama" and card["layers"] == 3
    assert card["parameters"] > 1_000_000 and set(card["quantization"]) == {"F32"}
    [entry] = [m for m in console if m["model_id"] == MODEL_ID]
    build = entry["gguf"]["build"]
    assert entry["kind"] == "decoder" and build["peak_rss_bytes"] > 0
    assert build["deploy_peak_rss_bytes"] >= build["peak_rss_bytes"]


def test_chat_completion_equals_the_reference_greedy_tokens(lab: GgufLab) -> None:
    live = _live(lab)
    version_dir = segment_dir(lab.coordinator.state_dir, MODEL_ID, int(str(live["plan_version"])))
    tokenizer = Tokenizer.from_file(str(version_dir / "tokenizer.json"))
    rendered = f"<|user|>{QUESTION}<|end|><|assistant|>"  # devtools.gguf_files.CHAT_TEMPLATE
    prompt = tokenizer.encode(rendered, add_special_tokens=False).ids
    want = reference_greedy(lab.gguf, prompt, 12)
    body = {
        "model": MODEL_ID,
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": 12,
        "temperature": 0,
    }
    with lab.coordinator.client() as api:
        response = api.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    reply = response.json()
    assert reply["usage"]["prompt_tokens"] == len(prompt)
    assert reply["usage"]["completion_tokens"] == len(want)
    assert reply["choices"][0]["message"]["content"] == tokenizer.decode(want)


def test_a_file_that_is_no_model_is_refused_with_400(lab: GgufLab, tmp_path: Path) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text("these are notes, not a model\n")
    with lab.coordinator.client() as api:
        reply = api.post("/v1/deployments", json={"model_path": str(notes)})
    assert reply.status_code == 400, reply.text
    assert reply.json()["code"] == "unsupported_model_format"
    assert "GGUF" in reply.json()["detail"] and "ONNX" in reply.json()["detail"]
    cli = lab.coordinator.cli("deploy", str(notes))
    assert cli.returncode == 1 and "400" in cli.stdout


def test_an_architecture_not_served_is_refused_with_400(lab: GgufLab, tmp_path: Path) -> None:
    path = tmp_path / "mamba.gguf"
    writer = GGUFWriter(str(path), "mamba")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    with lab.coordinator.client() as api:
        reply = api.post("/v1/deployments", json={"model_path": str(path)})
    assert reply.status_code == 400, reply.text
    assert reply.json()["code"] == "unsupported_architecture"
    assert "mamba" in reply.json()["detail"]
    assert _live(lab)["source"] == str(lab.gguf)  # the live version is untouched


def test_the_console_plan_shows_the_stages(lab: GgufLab) -> None:
    with lab.coordinator.client() as api:
        view = api.get(f"/v1/plan/{MODEL_ID}")
    assert view.status_code == 200, view.text
    stages = view.json()["stages"]
    assert len(stages) == len(_live(lab)["segments"])  # type: ignore[arg-type]
    assert stages[-1]["unit_end"] == 3 + 2  # embedding, three blocks, head


EDIT = "the devices of a local network, the devices of a local network, the devices of a"
"""A prompt that repeats itself, so prompt lookup drafts (and a verify pass runs) often."""


def _greedy_texts(lab: GgufLab, mode: str, prompts: list[str]) -> tuple[list[str], dict[str, Any]]:
    with lab.coordinator.client(timeout=300) as api:
        route = f"/v1/deployments/{MODEL_ID}/speculative"
        reply = api.put(route, json={"speculative": mode})
        assert reply.status_code == 200, reply.text
        texts = []
        for prompt in prompts:
            body = {"model": MODEL_ID, "prompt": prompt, "max_tokens": 24, "temperature": 0}
            response = api.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            texts.append(response.json()["choices"][0]["text"])
        console = api.get("/v1/console/models").json()
    [entry] = [m for m in console if m["model_id"] == MODEL_ID]
    return texts, entry


def test_greedy_text_is_the_same_with_and_without_speculation(lab: GgufLab) -> None:
    """The segments were probed at deploy (a pass of k tokens decodes as k one-token steps),
    so prompt lookup drafts are verified in one pass of each stage and the greedy text is the
    text one token a pass gives (the chat test above holds the default, ``auto``, to the numpy
    reference)."""
    prompts = [EDIT, QUESTION]
    try:
        plain, off = _greedy_texts(lab, "off", prompts)
        fast, on = _greedy_texts(lab, "lookup", prompts)
    finally:
        _greedy_texts(lab, "auto", [])
    assert off["speculation_in_effect"] == "off: set off"
    assert on["speculation_in_effect"] == "on: prompt lookup drafts"
    assert fast == plain
    assert on["drafted_tokens"] > 0  # verify passes ran
