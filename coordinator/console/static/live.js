// The Live page (requests/s, latency percentiles and per-stage compute/send/idle shares,
// streamed as server-sent events) and the Training page (runs, and charts per round).
"use strict";

FS.live = {abort: null, history: [], model: "", slow: []};
const HISTORY = 90;

FS.pages.live = {
  async refresh() {
    await loadModels();
    fillSelect($("live-model"), modelOptions(), "nothing is deployed");
  },
  show() { startStream(); startFailoverPoll(); },
  hide() { stopStream(); stopFailoverPoll(); },
  wire() {
    $("live-model").addEventListener("change", () => { stopStream(); startStream(); });
  },
};

function stopStream() {
  if (FS.live.abort) FS.live.abort.abort();
  FS.live.abort = null;
}

async function startStream() {
  stopStream();
  const abort = new AbortController();
  FS.live.abort = abort;
  FS.live.history = [];
  while (!abort.signal.aborted) {
    const model = $("live-model").value;
    const query = model ? `?model=${encodeURIComponent(model)}` : "";
    try {
      const response = await request("GET", `/v1/metrics/stream${query}`, undefined,
        {signal: abort.signal});
      if (!response.ok) {
        let data = null;
        try { data = await response.json(); } catch (e) { data = null; }
        throw new ApiError(plainError(response.status, data), response.status);
      }
      status("live-status", "live");
      await readEvents(response, ev => {
        if (ev.event === "problem") status("live-status", JSON.parse(ev.data).detail, true);
        else renderLive(JSON.parse(ev.data));
      });
    } catch (e) {
      if (abort.signal.aborted) return;
      status("live-status", `${e.message} Retrying…`, true);
      await sleep(2000);
    }
  }
}

// Failover as it happens: devices lost and back, re-plans, models that cannot be served now
// (GET /v1/failover, polled while the page is shown).
const FAILOVER_EVERY_MS = 2000;
const FAILOVER_SHOWN = 12;

function stopFailoverPoll() {
  if (FS.live.failoverTimer) clearInterval(FS.live.failoverTimer);
  FS.live.failoverTimer = null;
}

function startFailoverPoll() {
  stopFailoverPoll();
  refreshFailover();
  FS.live.failoverTimer = setInterval(refreshFailover, FAILOVER_EVERY_MS);
}

async function refreshFailover() {
  let reply;
  try {
    reply = await api("GET", "/v1/failover");
  } catch (e) {
    $("live-failover-state").textContent = e.message;
    return;
  }
  const conditions = Object.entries(reply.models || {});
  $("live-failover-state").innerHTML = !reply.enabled ? "Failover is off on this coordinator." :
    conditions.length === 0 ? "Every deployed model is served by its active version." :
    conditions.map(([model, c]) => `<span class="notice">${esc(model)} v${c.version}: ` +
      `${esc(c.state)} (${esc(c.reason)})</span>`).join(" ");
  const events = (reply.events || []).slice(-FAILOVER_SHOWN).reverse();
  $("live-failover").innerHTML = events.length === 0 ? `<li class="muted">Nothing yet.</li>` :
    events.map(ev => `<li class="failover-${esc(ev.kind)}"><time>` +
      `${new Date(ev.at * 1000).toLocaleTimeString()}</time> <b>${esc(ev.kind)}</b>` +
      (ev.device ? ` ${esc(ev.device)}` : "") +
      (ev.model_id ? ` ${esc(ev.model_id)}` : "") +
      (ev.version !== null && ev.version !== undefined ? ` v${ev.version}` : "") +
      (ev.detail ? ` <span class="muted">${esc(ev.detail)}</span>` : "") + `</li>`).join("");
}

function renderLive(snap) {
  const r = snap.requests, lat = r.latency_ms;
  const fmtMs = v => v === null ? "–" : `${v.toFixed(1)} ms`;
  $("live-rps").textContent = r.requests_per_s.toFixed(1);
  $("live-p50").textContent = fmtMs(lat.p50);
  $("live-p95").textContent = fmtMs(lat.p95);
  $("live-p99").textContent = fmtMs(lat.p99);
  $("live-total").textContent = String(r.total);
  const h = FS.live.history;
  h.push(snap);
  if (h.length > HISTORY) h.shift();
  const t0 = h[0].time;
  const pts = f => h.map(s => [s.time - t0, f(s)]);
  const secs = x => `${x.toFixed(0)} s`;
  Charts.line($("live-rps-chart"), [{name: "req/s", points: pts(s => s.requests.requests_per_s)}],
    {dots: false, xFormat: secs, empty: "waiting for data"});
  Charts.line($("live-latency-chart"), [
    {name: "p50", cls: "series-0", points: pts(s => s.requests.latency_ms.p50)},
    {name: "p95", cls: "series-1", points: pts(s => s.requests.latency_ms.p95)},
    {name: "p99", cls: "series-2", points: pts(s => s.requests.latency_ms.p99)},
  ], {dots: false, xFormat: secs, empty: "no request yet"});
  renderLiveStages(snap.stages);
  renderSlow(snap.slow || []);
}

// Stages that run persistently slower than planned, each with a button that opens the Plan
// page and shows the what-if re-planned with that device at its measured speed (deployed only
// when the operator asks).
function renderSlow(slow) {
  const box = $("live-slow");
  const key = slow.map(s => s.device).join(",");
  if (box.dataset.key !== key) {
    box.dataset.key = key;
    box.innerHTML = slow.map((s, k) => `<p class="notice slow-stage" data-device="${esc(s.device)}">
      <span class="slow-text"></span> <button type="button" data-k="${k}">Re-plan with
      ${esc(s.device)} at its measured speed</button></p>`).join("");
    box.querySelectorAll("button").forEach(button => button.addEventListener("click", () => {
      FS.plan.pending = FS.live.slow[Number(button.dataset.k)].what_if;
      showPage("plan", true);
    }));
  }
  FS.live.slow = slow;
  box.querySelectorAll(".slow-text").forEach((span, k) => { span.textContent = slow[k].message + "."; });
}

function renderLiveStages(stages) {
  const box = $("live-stages");
  if (!stages.length) { box.innerHTML = `<p class="muted">No deployed stage to watch.</p>`; return; }
  if (box.querySelectorAll("article").length !== stages.length) {
    box.innerHTML = stages.map(s => `<article class="stage card" data-device="${esc(s.device)}">
      <h4>Stage ${s.index + 1}: ${esc(s.device)}</h4><p class="stage-numbers"></p>
      <svg class="chart bars share-bars" role="img" aria-label="Compute, send and idle shares of ${esc(s.device)}"></svg>
      </article>`).join("");
  }
  const cards = box.querySelectorAll("article");
  const pct = v => v === null ? null : v * 100;
  stages.forEach((s, k) => {
    const numbers = s.error ? `<span class="error-text">${esc(s.error)}</span>` :
      `${s.requests_per_s === null ? "–" : s.requests_per_s.toFixed(1)} req/s · compute ` +
      `${s.mean_compute_ms === null ? "–" : s.mean_compute_ms.toFixed(2) + " ms"} per request · ` +
      `send ${s.mean_send_ms === null ? "–" : s.mean_send_ms.toFixed(2) + " ms"} · ` +
      `${s.queued ?? "–"} queued · ${mb(s.resident_bytes)} resident`;
    cards[k].querySelector(".stage-numbers").innerHTML = numbers;
    Charts.hbars(cards[k].querySelector(".share-bars"), [
      {label: "compute", value: pct(s.compute_share), cls: "compute",
        text: s.compute_share === null ? "–" : `${pct(s.compute_share).toFixed(1)} %`},
      {label: "send", value: pct(s.send_share), cls: "send",
        text: s.send_share === null ? "–" : `${pct(s.send_share).toFixed(1)} %`},
      {label: "idle", value: pct(s.idle_share), cls: "idle",
        text: s.idle_share === null ? "–" : `${pct(s.idle_share).toFixed(1)} %`},
    ], 100);
  });
}

// ------------------------------------------------------------------------------ training

FS.training = {runs: []};

FS.pages.training = {
  every: 1500,
  async refresh() {
    let list;
    try {
      list = await api("GET", "/v1/training/runs");
    } catch (e) {
      if (e.status === 404) {
        $("train-summary").textContent = "This coordinator does not run federated training " +
          "(no training endpoints).";
        return;
      }
      throw e;
    }
    FS.training.runs = list.runs;
    let served = [];
    try {
      served = (await loadModels()).filter(m => m.active !== null
        && (m.kind === "decoder" || m.kind === "encoder"));
    } catch (e) { /* no served models to offer: the training target's task only */ }
    // a served model first when there is one: the coordinator's --training-target file is the
    // exception (fedshard demo has none), not what a newcomer should start by default
    fillSelect($("train-model"), [
      ...served.map(m => ({value: m.model_id,
        label: `${m.model_id} (${m.kind === "encoder" ? "contrastive LoRA" : "LoRA"})`})),
      {value: "", label: "the coordinator's --training-target file"}], "");
    const options = [...list.runs].reverse().map(r => ({value: r.run_id,
      label: `${r.run_id} (${r.status}, ${r.rounds.length} round(s))`}));
    fillSelect($("train-run"), options, "no run yet");
    const run = list.runs.find(r => r.run_id === $("train-run").value);
    renderRun(run);
  },
  wire() {
    $("train-run").addEventListener("change", () =>
      renderRun(FS.training.runs.find(r => r.run_id === $("train-run").value)));
    $("train-form").addEventListener("submit", event => {
      event.preventDefault();
      const body = {rounds: Number($("train-rounds").value), secure_aggregation:
        $("train-secagg").checked, dp: $("train-dp").checked};
      if ($("train-model").value) Object.assign(body, {model: $("train-model").value, method: "lora"});
      guarded("train-status", "Starting…", async () => {
        const created = await api("POST", "/v1/training/runs", body);
        await FS.pages.training.refresh();
        $("train-run").value = created.run_id;
        await FS.pages.training.refresh();
        return `Run ${created.run_id} started.`;
      });
    });
  },
};

function renderRun(run) {
  const charts = ["train-loss", "train-accuracy", "train-epsilon", "train-clients", "train-bytes"];
  if (!run) {
    $("train-summary").textContent = "No run yet: start one above.";
    for (const id of charts) Charts.empty($(id), "no run");
    $("train-rounds-table").tBodies[0].innerHTML = "";
    return;
  }
  const rounds = run.rounds;
  const last = rounds[rounds.length - 1];
  $("train-summary").innerHTML = `Run <strong>${esc(run.run_id)}</strong>: ${esc(run.status)},
    ${run.model_id ? `LoRA of ${esc(run.model_id)}, ` : ""}${rounds.length} round(s) done${
      last && last.accuracy !== null ? `, accuracy ${(last.accuracy * 100).toFixed(1)} %` : ""}${
      loraOutcome(run).map(part => `, ${part}`).join("")}.
    ${privacyLedgers(run)}
    ${run.error ? `<span class="error-text">${esc(run.error)}</span>` : ""}`;
  const by = f => rounds.map(r => [r.round, f(r)]);
  Charts.line($("train-loss"), [{name: "loss", points: by(r => r.loss).filter(p => p[1] !== null)}],
    {empty: rounds.length ? "no held-out loss reported (DP without SecAgg+)" : "waiting for round 1"});
  const accuracy = by(r => r.accuracy).filter(p => p[1] !== null);
  Charts.line($("train-accuracy"), [{name: "accuracy", points: accuracy}],
    {yMin: 0, yMax: 1, empty: run.method === "lora" ? "a LoRA run reports loss" : "waiting for round 1"});
  const dp = rounds.some(r => r.epsilon !== null);
  Charts.line($("train-epsilon"), [{name: "epsilon", points: by(r => r.epsilon)}],
    {empty: dp || !rounds.length ? "waiting for round 1" : "no differential privacy in this run"});
  Charts.bars($("train-clients"), rounds.map(r => ({label: String(r.round), value: r.clients})));
  Charts.bars($("train-bytes"), rounds.map(r => ({label: String(r.round), value: r.bytes_uploaded / MB})));
  $("train-rounds-table").tBodies[0].innerHTML = rounds.map(r => `<tr><td>${r.round}</td>
    <td>${r.loss === null ? "–" : r.loss.toFixed(4)}</td><td>${r.accuracy === null ? "–" : (r.accuracy * 100).toFixed(1) + " %"}</td>
    <td>${r.epsilon === null ? "–" : r.epsilon.toFixed(2)}</td><td>${r.clients}</td>
    <td>${mb(r.bytes_uploaded)}</td><td>${r.seconds.toFixed(1)} s</td></tr>`).join("");
}

// Each device's privacy ledger as it reported it after the run (every run it took part in,
// failed and rolled-back ones included): epsilon spent, and what its budget leaves.
function privacyLedgers(run) {
  const devices = Object.entries(run.privacy_per_device || {});
  if (!devices.length) return "";
  const one = ([name, p]) => `${esc(name)}: ε ${p.epsilon_spent.toFixed(2)} spent` +
    (p.budget == null ? " (no budget)" : `, ${p.remaining.toFixed(2)} left of ${p.budget}`) +
    (p.non_dp_rounds ? `, ${p.non_dp_rounds} round(s) without DP` : "");
  return `<span class="privacy-ledgers">Privacy ledgers: ${devices.map(one).join("; ")}.</span>`;
}

// What a LoRA run's summary says of its held-out outcome, before → after ("–" for an end not
// known): an encoder's (contrastive) recall@1 and loss, a decoder's loss and perplexity
// (e^loss). A run carrying recall@1 is an encoder's; a shards run carries none of these.
function loraOutcome(run) {
  const side = (value, format) => value == null ? "–" : format(value);
  const change = (before, after, format) => `${side(before, format)} → ${side(after, format)}`;
  const perplexity = loss => {
    const p = Math.exp(loss);
    return p < 1e4 ? p.toFixed(1) : p.toExponential(2);
  };
  const parts = [];
  const encoder = run.baseline_recall_at_1 != null || run.final_recall_at_1 != null;
  if (encoder) {
    parts.push(`held-out recall@1 ${change(run.baseline_recall_at_1, run.final_recall_at_1,
      v => `${(v * 100).toFixed(1)} %`)}`);
  }
  if (run.baseline_loss != null || run.final_loss != null) {
    const loss = change(run.baseline_loss, run.final_loss, v => v.toFixed(3));
    parts.push(encoder ? `held-out contrastive loss ${loss}` : `held-out loss ${loss} ` +
      `(perplexity ${change(run.baseline_loss, run.final_loss, perplexity)})`);
  }
  return parts.map(esc);
}
