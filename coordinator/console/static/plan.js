// The Plan page: each stage's device, unit range, memory (budget, predicted, measured) and
// time (predicted against measured, bottleneck highlighted), and the what-if re-planner.
"use strict";

FS.plan = {whatIf: null, pending: null, slowdown: {}};

FS.pages.plan = {
  every: 5000,
  async refresh() {
    const [, devices] = await Promise.all([loadModels(), api("GET", "/v1/devices")]);
    FS.devices = devices;
    fillSelect($("plan-model"), modelOptions(), "nothing is deployed");
    const pending = FS.plan.pending;
    if (pending && modelOptions().some(o => o.value === pending.model)) {
      $("plan-model").value = pending.model;
    }
    const model = $("plan-model").value;
    if (!model) {
      $("plan-summary").textContent = "Deploy a model (Models page) to see its plan.";
      $("plan-stages").innerHTML = "";
      return;
    }
    const view = await api("GET", `/v1/plan/${encodeURIComponent(model)}`);
    renderSummary(view);
    renderStages($("plan-stages"), view);
    renderWhatIfDevices(view);
    if (pending) {  // a suggestion from the Live page: show its what-if
      FS.plan.pending = null;
      FS.plan.slowdown = pending.slowdown || {};
      for (const row of $("whatif-table").tBodies[0].querySelectorAll("tr[data-device]")) {
        row.querySelector(".wi-drop").checked = (pending.drop || []).includes(row.dataset.device);
      }
      await runWhatIf();
    }
  },
  wire() {
    $("plan-model").addEventListener("change", () => {
      FS.plan.whatIf = null;
      FS.plan.slowdown = {};
      $("whatif-result").innerHTML = "";
      $("whatif-deploy").hidden = true;
      FS.pages.plan.refresh().catch(e => showError(e.message));
    });
    $("whatif-form").addEventListener("submit", event => { event.preventDefault(); runWhatIf(); });
    $("whatif-deploy").addEventListener("click", deployWhatIf);
  },
};

function renderSummary(view) {
  const bottleneck = view.stages[view.bottleneck_index];
  $("plan-summary").innerHTML = `<strong>${esc(view.model_id)}</strong>
    ${view.version ? `v${view.version}` : "(what-if)"}: ${view.stages.length} stage(s),
    objective ${esc(view.objective)}, predicted bottleneck ${ms(view.predicted_bottleneck_s)},
    predicted latency ${ms(view.predicted_latency_s)}. The bottleneck is stage
    ${bottleneck.index + 1} on <strong>${esc(bottleneck.device)}</strong>
    (by ${view.bottleneck_basis} time).`;
}

function unitText(stage, total) {
  if (stage.unit_start === null) return "units unknown";
  const names = stage.first_unit
    ? ` (${esc(stage.first_unit)}${stage.last_unit !== stage.first_unit ? " … " + esc(stage.last_unit) : ""})`
    : "";
  const of = total ? ` of ${total}` : "";
  return `units ${stage.unit_start}–${stage.unit_end - 1}${of}${names}`;
}

const BAND = [0.75, 1.33];

function timeNote(s, view) {
  const parts = [];
  if (view.plan_version && s.measured_compute_s) {
    const ratio = s.predicted_compute_s / s.measured_compute_s;
    const inBand = ratio >= BAND[0] && ratio <= BAND[1];
    parts.push(`<span class="ratio ${inBand ? "in-band" : "out-of-band"}">predicted/measured ` +
      `${ratio.toFixed(2)}x${inBand ? "" : ` (outside ${BAND[0]}-${BAND[1]})`}</span>`);
  }
  if (s.predicted_prefill_s !== null && s.predicted_prefill_s !== undefined) {
    parts.push(`<span class="prefill">decode step ${ms(s.predicted_compute_s)}, prefill ` +
      `(64-token prompt) ${ms(s.predicted_prefill_s)}</span>`);
  }
  return parts.length ? `<p class="stage-note">${parts.join(" · ")}</p>` : "";
}

// The memory the plan predicts loading a stage takes: what the agent measures after loading
// (the sessions' KV reserve is allocated per session and drawn as its own bar).
function loaded(s) {
  return s.predicted_memory_bytes - (s.state_bytes || 0);
}

function renderStages(box, view) {
  const memMax = Math.max(...view.stages.flatMap(s =>
    [s.budget_bytes || 0, s.predicted_memory_bytes, s.measured_memory_bytes || 0]));
  const timeMax = Math.max(...view.stages.flatMap(s =>
    [s.predicted_compute_s, s.predicted_transfer_s || 0, s.measured_compute_s || 0]));
  box.innerHTML = view.stages.map(s => `
    <article class="stage card${s.bottleneck ? " bottleneck" : ""}" data-device="${esc(s.device)}">
      <h4>Stage ${s.index + 1}: ${esc(s.device)}${s.bottleneck ? ' <span class="badge">bottleneck</span>' : ""}</h4>
      <p class="units">${unitText(s, view.total_units)}</p>
      <svg class="chart bars memory-bars" role="img"
        aria-label="Memory on ${esc(s.device)}: budget ${mb(s.budget_bytes)}, predicted ${mb(loaded(s))} to load${s.state_bytes ? ` and ${mb(s.state_bytes)} reserved for the sessions' KV cache` : ""}, measured ${mb(s.measured_memory_bytes)}"></svg>
      <svg class="chart bars time-bars" role="img"
        aria-label="Stage time on ${esc(s.device)}: predicted ${ms(s.predicted_compute_s)}, measured ${ms(s.measured_compute_s)}"></svg>
      ${timeNote(s, view)}
    </article>`).join("");
  const cards = box.querySelectorAll("article.stage");
  view.stages.forEach((s, k) => {
    Charts.hbars(cards[k].querySelector(".memory-bars"), [
      {label: "budget", value: s.budget_bytes, cls: "budget", text: mb(s.budget_bytes)},
      {label: "predicted", value: loaded(s), cls: "predicted", text: mb(loaded(s))},
      ...(s.state_bytes ? [{label: "KV reserve", value: s.state_bytes, cls: "kv",
        text: mb(s.state_bytes)}] : []),
      ...(view.plan_version ? [{label: "measured", value: s.measured_memory_bytes, cls: "measured",
        text: mb(s.measured_memory_bytes)}] : []),
    ], memMax);
    const rows = [{label: "predicted", value: s.predicted_compute_s, cls: "predicted",
      text: ms(s.predicted_compute_s)}];
    if (s.predicted_transfer_s !== null) {
      rows.push({label: "send", value: s.predicted_transfer_s, cls: "send", text: ms(s.predicted_transfer_s)});
    }
    if (view.plan_version) {
      rows.push({label: "measured", value: s.measured_compute_s, cls: "measured", text: ms(s.measured_compute_s)});
    }
    Charts.hbars(cards[k].querySelector(".time-bars"), rows, timeMax);
  });
}

function renderWhatIfDevices(view) {
  const online = FS.devices.filter(d => d.status === "paired" && d.online);
  const body = $("whatif-table").tBodies[0];
  const have = [...body.querySelectorAll("tr")].map(r => r.dataset.device).join(",");
  if (have === online.map(d => d.name).join(",") && have) return;
  body.innerHTML = online.map((d, k) => {
    const inPlan = view.stages.some(s => s.device === d.name);
    return `<tr data-device="${esc(d.name)}"><th scope="row">${esc(d.name)}${inPlan ? "" : " <span class=\"muted\">(unused)</span>"}</th>
      <td><label class="sr-only" for="wi-budget-${k}">Budget for ${esc(d.name)} in MB</label>
        <input id="wi-budget-${k}" class="wi-budget" type="number" min="0" step="any"
          value="${(d.announcement.profile.memory_bytes / MB).toFixed(0)}"></td>
      <td><input id="wi-drop-${k}" class="wi-drop" type="checkbox">
        <label for="wi-drop-${k}">drop ${esc(d.name)}</label></td></tr>`;
  }).join("") || `<tr><td colspan="3" class="muted">No paired device is online.</td></tr>`;
}

function whatIfBody() {
  const budgets = {}, drop = [];
  for (const row of $("whatif-table").tBodies[0].querySelectorAll("tr[data-device]")) {
    const name = row.dataset.device;
    if (row.querySelector(".wi-drop").checked) drop.push(name);
    const value = row.querySelector(".wi-budget").value;
    if (value !== "") budgets[name] = Math.round(Number(value) * MB);
  }
  // a slowness suggestion's measured slowdowns: the re-plan on the new measurements
  const body = {model: $("plan-model").value, budgets, drop, slowdown: FS.plan.slowdown};
  if ($("whatif-objective").value) body.objective = $("whatif-objective").value;
  return body;
}

async function runWhatIf() {
  await guarded("whatif-status", "Planning…", async () => {
    const body = whatIfBody();
    const answer = await api("POST", "/v1/plan/what-if", body);
    FS.plan.whatIf = body;
    const plan = answer.what_if, now = answer.current;
    renderStages($("whatif-result"), plan);
    $("whatif-deploy").hidden = false;
    const change = now && now.predicted_bottleneck_s
      ? ` (now ${ms(now.predicted_bottleneck_s)})` : "";
    return `The new plan uses ${plan.stages.length} stage(s) on ` +
      `${plan.stages.map(s => s.device).join(" → ")}; predicted bottleneck ` +
      `${ms(plan.predicted_bottleneck_s)}${change}, latency ${ms(plan.predicted_latency_s)}.`;
  });
}

async function deployWhatIf() {
  const body = FS.plan.whatIf;
  if (!body) return;
  const record = (await api("GET", "/v1/deployments")).find(m => m.model_id === body.model);
  const active = record && record.versions.find(v => v.version === record.active);
  if (!active) { status("whatif-deploy-status", "The model has no active version.", true); return; }
  const caps = {...body.budgets};
  for (const name of body.drop) caps[name] = 0;
  await deploy({model_path: active.source, model_id: body.model, memory_caps: caps,
    objective: body.objective || active.objective}, "whatif-deploy-status");
}
