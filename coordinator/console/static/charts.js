// Small SVG charts drawn in the page: line charts, bar charts, horizontal bars, a heatmap and
// a link topology. No library: every element is created here with the DOM's SVG namespace.
"use strict";

const Charts = (() => {
  const NS = "http://www.w3.org/2000/svg";

  function el(name, attrs = {}, text) {
    const node = document.createElementNS(NS, name);
    for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, String(v));
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function clear(svg, width, height) {
    for (const child of [...svg.childNodes]) {
      if (child.nodeName !== "title") svg.removeChild(child);
    }
    svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
    svg.setAttribute("preserveAspectRatio", "xMidYMid meet");
  }

  function fmt(v) {
    if (v === null || v === undefined || !isFinite(v)) return "–";
    const a = Math.abs(v);
    if (a >= 1e9) return (v / 1e9).toFixed(1) + "G";
    if (a >= 1e6) return (v / 1e6).toFixed(1) + "M";
    if (a >= 1e3) return (v / 1e3).toFixed(1) + "k";
    if (a >= 100) return v.toFixed(0);
    if (a >= 1) return v.toFixed(2);
    return v.toPrecision(2);
  }

  function empty(svg, message, width = 320, height = 160) {
    clear(svg, width, height);
    svg.appendChild(el("text", {x: width / 2, y: height / 2, "text-anchor": "middle",
      class: "chart-empty"}, message));
  }

  // series: [{name, cls, points: [[x, y], ...]}]; points with y === null are skipped.
  function line(svg, series, opts = {}) {
    const W = 320, H = 160, L = 44, R = 8, T = 10, B = 24;
    const all = series.flatMap(s => s.points.filter(p => p[1] !== null && isFinite(p[1])));
    if (!all.length) return empty(svg, opts.empty || "no data yet");
    clear(svg, W, H);
    let x0 = Math.min(...all.map(p => p[0])), x1 = Math.max(...all.map(p => p[0]));
    let y0 = opts.yMin ?? Math.min(0, ...all.map(p => p[1]));
    let y1 = opts.yMax ?? Math.max(...all.map(p => p[1]));
    if (x1 === x0) { x0 -= 1; x1 += 1; }
    if (y1 === y0) y1 = y0 + 1;
    const sx = x => L + (x - x0) / (x1 - x0) * (W - L - R);
    const sy = y => H - B - (y - y0) / (y1 - y0) * (H - T - B);
    svg.appendChild(el("line", {x1: L, y1: H - B, x2: W - R, y2: H - B, class: "axis"}));
    svg.appendChild(el("line", {x1: L, y1: T, x2: L, y2: H - B, class: "axis"}));
    svg.appendChild(el("text", {x: L - 4, y: T + 8, "text-anchor": "end", class: "tick"}, fmt(y1)));
    svg.appendChild(el("text", {x: L - 4, y: H - B, "text-anchor": "end", class: "tick"}, fmt(y0)));
    if (opts.xLabels !== false) {
      svg.appendChild(el("text", {x: L, y: H - 6, class: "tick"}, opts.xFormat ? opts.xFormat(x0) : fmt(x0)));
      svg.appendChild(el("text", {x: W - R, y: H - 6, "text-anchor": "end", class: "tick"},
        opts.xFormat ? opts.xFormat(x1) : fmt(x1)));
    }
    series.forEach((s, k) => {
      const pts = s.points.filter(p => p[1] !== null && isFinite(p[1]));
      const cls = s.cls || `series-${k}`;
      if (pts.length > 1) {
        svg.appendChild(el("polyline", {class: `line ${cls}`,
          points: pts.map(p => `${sx(p[0]).toFixed(1)},${sy(p[1]).toFixed(1)}`).join(" ")}));
      }
      if (opts.dots !== false) {
        for (const p of pts) {
          const dot = el("circle", {cx: sx(p[0]), cy: sy(p[1]), r: 3, class: `pt ${cls}`});
          dot.appendChild(el("title", {}, `${s.name}: ${fmt(p[1])} at ${fmt(p[0])}`));
          svg.appendChild(dot);
        }
      }
    });
    if (series.length > 1) {
      series.forEach((s, k) => svg.appendChild(el("text",
        {x: L + 6 + k * 52, y: T + 8, class: `legend-text ${s.cls || `series-${k}`}`}, s.name)));
    }
  }

  // values: [{label, value}]
  function bars(svg, values, opts = {}) {
    const W = 320, H = 160, L = 44, R = 8, T = 10, B = 24;
    if (!values.length) return empty(svg, opts.empty || "no data yet");
    clear(svg, W, H);
    const top = Math.max(...values.map(v => v.value), 1e-12);
    const slot = (W - L - R) / values.length;
    svg.appendChild(el("line", {x1: L, y1: H - B, x2: W - R, y2: H - B, class: "axis"}));
    svg.appendChild(el("text", {x: L - 4, y: T + 8, "text-anchor": "end", class: "tick"}, fmt(top)));
    values.forEach((v, k) => {
      const h = v.value / top * (H - T - B);
      const rect = el("rect", {x: L + k * slot + slot * 0.15, y: H - B - h, width: slot * 0.7,
        height: Math.max(h, 0), class: "bar"});
      rect.appendChild(el("title", {}, `${v.label}: ${fmt(v.value)}`));
      svg.appendChild(rect);
      if (values.length <= 20) {
        svg.appendChild(el("text", {x: L + (k + 0.5) * slot, y: H - 8, "text-anchor": "middle",
          class: "tick"}, v.label));
      }
    });
  }

  // One horizontal bar chart: rows [{label, value, cls}] on a shared scale up to `max`.
  function hbars(svg, rows, max, opts = {}) {
    const W = 320, row = 18, L = opts.labelWidth ?? 78, H = rows.length * row + 4;
    clear(svg, W, H);
    const scale = max > 0 ? (W - L - 60) / max : 0;
    rows.forEach((r, k) => {
      const y = 2 + k * row;
      svg.appendChild(el("text", {x: L - 4, y: y + 12, "text-anchor": "end", class: "tick"}, r.label));
      if (r.value !== null && r.value !== undefined) {
        const rect = el("rect", {x: L, y: y + 2, width: Math.max(1, r.value * scale),
          height: row - 6, class: `hbar ${r.cls || ""}`});
        rect.appendChild(el("title", {}, `${r.label}: ${r.text ?? fmt(r.value)}`));
        svg.appendChild(rect);
        svg.appendChild(el("text", {x: L + Math.max(1, r.value * scale) + 4, y: y + 12,
          class: "tick value"}, r.text ?? fmt(r.value)));
      } else {
        svg.appendChild(el("text", {x: L + 4, y: y + 12, class: "tick"}, "not measured"));
      }
    });
  }

  // Square matrix of values in [-1, 1] with row labels 1..n (the sentences are listed apart).
  function heatmap(svg, matrix) {
    const n = matrix.length, cell = 48, pad = 24, W = pad + n * cell, H = pad + n * cell;
    clear(svg, W, H);
    for (let i = 0; i < n; i++) {
      svg.appendChild(el("text", {x: pad - 6, y: pad + i * cell + cell / 2 + 4,
        "text-anchor": "end", class: "tick"}, String(i + 1)));
      svg.appendChild(el("text", {x: pad + i * cell + cell / 2, y: pad - 8,
        "text-anchor": "middle", class: "tick"}, String(i + 1)));
      for (let j = 0; j < n; j++) {
        const v = matrix[i][j], shade = Math.round(255 - Math.max(0, v) * 200);
        const g = el("g", {class: "cell"});
        g.appendChild(el("rect", {x: pad + j * cell, y: pad + i * cell, width: cell - 2,
          height: cell - 2, fill: `rgb(${shade},${shade},255)`}));
        g.appendChild(el("text", {x: pad + j * cell + cell / 2 - 1, y: pad + i * cell + cell / 2 + 4,
          "text-anchor": "middle", class: v > 0.6 ? "cell-text dark" : "cell-text"}, v.toFixed(2)));
        g.appendChild(el("title", {}, `sentence ${i + 1} vs ${j + 1}: ${v.toFixed(3)}`));
        svg.appendChild(g);
      }
    }
  }

  // nodes: [{name, cls}], edges: [{a, b, label}]; nodes on a circle, labels at edge midpoints.
  function topology(svg, nodes, edges) {
    const W = 360, H = 240, cx = W / 2, cy = H / 2, r = Math.min(W, H) / 2 - 36;
    if (!nodes.length) return empty(svg, "no paired devices yet", W, H);
    clear(svg, W, H);
    const at = {};
    nodes.forEach((n, k) => {
      const a = -Math.PI / 2 + 2 * Math.PI * k / nodes.length;
      at[n.name] = [cx + r * Math.cos(a), cy + r * Math.sin(a)];
    });
    for (const e of edges) {
      if (!at[e.a] || !at[e.b]) continue;
      const [x1, y1] = at[e.a], [x2, y2] = at[e.b];
      svg.appendChild(el("line", {x1, y1, x2, y2, class: "edge"}));
      svg.appendChild(el("text", {x: (x1 + x2) / 2, y: (y1 + y2) / 2 - 4, "text-anchor": "middle",
        class: "edge-label"}, e.label));
    }
    for (const n of nodes) {
      const [x, y] = at[n.name];
      const g = el("g", {class: `node ${n.cls || ""}`});
      g.appendChild(el("circle", {cx: x, cy: y, r: 16}));
      g.appendChild(el("text", {x, y: y + 30, "text-anchor": "middle", class: "node-label"}, n.name));
      svg.appendChild(g);
    }
  }

  return {line, bars, hbars, heatmap, topology, fmt, empty};
})();
