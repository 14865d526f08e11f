// The console's core: sign-in, the API client with plain-words errors, tabs, and the Devices
// and Models pages. Other pages live in plan.js, live.js and play.js and register themselves
// in FS.pages.
"use strict";

const FS = {token: "", pages: {}, page: null, timer: null, devices: [], models: [], book: null};
const $ = id => document.getElementById(id);
const esc = s => String(s ?? "").replace(/[&<>"']/g, c => `&#${c.charCodeAt(0)};`);
const MB = 1e6;
const mb = b => (b === null || b === undefined) ? "–" : (b / MB).toFixed(1) + " MB";
const ms = s => (s === null || s === undefined) ? "–" : (s * 1e3).toFixed(2) + " ms";
const sleep = t => new Promise(resolve => setTimeout(resolve, t));

class ApiError extends Error {
  constructor(message, status) { super(message); this.status = status; }
}

// What the API said, in plain words: {"detail": str}, validation lists, or OpenAI errors.
function plainError(status, data) {
  if (data && typeof data.detail === "string") return data.detail;
  if (data && Array.isArray(data.detail)) {
    return data.detail.map(d => {
      const where = (d.loc || []).filter(p => p !== "body").join(".");
      return where ? `${where}: ${d.msg}` : d.msg;
    }).join("; ");
  }
  if (data && data.error && data.error.message) return data.error.message;
  const words = {401: "The token was not accepted.", 404: "Not found on this coordinator.",
    500: "The coordinator hit an internal error (see its log).",
    502: "An agent failed to answer.", 503: "The model cannot be served right now."};
  return words[status] || `The coordinator answered ${status}.`;
}

async function request(method, path, body, extra = {}) {
  const headers = {"Authorization": "Bearer " + FS.token};
  if (body !== undefined) headers["Content-Type"] = "application/json";
  let response;
  try {
    response = await fetch(path, {method, headers,
      body: body === undefined ? undefined : JSON.stringify(body), ...extra});
  } catch (e) {
    if (e.name === "AbortError") throw e;
    throw new ApiError("Cannot reach the coordinator. Is it still running?", 0);
  }
  if (response.status === 401) { signOut("The token was not accepted. Sign in again."); }
  return response;
}

async function api(method, path, body) {
  const response = await request(method, path, body);
  let data = null;
  try { data = await response.json(); } catch (e) { data = null; }
  if (!response.ok) throw new ApiError(plainError(response.status, data), response.status);
  return data;
}

// Read a text/event-stream body; calls onEvent({event, data}) for every event.
async function readEvents(response, onEvent) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) break;
    buffer = (buffer + decoder.decode(value, {stream: true})).replace(/\r\n/g, "\n");
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const raw = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      let event = "message";
      const data = [];
      for (const lineText of raw.split("\n")) {
        if (lineText.startsWith("event:")) event = lineText.slice(6).trim();
        else if (lineText.startsWith("data:")) data.push(lineText.slice(5).replace(/^ /, ""));
      }
      if (data.length) onEvent({event, data: data.join("\n")});
    }
  }
}

function showError(message) {
  const box = $("error");
  box.textContent = message || "";
  box.hidden = !message;
}

function status(id, message, isError = false) {
  const node = $(id);
  node.textContent = message;
  node.classList.toggle("error-text", isError);
}

// Run an action from a form or button; errors go to the given status element.
async function guarded(statusId, busy, action) {
  if (busy) status(statusId, busy);
  try {
    const done = await action();
    status(statusId, done || "");
  } catch (e) {
    if (e.name !== "AbortError") status(statusId, e.message, true);
  }
}

// ------------------------------------------------------------------------ sign-in and tabs

function signOut(message) {
  FS.token = "";
  sessionStorage.removeItem("fedshard-token");
  clearInterval(FS.timer);
  if (FS.page && FS.pages[FS.page].hide) FS.pages[FS.page].hide();
  $("app").hidden = true;
  $("logout").hidden = true;
  $("login").hidden = false;
  $("conn").textContent = "";
  status("login-status", message || "", Boolean(message));
  $("token-input").focus();
}

async function signIn(token) {
  FS.token = token;
  try {
    await api("GET", "/v1/devices");
  } catch (e) {
    if (e.status !== 401) signOut(e.message);
    return;
  }
  sessionStorage.setItem("fedshard-token", token);
  $("login").hidden = true;
  $("app").hidden = false;
  $("logout").hidden = false;
  $("conn").textContent = `signed in to ${location.host}`;
  showPage(pageFromHash(), false);
}

function pageFromHash() {
  const name = location.hash.replace("#", "");
  return FS.pages[name] ? name : "devices";
}

function tabs() { return [...document.querySelectorAll('[role="tab"]')]; }

function showPage(name, focus) {
  if (FS.page && FS.page !== name && FS.pages[FS.page].hide) FS.pages[FS.page].hide();
  FS.page = name;
  for (const tab of tabs()) {
    const on = tab.dataset.page === name;
    tab.setAttribute("aria-selected", String(on));
    tab.tabIndex = on ? 0 : -1;
    $(tab.getAttribute("aria-controls")).hidden = !on;
    if (on && focus) tab.focus();
  }
  if (location.hash !== "#" + name) history.replaceState(null, "", "#" + name);
  showError("");
  clearInterval(FS.timer);
  const page = FS.pages[name];
  const tick = () => page.refresh().then(() => showError(""), e => showError(e.message));
  tick();
  if (page.every) FS.timer = setInterval(tick, page.every);
  if (page.show) page.show();
}

function tabKeys(event) {
  const list = tabs();
  const k = list.indexOf(event.target);
  const to = {ArrowRight: k + 1, ArrowLeft: k - 1, Home: 0, End: list.length - 1}[event.key];
  if (to === undefined) return;
  event.preventDefault();
  showPage(list[(to + list.length) % list.length].dataset.page, true);
}

// Fill a <select> with options, keeping the current choice when it is still there.
function fillSelect(select, options, emptyText) {
  const before = select.value;
  select.innerHTML = options.length
    ? options.map(o => `<option value="${esc(o.value)}">${esc(o.label)}</option>`).join("")
    : `<option value="">${esc(emptyText)}</option>`;
  if (options.some(o => o.value === before)) select.value = before;
}

async function loadModels() {
  FS.models = await api("GET", "/v1/console/models");
  return FS.models;
}

function modelOptions(filter = () => true) {
  return FS.models.filter(m => m.active !== null && filter(m))
    .map(m => ({value: m.model_id, label: `${m.model_id} (v${m.active}, ${m.kind}${ggufText(m)})`}));
}

// ", Qwen2.5 Coder 1.5B Instruct from qwen.gguf: qwen2, 1544M parameters, Q4_K 61% Q6_K 22%"
// for a model served from a GGUF file (its card), "" otherwise.
function ggufText(m) {
  const g = m.gguf;
  if (!g) return "";
  const mix = Object.entries(g.quantization)
    .map(([kind, count]) => `${kind} ${Math.round(100 * count / Math.max(g.parameters, 1))}%`)
    .join(" ");
  return `, ${g.name || g.file} from ${g.file}: ${g.architecture}, ` +
    `${Math.round(g.parameters / 1e6)}M parameters, ${mix}`;
}

// ------------------------------------------------------------------------------- devices

FS.pages.devices = {
  every: 2000,
  async refresh() {
    const [devices, book, links, models] = await Promise.all([api("GET", "/v1/devices"),
      api("GET", "/v1/pairing"), api("GET", "/v1/links").catch(() => []),
      api("GET", "/v1/deployments").catch(() => [])]);
    FS.devices = devices;
    FS.book = book;
    renderPaired(devices, versionNames(models));
    renderPending(book);
    $("revoked-list").innerHTML = [...new Set(book.revoked_names)].map(n =>
      `<li>${esc(n)}</li>`).join("") || "<li class=\"muted\">none</li>";
    renderLinks(devices, links);
  },
};

// A plan version (the agents' key of a deployed version) as every page names it: "MODEL vN".
function versionNames(models) {
  const names = {};
  for (const m of models) for (const v of m.versions) names[v.plan_version] = `${m.model_id} v${v.version}`;
  return names;
}

function renderPaired(devices, names) {
  const rows = devices.filter(d => d.status === "paired");
  $("paired-table").tBodies[0].innerHTML = rows.map(d => {
    const p = d.announcement.profile;
    return `<tr data-device="${esc(d.name)}"><td>${esc(d.name)}</td>
      <td>${d.online ? "online" : "offline"}</td><td>${esc(d.host)}</td>
      <td>${p.gflops.toFixed(1)}</td><td>${mb(p.memory_bytes)}</td>
      <td>${esc(names[d.announcement.state.plan_version] || "–")}</td>
      <td><button type="button" class="revoke" data-name="${esc(d.name)}">Revoke</button></td></tr>`;
  }).join("") || `<tr><td colspan="7" class="muted">No paired device yet.</td></tr>`;
}

function renderPending(book) {
  $("pending-table").tBodies[0].innerHTML = book.pending.map(p =>
    `<tr data-device="${esc(p.name)}"><td>${esc(p.name)}</td><td><code>${esc(p.key_id || "")}</code></td>
      <td>${new Date(p.requested_at * 1000).toLocaleTimeString()}</td>
      <td><button type="button" class="pick" data-name="${esc(p.name)}">Approve…</button></td></tr>`
  ).join("") || `<tr><td colspan="4" class="muted">No device is waiting.</td></tr>`;
  fillSelect($("approve-name"), book.pending.map(p => ({value: p.name, label: p.name})),
    "no device is waiting");
}

function bandwidth(mbps) {
  if (mbps >= 1e6) return `${(mbps / 1e6).toFixed(1)} Tbit/s`;
  if (mbps >= 1e3) return `${(mbps / 1e3).toFixed(1)} Gbit/s`;
  return `${mbps.toFixed(mbps >= 10 ? 0 : 2)} Mbit/s`;
}

function renderLinks(devices, links) {
  const paired = devices.filter(d => d.status === "paired" && d.online);
  Charts.topology($("topology"), paired.map(d => ({name: d.name})),
    links.map(l => ({a: l.a, b: l.b, label: bandwidth(l.bandwidth_mbps)})));
  $("links-table").tBodies[0].innerHTML = links.map(l =>
    `<tr><td>${esc(l.a)} ↔ ${esc(l.b)}</td><td>${bandwidth(l.bandwidth_mbps)}</td>
      <td>${l.latency_ms.toFixed(2)} ms</td></tr>`).join("") ||
    `<tr><td colspan="3" class="muted">No link measured yet.</td></tr>`;
}

function wireDevices() {
  $("approve-form").addEventListener("submit", event => {
    event.preventDefault();
    const name = $("approve-name").value, code = $("approve-code").value.trim().toUpperCase();
    guarded("approve-status", "Approving…", async () => {
      await api("POST", "/v1/pairing/approve", {name, code});
      $("approve-code").value = "";
      await FS.pages.devices.refresh();
      return `${name} is paired.`;
    });
  });
  $("pending-table").addEventListener("click", event => {
    const button = event.target.closest("button.pick");
    if (!button) return;
    $("approve-name").value = button.dataset.name;
    $("approve-code").focus();
  });
  $("paired-table").addEventListener("click", event => {
    const button = event.target.closest("button.revoke");
    if (!button) return;
    const name = button.dataset.name;
    if (!confirm(`Revoke ${name}? It will be refused everywhere, for good.`)) return;
    guarded("approve-status", `Revoking ${name}…`, async () => {
      await api("POST", "/v1/pairing/revoke", {name});
      await FS.pages.devices.refresh();
      return `${name} is revoked.`;
    });
  });
  $("measure-links").addEventListener("click", () => guarded("links-status", "Measuring…",
    async () => {
      const links = await api("POST", "/v1/links/measure");
      await FS.pages.devices.refresh();
      return `${links.length} link(s) measured.`;
    }));
}

// -------------------------------------------------------------------------------- models

FS.pages.models = {
  every: 3000,
  async refresh() {
    const [records, devices] = await Promise.all([api("GET", "/v1/deployments"),
      api("GET", "/v1/devices"), loadModels()]);
    renderCaps(devices.filter(d => d.status === "paired" && d.online));
    $("models-list").innerHTML = records.map(renderModel).join("") ||
      `<p class="muted">Nothing is deployed yet.</p>`;
  },
};

function renderCaps(devices) {
  const box = $("deploy-caps");
  const have = [...box.querySelectorAll("input")].map(i => i.dataset.device).join(",");
  if (have === devices.map(d => d.name).join(",")) return;
  box.innerHTML = "<legend>Memory caps per device (MB, optional)</legend>" + devices.map((d, k) =>
    `<span class="cap"><label for="cap-${k}">${esc(d.name)}</label>
     <input id="cap-${k}" type="number" min="0" step="any" data-device="${esc(d.name)}"
       placeholder="${(d.announcement.profile.memory_bytes / MB).toFixed(0)}"></span>`).join("");
}

function lineage(record) {
  const versions = [...record.versions].sort((a, b) => a.version - b.version);
  return `<ol class="lineage" aria-label="Lineage of ${esc(record.model_id)}">` + versions.map((v, k) =>
    `<li class="state-${v.state}"><strong>v${v.version}</strong> ${esc(v.state)}
      <span class="muted">${k ? `from v${versions[k - 1].version}, ` : ""}` +
    `${new Date(v.created_at * 1000).toLocaleString()}, ${esc(v.source.split("/").pop())}</span></li>`
  ).join("") + "</ol>";
}

function renderModel(record) {
  const live = record.versions.filter(v => v.state !== "retired");
  const back = record.previous
    ? `<button type="button" class="rollback" data-model="${esc(record.model_id)}">
         Switch to v${record.previous} (roll back)</button>` : "";
  return `<article class="card model" data-model="${esc(record.model_id)}">
    <h3>${esc(record.model_id)}</h3>
    <p>Active: <strong>v${record.active ?? "–"}</strong>; previous (still loaded):
       v${record.previous ?? "–"} ${back}</p>
    <div class="scroll"><table><thead><tr><th scope="col">Version</th><th scope="col">State</th>
      <th scope="col">Stages</th><th scope="col">Devices</th><th scope="col">Health</th></tr></thead>
    <tbody>${live.map(v => `<tr><td>v${v.version}</td><td>${esc(v.state)}</td>
      <td>${v.segments.length}</td><td>${v.segments.map(s => esc(s.device)).join(" → ")}</td>
      <td>max diff ${v.health_max_abs_diff.toExponential(1)}</td></tr>`).join("")}</tbody></table></div>
    <h4>Lineage</h4>${lineage(record)}</article>`;
}

function deployCaps() {
  const caps = {};
  for (const input of $("deploy-caps").querySelectorAll("input")) {
    if (input.value !== "") caps[input.dataset.device] = Math.round(Number(input.value) * MB);
  }
  return caps;
}

async function deploy(body, statusId) {
  await guarded(statusId, "Deploying: planning, splitting, pushing and checking the segments " +
    "(this can take a minute or more)…", async () => {
    const version = await api("POST", "/v1/deployments", body);
    if (FS.pages[FS.page].refresh) await FS.pages[FS.page].refresh();
    return `${version.model_id} v${version.version} is live on ` +
      `${version.segments.length} stage(s).`;
  });
}

function wireModels() {
  $("deploy-form").addEventListener("submit", event => {
    event.preventDefault();
    const body = {model_path: $("deploy-path").value.trim(), objective: $("deploy-objective").value,
      memory_caps: deployCaps()};
    if ($("deploy-id").value.trim()) body.model_id = $("deploy-id").value.trim();
    deploy(body, "deploy-status");
  });
  $("models-list").addEventListener("click", event => {
    const button = event.target.closest("button.rollback");
    if (!button) return;
    const model = button.dataset.model;
    guarded("deploy-status", "Switching…", async () => {
      const v = await api("POST", `/v1/deployments/${encodeURIComponent(model)}/rollback`);
      await FS.pages.models.refresh();
      return `${model} now serves v${v.version}.`;
    });
  });
}

// ---------------------------------------------------------------------------------- start

function start() {
  wireDevices();
  wireModels();
  for (const page of Object.values(FS.pages)) if (page.wire) page.wire();
  for (const tab of tabs()) {
    tab.addEventListener("click", () => showPage(tab.dataset.page, false));
    tab.addEventListener("keydown", tabKeys);
  }
  window.addEventListener("hashchange", () => FS.token && showPage(pageFromHash(), false));
  $("login-form").addEventListener("submit", event => {
    event.preventDefault();
    signIn($("token-input").value.trim());
  });
  $("logout").addEventListener("click", () => signOut(""));
  const params = new URLSearchParams(location.search);
  const token = params.get("token") || sessionStorage.getItem("fedshard-token") || "";
  if (params.has("token")) {  // keep the token out of the address bar and history
    history.replaceState(null, "", location.pathname + location.hash);
  }
  if (token) signIn(token); else signOut("");
}

document.addEventListener("DOMContentLoaded", start);
