"""The web console: one static page at ``/`` that drives the token-protected API.

The page itself holds no data and needs no token; its script reads ``?token=`` from the address
the coordinator printed at start and calls the API with it as a bearer token: devices with their
status and pairing codes (approve by typing the code the agent shows), deployments with the plan
next to what the agents measured, and a rollback button.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import HTMLResponse

PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>fedshard coordinator</title>
<style>
body{font-family:system-ui,sans-serif;margin:2em;max-width:70em}
table{border-collapse:collapse;margin:.5em 0 1.5em}td,th{border:1px solid #ccc;padding:.3em .6em}
.paired{color:#070}.revoked,.impostor{color:#a00}.unpaired{color:#a60}#error{color:#a00}
</style></head><body>
<h1>fedshard coordinator</h1><p id="error"></p>
<h2>Devices</h2><table id="devices"></table>
<h2>Pairing requests</h2><table id="pending"></table>
<h2>Deployments</h2><div id="deployments"></div>
<script>
const token = new URLSearchParams(location.search).get("token") || "";
const api = async (method, path, body) => {
  const r = await fetch(path, {method, headers: {"Authorization": "Bearer " + token,
    "Content-Type": "application/json"}, body: body ? JSON.stringify(body) : undefined});
  const data = await r.json();
  if (!r.ok) throw new Error(data.detail || r.status);
  return data;
};
const esc = s => String(s).replace(/[&<>"']/g, c => "&#" + c.charCodeAt(0) + ";");
const row = (cells, tag="td") =>
  "<tr>" + cells.map(c => `<${tag}>${c}</${tag}>`).join("") + "</tr>";
async function approve(name) {
  const code = prompt(`Pairing code shown by ${name}:`);
  if (!code) return;
  try { await api("POST", "/v1/pairing/approve", {name, code}); } catch (e) { alert(e.message); }
  refresh();
}
async function rollback(model) {
  const path = `/v1/deployments/${encodeURIComponent(model)}/rollback`;
  try { await api("POST", path); } catch (e) { alert(e.message); }
  refresh();
}
async function refresh() {
  try {
    const [devices, book, deployments] = await Promise.all([api("GET", "/v1/devices"),
      api("GET", "/v1/pairing"), api("GET", "/v1/deployments")]);
    document.getElementById("devices").innerHTML = row(["name", "status", "online", "host",
      "memory MiB", "GFLOP/s"], "th") + devices.map(d => row([esc(d.name),
      `<span class="${esc(d.status)}">${esc(d.status)}</span>`, d.online, esc(d.host),
      (d.announcement.profile.memory_bytes / 2**20).toFixed(0),
      d.announcement.profile.gflops.toFixed(1)])).join("");
    document.getElementById("pending").innerHTML = row(["name", "code", ""], "th") +
      book.pending.map(p => row([esc(p.name), esc(p.code),
      `<button onclick="approve('${esc(p.name)}')">approve</button>`])).join("");
    document.getElementById("deployments").innerHTML = deployments.map(m =>
      `<h3>${esc(m.model_id)} (active v${m.active}, previous v${m.previous ?? "-"})
       <button onclick="rollback('${esc(m.model_id)}')">roll back</button></h3><table>` +
      row(["version", "state", "segment", "device", "predicted MB", "measured MB",
           "predicted ms", "warm-up ms"], "th") +
      m.versions.filter(v => v.state !== "retired").flatMap(v => v.segments.map(p => row([
        v.plan_version, v.state, p.index, esc(p.device),
        (p.predicted_memory_bytes / 1e6).toFixed(1), (p.measured_memory_bytes / 1e6).toFixed(1),
        (p.predicted_compute_s * 1e3).toFixed(2), (p.warmup_s * 1e3).toFixed(2)]))).join("") +
      "</table>").join("");
    document.getElementById("error").textContent = "";
  } catch (e) { document.getElementById("error").textContent = e.message; }
}
refresh(); setInterval(refresh, 2000);
</script></body></html>
"""


def install_console(app: FastAPI) -> None:
    """Serve the console page at ``/``."""

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    def console() -> str:
        return PAGE
