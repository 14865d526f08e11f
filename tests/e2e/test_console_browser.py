"""The web console in a real browser: Debian's Chromium driven by Playwright, headless.

One module-scoped lab: a coordinator and three unpaired agents as real processes on 127.0.0.1.
The tests run in order on one page, as an operator would: sign in with the token, approve the
agents by their pairing codes, deploy MiniLM under caps that force three stages and read its
plan, compare sentences in the playground, watch live metrics move under load, and start a real
federated training run from the console (the coordinator's SuperLink, three local SuperNodes and
the ServerApp) and watch its charts gain a point per round. Screenshots go to
``tests/artifacts/`` (git-ignored).
"""

from __future__ import annotations

import math
import re
import secrets
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from agent_helpers import AgentProc, minilm_model
from coordinator_helpers import (
    CoordinatorProc,
    pairing_code,
    start_coordinator,
    stop_process,
    unpaired_agents,
    wait_for,
)

from coordinator.training.manager import CLOSE_TIMEOUT_S

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]
playwright_api = pytest.importorskip("playwright.sync_api")
expect = playwright_api.expect
expect.set_options(timeout=20_000)

CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"
MODEL_ID = "all-minilm-l6-v2"
CAPS_MB = (70, 30, 30)
"""Planning caps that force three stages: MiniLM's ~90 MB fit on no single device, nor two."""
TRAINING_ROUNDS = 2
TRAINING_WAIT_S = 300.0
"""Bound on a real two-round run (SuperLink, three SuperNodes, ServerApp): 100-135 s here."""
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


@dataclass
class Lab:
    coordinator: CoordinatorProc
    agents: list[AgentProc]
    model: Path

    def api(self) -> httpx.Client:
        return self.coordinator.client()


@pytest.fixture(scope="session")
def chromium() -> Path:
    """Debian's Chromium, installed with apt when missing (never ``playwright install``)."""
    if not CHROMIUM.exists():
        if shutil.which("apt-get") is None:
            pytest.fail("Chromium is missing and apt-get is not available to install it")
        done = subprocess.run(
            ["apt-get", "install", "-y", "chromium"],
            capture_output=True,
            text=True,
            timeout=900,
            check=False,
        )
        if done.returncode != 0 or not CHROMIUM.exists():
            pytest.fail(
                "`apt-get install -y chromium` failed; the console's browser tests need "
                f"Debian's Chromium at {CHROMIUM}:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
            )
    return CHROMIUM


@pytest.fixture(scope="module")
def lab(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    pytest.importorskip("transformers")
    model = minilm_model(Path(request.config.cache.mkdir("fedshard-minilm")))
    tmp = tmp_path_factory.mktemp("console-browser")
    suffix = secrets.token_hex(3)  # other tests on this host advertise agents too
    coordinator = start_coordinator(tmp, training=True)
    try:
        names = [f"{role}-{suffix}" for role in ("nas", "laptop", "sbc")]
        with unpaired_agents(tmp, names, "512MiB") as agents:
            lab = Lab(coordinator, agents, model)
            with lab.api() as api:

                def waiting() -> bool:
                    pending = api.get("/v1/pairing").json()["pending"]
                    return set(names) <= {p["name"] for p in pending}

                assert wait_for(waiting, 30), api.get("/v1/pairing").text
            yield lab
    finally:  # a run cut short needs time to stop its Flower processes (TrainingRuns.close)
        stop_process(coordinator.proc, timeout=CLOSE_TIMEOUT_S + 30)


@pytest.fixture(scope="module")
def browser(chromium: Path) -> Iterator[Any]:
    """One Chromium for the module (Playwright's sync API runs one instance per thread)."""
    ARTIFACTS.mkdir(exist_ok=True)
    with playwright_api.sync_playwright() as p:
        launched = p.chromium.launch(
            executable_path=str(chromium), headless=True, args=CHROMIUM_ARGS
        )
        try:
            yield launched
        finally:
            launched.close()


@pytest.fixture(scope="module")
def page(browser: Any, lab: Lab) -> Iterator[object]:
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    page.set_default_timeout(20_000)
    outside: list[str] = []
    page.on(
        "request",
        lambda r: None if r.url.startswith(lab.coordinator.url) else outside.append(r.url),
    )
    page.outside = outside  # type: ignore[attr-defined]
    try:
        yield page
    finally:
        context.close()


def _note_outside(url: str, home: str, outside: list[str]) -> None:
    """Record a request the page made to anywhere but the coordinator (there must be none)."""
    if not url.startswith(home + "/"):
        outside.append(url)


def shot(page: object, name: str) -> None:
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)  # type: ignore[attr-defined]


def tab(page: object, name: str) -> None:
    page.get_by_role("tab", name=name).click()  # type: ignore[attr-defined]


def test_sign_in_with_the_token(page, lab: Lab) -> None:  # type: ignore[no-untyped-def]
    page.goto(lab.coordinator.url + "/")
    expect(page.locator("#login")).to_be_visible()
    page.get_by_label("API token").fill("not-the-token")
    page.get_by_role("button", name="Sign in").click()
    expect(page.locator("#login-status")).to_contain_text("not accepted")
    shot(page, "01-login-refused")
    page.goto(f"{lab.coordinator.url}/?token={lab.coordinator.token}")
    expect(page.get_by_role("tab", name="Devices")).to_have_attribute("aria-selected", "true")
    assert "token=" not in page.url  # taken out of the address bar
    for agent in lab.agents:  # other tests' agents on this host may be waiting too
        expect(page.locator(f'#pending-table tr[data-device="{agent.name}"]')).to_have_count(1)
    shot(page, "02-signed-in")
    assert page.outside == []  # type: ignore[attr-defined]


def test_approve_a_pairing_by_its_code(page, lab: Lab) -> None:  # type: ignore[no-untyped-def]
    tab(page, "Devices")
    first = lab.agents[0]
    page.get_by_label("Device", exact=True).select_option(first.name)
    code = pairing_code(first)
    page.get_by_label("Pairing code").fill("AAAA-AAAA" if code != "AAAA-AAAA" else "BBBB-BBBB")
    page.get_by_role("button", name="Approve", exact=True).click()
    expect(page.locator("#approve-status")).to_contain_text("does not match")
    assert "Traceback" not in page.content()
    for agent in lab.agents:
        row = page.locator("#pending-table tr", has_text=agent.name)
        expect(row).not_to_contain_text(pairing_code(agent))  # shown on the device only
        row.get_by_role("button", name="Approve…").click()
        page.get_by_label("Pairing code").fill(pairing_code(agent))
        page.get_by_label("Pairing code").press("Enter")
        expect(page.locator("#approve-status")).to_contain_text(f"{agent.name} is paired")
    rows = page.locator("#paired-table tbody tr[data-device]")
    expect(rows).to_have_count(3, timeout=30_000)
    expect(page.locator("#paired-table")).to_contain_text("online")
    shot(page, "03-paired")


def test_deploy_minilm_and_see_three_stages(page, lab: Lab) -> None:  # type: ignore[no-untyped-def]
    tab(page, "Models")
    page.get_by_label("ONNX file on the coordinator's host").fill("/no/such/model.onnx")
    page.get_by_role("button", name="Deploy", exact=True).click()
    expect(page.locator("#deploy-status")).to_contain_text("no model file")
    page.get_by_label("ONNX file on the coordinator's host").fill(str(lab.model))
    page.get_by_label("Model id (optional)").fill(MODEL_ID)
    for agent, cap in zip(lab.agents, CAPS_MB, strict=True):
        page.locator("#deploy-caps").get_by_label(agent.name).fill(str(cap))
    page.get_by_role("button", name="Deploy", exact=True).click()
    expect(page.locator("#deploy-status")).to_contain_text("is live on 3 stage(s)", timeout=300_000)
    expect(page.locator(f'article.model[data-model="{MODEL_ID}"] .lineage li')).to_have_count(1)
    shot(page, "04-deployed")

    tab(page, "Plan")
    stages = page.locator("#plan-stages article.stage")
    expect(stages).to_have_count(3)
    for k in range(3):
        card = stages.nth(k)
        for kind in ("budget", "predicted", "measured"):
            expect(card.locator(f"svg.memory-bars rect.hbar.{kind}")).to_have_count(1)
        expect(card.locator(".units")).to_contain_text(re.compile(r"units \d+–\d+ of \d+"))
    expect(page.locator("#plan-stages article.stage.bottleneck")).to_have_count(1)
    devices = [stages.nth(k).get_attribute("data-device") for k in range(3)]
    assert sorted(devices) == sorted(a.name for a in lab.agents)
    shot(page, "05-plan")

    dropped = devices[2]
    page.locator(f'#whatif-table tr[data-device="{dropped}"]').get_by_label(
        f"drop {dropped}"
    ).check()
    page.get_by_role("button", name="Show the new plan").click()
    expect(page.locator("#whatif-status")).to_contain_text("The new plan uses", timeout=60_000)
    result = page.locator("#whatif-result article.stage")
    assert 1 <= result.count() <= 2
    assert dropped not in [
        result.nth(k).get_attribute("data-device") for k in range(result.count())
    ]
    shot(page, "06-what-if")


def test_link_topology_shows_bandwidth(page, lab: Lab) -> None:  # type: ignore[no-untyped-def]
    tab(page, "Devices")
    expect(page.locator("#topology line.edge")).to_have_count(3, timeout=30_000)
    expect(page.locator("#topology .edge-label").first).to_contain_text(re.compile(r"[MGT]bit/s"))
    expect(page.locator("#topology g.node")).to_have_count(3)
    shot(page, "07-topology")


def test_playground_similarity_matrix(page, lab: Lab) -> None:  # type: ignore[no-untyped-def]
    tab(page, "Playground")
    expect(page.locator("#no-decoder")).to_be_visible()  # MiniLM is an encoder
    page.get_by_role("tabpanel", name="Playground").get_by_label("Model").select_option(MODEL_ID)
    page.get_by_role("button", name="Compare").click()
    expect(page.locator("#similarity-status")).to_contain_text("384 dimensions", timeout=60_000)
    cells = page.locator("#similarity g.cell text")
    expect(cells).to_have_count(16)
    values = [float(cells.nth(k).text_content() or "nan") for k in range(16)]
    assert all(abs(values[k * 5] - 1.0) < 0.01 for k in range(4))  # the diagonal
    assert values[1] > 0.6 > values[2]  # the two fox sentences are alike, Paris is not
    shot(page, "08-similarity")


def test_live_metrics_move_under_load(page, lab: Lab) -> None:  # type: ignore[no-untyped-def]
    tab(page, "Live")
    expect(page.locator("#live-stages article.stage")).to_have_count(3, timeout=30_000)
    before = int(page.locator("#live-total").text_content() or "0")
    stop = threading.Event()

    def load() -> None:
        with lab.api() as api:
            while not stop.is_set():
                api.post("/v1/embeddings", json={"model": MODEL_ID, "input": ["load", "more"]})

    workers = [threading.Thread(target=load) for _ in range(2)]
    for worker in workers:
        worker.start()
    try:
        expect(page.locator("#live-total")).not_to_have_text(str(before), timeout=20_000)
        expect(page.locator("#live-rps")).not_to_have_text(
            re.compile(r"^(–|0\.0)$"), timeout=20_000
        )
        expect(page.locator("#live-p95")).to_contain_text("ms")
        compute = page.locator("#live-stages article.stage").first.locator("text.value").first
        expect(compute).not_to_have_text("–", timeout=20_000)
        expect(page.locator("#live-rps-chart polyline")).to_have_count(1, timeout=20_000)
        shot(page, "09-live")
    finally:
        stop.set()
        for worker in workers:
            worker.join(timeout=60)
    after = int(page.locator("#live-total").text_content() or "0")
    assert after > before


def _run_status(lab: Lab, run_id: str) -> str:
    """The run as the coordinator has it, and the end of its log: what a failure shows."""
    with lab.api() as api:
        run = api.get(f"/v1/training/runs/{run_id}").text
    return f"run: {run}\ncoordinator log:\n{lab.coordinator.log()[-4000:]}"


def _within(deadline: float) -> float:
    """Milliseconds left until ``deadline`` (``time.monotonic()``), at least one."""
    return max(1.0, (deadline - time.monotonic()) * 1000)


@pytest.mark.timeout(TRAINING_WAIT_S + 120)
def test_training_chart_gains_points(page, lab: Lab) -> None:  # type: ignore[no-untyped-def]
    tab(page, "Training")
    expect(page.locator("#train-summary")).to_contain_text("No run yet")
    # served models come first; this run is the coordinator's training target (the digits task)
    page.locator("#train-model").select_option("")
    page.get_by_label("Rounds").fill(str(TRAINING_ROUNDS))
    page.get_by_label("Secure aggregation").uncheck()  # plain FedAvg: the quickest real run
    page.get_by_label("Differential privacy").check()
    with page.expect_response(
        lambda r: r.request.method == "POST" and r.url.endswith("/v1/training/runs")
    ) as answer:
        page.get_by_role("button", name="Start a run").click()
    assert answer.value.status == 200, answer.value.text()
    assert answer.value.request.post_data_json == {
        "rounds": TRAINING_ROUNDS,
        "secure_aggregation": False,
        "dp": True,
    }
    run_id = answer.value.json()["run_id"]
    deadline = time.monotonic() + TRAINING_WAIT_S
    expect(page.locator("#train-status")).to_contain_text(f"Run {run_id} started")
    expect(page.locator("#train-run")).to_have_value(run_id)
    points = page.locator("#train-loss circle.pt")
    try:
        expect(points).to_have_count(0)  # the federation is still starting
        expect(page.locator("#train-loss")).to_contain_text("waiting for round 1")
        expect(points).to_have_count(1, timeout=_within(deadline))
        expect(page.locator("#train-summary")).to_contain_text("running")
        shot(page, "10-training-round-1")
        expect(points).to_have_count(TRAINING_ROUNDS, timeout=_within(deadline))
        expect(page.locator("#train-summary")).to_contain_text(
            f"Run {run_id}: finished, {TRAINING_ROUNDS} round(s) done",
            timeout=_within(deadline),
        )
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{_run_status(lab, run_id)}") from exc
    for chart in ("train-accuracy", "train-epsilon"):
        expect(page.locator(f"#{chart} circle.pt")).to_have_count(TRAINING_ROUNDS)
    for chart in ("train-clients", "train-bytes"):
        expect(page.locator(f"#{chart} rect.bar")).to_have_count(TRAINING_ROUNDS)
    with lab.api() as api:
        run = api.get(f"/v1/training/runs/{run_id}").json()
    assert run["status"] == "finished", run["error"]
    assert [r["round"] for r in run["rounds"]] == list(range(1, TRAINING_ROUNDS + 1))
    assert all(r["clients"] == 3 and r["epsilon"] > 0 for r in run["rounds"])
    assert [v["round"] for v in run["rollouts"]] == [TRAINING_ROUNDS]  # a new version written
    rows = page.locator("#train-rounds-table tbody tr")
    expect(rows).to_have_count(TRAINING_ROUNDS)
    for k, r in enumerate(run["rounds"]):  # the page shows the coordinator's numbers
        cells = rows.nth(k).locator("td")
        expect(cells.nth(1)).to_have_text(f"{r['loss']:.4f}")
        expect(cells.nth(2)).to_have_text(f"{r['accuracy'] * 100:.1f} %")
        expect(cells.nth(3)).to_have_text(f"{r['epsilon']:.2f}")
        expect(cells.nth(4)).to_have_text("3")
    shot(page, "10-training")


def test_keyboard_and_phone_width(page, lab: Lab) -> None:  # type: ignore[no-untyped-def]
    tab(page, "Devices")
    page.get_by_role("tab", name="Devices").focus()
    page.keyboard.press("ArrowRight")
    expect(page.get_by_role("tab", name="Plan")).to_have_attribute("aria-selected", "true")
    expect(page.get_by_role("tab", name="Plan")).to_be_focused()
    page.keyboard.press("End")
    expect(page.get_by_role("tab", name="Playground")).to_have_attribute("aria-selected", "true")
    page.set_viewport_size({"width": 390, "height": 844})
    tab(page, "Plan")
    expect(page.locator("#plan-stages article.stage")).to_have_count(3)
    overflow = page.evaluate("document.documentElement.scrollWidth - window.innerWidth")
    assert overflow <= 1, f"the page is {overflow}px wider than a phone screen"
    shot(page, "11-phone-plan")
    page.set_viewport_size({"width": 1280, "height": 900})
    assert page.outside == []  # type: ignore[attr-defined]


def _lora_runs() -> dict[str, object]:
    """Two finished LoRA runs as ``GET /v1/training/runs`` lists them: a decoder's (held-out
    loss) and an encoder's (held-out recall@1 too), one round each."""
    from protocols.training import RunList, RunRound, RunStatus

    one = [RunRound(round=1, loss=3.0, accuracy=None, epsilon=1.5, clients=3,
                    bytes_uploaded=4096, seconds=2.0)]  # fmt: skip
    decoder = RunStatus(
        run_id="lora-decoder", status="finished", model_id="tiny-llama", method="lora",
        rounds=one, baseline_loss=5.22, final_loss=2.38, epsilon_per_device=[1.5] * 3,
    )  # fmt: skip
    encoder = decoder.model_copy(
        update={"run_id": "lora-encoder", "model_id": MODEL_ID, "baseline_loss": 1.2,
                "final_loss": 0.8, "baseline_recall_at_1": 0.412, "final_recall_at_1": 0.655}
    )  # fmt: skip
    return RunList(runs=[decoder, encoder]).model_dump(mode="json")


def test_training_page_shows_a_lora_runs_outcome(browser: Any, tmp_path: Path) -> None:
    """The summary line of a decoder's run gives held-out loss and perplexity before → after,
    an encoder's its held-out recall@1 (and contrastive loss, no perplexity). Light: a bare
    coordinator serves the console; the page's run list is answered with the records above."""
    coordinator = start_coordinator(tmp_path)
    try:
        context = browser.new_context(viewport={"width": 1280, "height": 900})
        try:
            page = context.new_page()
            runs = _lora_runs()
            page.route(
                "**/v1/training/runs",
                lambda route: (
                    route.fulfill(json=runs) if route.request.method == "GET" else route.continue_()
                ),
            )
            page.goto(f"{coordinator.url}/?token={coordinator.token}")
            tab(page, "Training")
            summary = page.locator("#train-summary")
            page.locator("#train-run").select_option("lora-decoder")
            ppl = f"{math.exp(5.22):.1f} → {math.exp(2.38):.1f}"
            expect(summary).to_contain_text(f"held-out loss 5.220 → 2.380 (perplexity {ppl})")
            expect(summary).not_to_contain_text("recall@1")
            page.locator("#train-run").select_option("lora-encoder")
            expect(summary).to_contain_text("held-out recall@1 41.2 % → 65.5 %")
            expect(summary).to_contain_text("held-out contrastive loss 1.200 → 0.800")
            expect(summary).not_to_contain_text("perplexity")
            shot(page, "12-training-lora-outcome")
        finally:
            context.close()
    finally:
        stop_process(coordinator.proc)
