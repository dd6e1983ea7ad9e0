"""The dashboard page: one self-contained HTML document (inline CSS, JS and SVG charts, nothing fetched
from the internet) that renders the collector's view and then polls `/api/summary` every few seconds.

The first view is embedded in the page (so it shows data at once, even before its first poll), as
JSON inside a ``<script type="application/json">`` with ``<`` escaped. Every value is put into the DOM
with `textContent`, never as markup: peer IDs, reasons and devices come from other peers' records.
Numbers that tests and people look for are in tables (peers, the last evaluations), not only in charts.
Charts are drawn at their element's width (again when it changes), so labels keep their size on a phone,
where tables show short peer IDs and scroll sideways (with a hint when columns lie beyond the edge), except
the peers table, which stacks each peer's cells one below the other with their column names, and the
synchronizer change marks get short labels placed by their measured width (never over another); series
colours are inline styles (a class rule's ``fill`` would override an attribute).
"""

from __future__ import annotations

import json
from typing import Any

POLL_MS = 2000

_STYLE = """
body{font:14px system-ui,sans-serif;margin:16px;background:#fafafa;color:#222}
h1{font-size:20px;margin:0 0 4px} h2{font-size:15px;margin:18px 0 6px}
.sub{color:#666;margin-bottom:10px;overflow-wrap:anywhere}
.grid{display:grid;grid-template-columns:repeat(auto-fit,minmax(min(520px,100%),1fr));gap:12px}
.card{background:#fff;border:1px solid #ddd;border-radius:6px;padding:10px;min-width:0;overflow-x:auto}
@media (max-width:600px){body{margin:8px} .card{padding:6px} .kpi{margin-right:12px} td,th{padding:3px 4px}}
.scroll{overflow-x:auto;max-width:100%;-webkit-overflow-scrolling:touch}
.more{color:#888;font-size:11px;text-align:right}
@media (max-width:600px){table.stack tr:first-child{display:none}
 table.stack,table.stack tbody,table.stack tr{display:block}
 table.stack tr{border-bottom:1px solid #ddd;padding:3px 0}
 table.stack td{display:flex;justify-content:space-between;gap:8px;border:0;padding:1px 4px;
 white-space:normal}
 table.stack td:first-child{font-weight:600}
 table.stack td[data-label]::before{content:attr(data-label);color:#555;font-family:system-ui,sans-serif}}
.kpi{display:inline-block;margin-right:22px} .kpi b{font-size:18px;display:block}
table{border-collapse:collapse;width:100%;font-size:12px}
td,th{padding:3px 6px;border-bottom:1px solid #eee;text-align:right;white-space:nowrap}
td:first-child,th:first-child{text-align:left;font-family:monospace} th{color:#555;font-weight:600}
svg{display:block;width:100%;height:220px} .axis{stroke:#999} .lbl{font-size:10px;fill:#555}
.mark{stroke:#d33;stroke-dasharray:4 3}
.stale{color:#b60}
"""

_SCRIPT = r"""
const COLORS = ["#1f77b4","#ff7f0e","#2ca02c","#d62728","#9467bd","#8c564b","#e377c2","#7f7f7f"];
const NS = "http://www.w3.org/2000/svg";
function el(tag, attrs, text) {
  const e = tag.startsWith("svg:") ? document.createElementNS(NS, tag.slice(4)) : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined && text !== null) e.textContent = String(text);
  return e;
}
function fmt(x, d) {
  if (x === null || x === undefined) return "-";
  return typeof x === "number" ? x.toFixed(d ?? 0) : String(x);
}
function human(n) {
  if (n === null || n === undefined) return "-";
  const u = ["", "k", "M", "G", "T"]; let i = 0;
  while (Math.abs(n) >= 1000 && i < u.length - 1) { n /= 1000; i++; }
  return n.toFixed(i ? 1 : 0) + u[i];
}
function clock(t) { return new Date(t * 1000).toISOString().substr(11, 8); }
function short(id) { return id ? id.slice(0, 12) + "…" + id.slice(-4) : "-"; }
function pid(id) { return window.innerWidth < 600 ? short(id) : id; }  // whole peer IDs where they fit
function chart(id, series, opts) {
  const svg = document.getElementById(id); while (svg.firstChild) svg.removeChild(svg.firstChild);
  const W = Math.max(260, Math.round(svg.getBoundingClientRect().width) || 600),
    H = 220, L = 48, R = 10, T = 10, B = 28;
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`); svg.dataset.w = W;
  const xt = W < 420 ? 2 : 4;
  const pts = series.flatMap(s => s.points);
  if (!pts.length) {
    svg.appendChild(el("svg:text", {x: W / 2, y: H / 2, class: "lbl", "text-anchor": "middle"},
      "no data yet"));
    return;
  }
  let [x0, x1] = [Math.min(...pts.map(p => p[0])), Math.max(...pts.map(p => p[0]))];
  let [y0, y1] = [Math.min(...pts.map(p => p[1])), Math.max(...pts.map(p => p[1]))];
  if (x1 === x0) x1 = x0 + 1; if (y1 === y0) { y1 += 0.5; y0 -= 0.5; }
  const pad = (y1 - y0) * 0.05, low = y0; y0 -= pad; y1 += pad;
  if (opts.floor0 && low >= 0) y0 = Math.max(y0, 0);
  const sx = x => L + (x - x0) / (x1 - x0) * (W - L - R),
    sy = y => H - B - (y - y0) / (y1 - y0) * (H - T - B);
  svg.appendChild(el("svg:line", {x1: L, y1: H - B, x2: W - R, y2: H - B, class: "axis"}));
  svg.appendChild(el("svg:line", {x1: L, y1: T, x2: L, y2: H - B, class: "axis"}));
  const step = Math.max(1, Math.ceil((y1 - y0) / 4));
  const yticks = opts.integer
    ? Array.from({length: Math.floor(y1) - Math.ceil(y0) + 1}, (_, i) => Math.ceil(y0) + i)
      .filter(k => k % step === 0)
    : [0, 1, 2, 3, 4].map(i => y0 + (y1 - y0) * i / 4);
  for (const y of yticks)
    svg.appendChild(el("svg:text", {x: L - 4, y: sy(y) + 3, class: "lbl", "text-anchor": "end"},
      opts.yfmt(y)));
  for (let i = 0; i <= xt; i++) {
    const x = x0 + (x1 - x0) * i / xt;
    svg.appendChild(el("svg:text",
      {x: sx(x), y: H - B + 14, class: "lbl", "text-anchor": i === xt ? "end" : "middle"}, opts.xfmt(x)));
  }
  svg.appendChild(
    el("svg:text", {x: (L + W - R) / 2, y: H - 2, class: "lbl", "text-anchor": "middle"}, opts.xlabel));
  // a mark's label goes right of its line (left near the edge), on the first free row
  const rows = [[], [], []];
  for (const m of opts.marks || []) {
    if (m.x < x0 || m.x > x1) continue;
    const x = sx(m.x);
    svg.appendChild(el("svg:line", {x1: x, y1: T, x2: x, y2: H - B, class: "mark"}));
    // the label as drawn (its measured width), short on a narrow chart: "rotation → term 5" or "→ t5"
    const text = el("svg:text", {x: 0, y: 0, class: "lbl", style: "fill:#d33"}, W < 560 ? m.short : m.label);
    svg.appendChild(text);
    const w = (text.getComputedTextLength && text.getComputedTextLength()) || 6 * text.textContent.length;
    const span = x + 3 + w <= W - R ? [x + 3, x + 3 + w] : x - 3 - w >= L ? [x - 3 - w, x - 3] : null;
    const row = span ? rows.findIndex(r => r.every(([a, b]) => span[1] + 4 < a || span[0] > b + 4)) : -1;
    if (row < 0) { svg.removeChild(text); continue; }  // no room: the line stays, the changes table names it
    rows[row].push(span);
    text.setAttribute("x", span[0]); text.setAttribute("y", T + 10 + 11 * row);
  }
  let lx = L + 6;
  series.forEach((s, i) => {
    if (!s.points.length) return;
    const color = s.color || COLORS[i % COLORS.length];
    const d = s.points.map((p, j) => (j ? "L" : "M") + sx(p[0]).toFixed(1) + " " + sy(p[1]).toFixed(1))
      .join(" ");
    svg.appendChild(el("svg:path", {d, fill: "none", stroke: color, "stroke-width": 1.8}));
    if (s.dots)
      for (const p of s.points)
        svg.appendChild(el("svg:circle", {cx: sx(p[0]), cy: sy(p[1]), r: 2.2, fill: color}));
    svg.appendChild(el("svg:text", {x: lx, y: T + 44, class: "lbl legend", style: `fill:${color}`}, s.name));
    lx += 5.6 * s.name.length + 14;
  });
}
function table(id, head, rows) {
  const t = document.getElementById(id); while (t.firstChild) t.removeChild(t.firstChild);
  const tr = el("tr"); head.forEach(h => tr.appendChild(el("th", {}, h))); t.appendChild(tr);
  for (const r of rows) {
    const row = el("tr");  // labels: a narrow page stacks a "stack" table's cells under its first one
    r.forEach((c, i) => row.appendChild(el("td", i ? {"data-label": head[i]} : {}, c))); t.appendChild(row);
  }
  if (!rows.length) {
    const row = el("tr"); row.appendChild(el("td", {colspan: head.length}, "none")); t.appendChild(row);
  }
  const box = t.parentNode, more = box.nextElementSibling;  // a hint when columns lie beyond the edge
  if (more && more.classList.contains("more"))
    more.textContent = box.scrollWidth > box.clientWidth + 1 ? "scroll sideways for more columns →" : "";
}
function render(v) {
  const ev = v.eval, last = ev.length ? ev[ev.length - 1] : null, sync = v.synchronizer;
  document.getElementById("run").textContent = `run ${v.run_id} (manifest ${v.manifest_hash})`;
  document.getElementById("kpi-peers").textContent = v.peers.length;
  const held = s => s.synchronizer ? `${short(s.synchronizer.peer_id)} t${s.synchronizer.term}` : "none";
  const shards = (v.shards || []).length > 1 ? v.shards.map(s => `s${s.shard}: ${held(s)}`).join(", ") : "";
  document.getElementById("kpi-sync").textContent = shards || (sync ? short(sync.peer_id) : "none");
  document.getElementById("kpi-term").textContent = sync ? sync.term : v.highest_term;
  document.getElementById("last-loss").textContent = last ? last.loss.toFixed(4) : "-";
  document.getElementById("kpi-ppl").textContent = last ? last.perplexity.toFixed(2) : "-";
  document.getElementById("kpi-tokens").textContent = last ? human(last.tokens) : "-";
  document.getElementById("kpi-versions").textContent = v.fragments.map(f => "v" + f.version).join(" ");
  const h = v.health, stale = h.last_poll_age !== null && h.last_poll_age > 15;
  const st = document.getElementById("health");
  st.textContent = `updated ${clock(v.time)} · ${h.polls} polls, `
    + `${h.errors} failed, ${h.reconnects} DHT reconnects`
    + (h.last_error ? ` (last: ${h.last_error})` : "")
    + (stale ? ` · DHT unreachable for ${h.last_poll_age.toFixed(0)} s, showing the last view` : "");
  st.className = stale ? "sub stale" : "sub";
  const marks = v.versions.marks.map(m =>
    ({x: m.t, label: `${m.kind} → term ${m.term}`, short: `→ t${m.term}`}));
  chart("c-loss-time", [{name: "eval loss", points: ev.map(p => [p.t, p.loss]), dots: true}],
    {xfmt: clock, yfmt: y => y.toFixed(2), xlabel: "time (UTC)", marks});
  chart("c-loss-tokens",
    [{name: "eval loss", points: ev.map(p => [p.tokens, p.loss]), dots: true, color: "#2ca02c"}],
    {xfmt: human, yfmt: y => y.toFixed(2), xlabel: "merged tokens"});
  const S = v.versions.samples, n = v.fragments.length;
  const vs = Array.from({length: n}, (_, i) =>
    ({name: "fragment " + i, points: S.filter(s => s.versions.length > i).map(s => [s.t, s.versions[i]])}));
  chart("c-versions", vs, {xfmt: clock, yfmt: y => y.toFixed(0), xlabel: "time (UTC)", marks, integer: true});
  chart("c-throughput",
    [{name: "tokens/s, all live peers", points: S.map(s => [s.t, s.tokens_per_s ?? 0]), color: "#ff7f0e"}],
    {xfmt: clock, yfmt: human, xlabel: "time (UTC)", marks, floor0: true});
  chart("c-train-loss",
    [{name: "training loss, mean of live peers",
      points: S.filter(s => s.train_loss !== null && s.train_loss !== undefined)
        .map(s => [s.t, s.train_loss]),
      color: "#1f77b4"}],
    {xfmt: clock, yfmt: y => y.toFixed(2), xlabel: "time (UTC)", marks});
  chart("c-terms", [{name: "synchronizer term", points: S.map(s => [s.t, s.term]), color: "#9467bd"}],
    {xfmt: clock, yfmt: y => y.toFixed(0), xlabel: "time (UTC)", marks, integer: true});
  table("t-peers",
    ["peer", "role", "tokens/s", "uptime", "link", "version lag", "device", "loss", "sent", "received"],
    v.peers.map(p => [pid(p.peer_id), p.listed === false ? p.role + " (claims)" : p.role, fmt(p.tokens_per_s),
      p.uptime === null ? "-" : fmt(p.uptime) + " s", p.link, fmt(p.version_lag), p.device || "-",
      fmt(p.loss, 3), human(p.bytes_sent), human(p.bytes_received)]));
  table("t-eval", ["time", "evaluator", "term", "merged tokens", "versions", "eval loss", "perplexity"],
    ev.slice(-8).reverse().map(p => [clock(p.t), short(p.evaluator), p.term, human(p.tokens),
      p.versions.join(","), p.loss.toFixed(4), p.perplexity.toFixed(2)]));
  table("t-contrib", ["peer", "merged tokens", "updates"],
    v.contributions.map(c => [pid(c.peer_id), human(c.tokens), c.updates]));
  table("t-reasons", ["reason", "count"], v.rejections.by_reason.map(r => [r.reason, r.count]));
  table("t-senders", ["sender", "reason", "count"],
    v.rejections.by_sender.map(r => [pid(r.sender), r.reason, r.count]));
  table("t-failovers", ["time", "kind", "from", "to", "term"],
    v.versions.marks.slice().reverse().map(m => [clock(m.t), m.kind, short(m.from), short(m.to), m.term]));
  document.getElementById("bytes").textContent =
    `sent ${human(v.bytes.sent)}B, received ${human(v.bytes.received)}B `
    + "(peers' transport frames since their start)";
}
async function poll() {
  try { const r = await fetch("/api/summary", {cache: "no-store"}); if (r.ok) draw(await r.json()); }
  catch (e) { document.getElementById("health").textContent = "dashboard unreachable: " + e; }
  setTimeout(poll, POLL_MS);
}
let shown = JSON.parse(document.getElementById("initial").textContent);
const draw = v => { shown = v; render(v); };
render(shown);
// charts are drawn at their width: draw them again when an element's width differs from what it was drawn at
const resized = new ResizeObserver(entries => {
  if (entries.some(e =>
    Math.abs(Math.max(260, Math.round(e.contentRect.width)) - Number(e.target.dataset.w)) > 1)) render(shown);
});
document.querySelectorAll("svg").forEach(svg => resized.observe(svg));
setTimeout(poll, POLL_MS);
"""

_BODY = """
<h1>p2p_diloco dashboard</h1><div class="sub" id="run"></div><div class="sub" id="health"></div>
<div class="card">
<span class="kpi">live peers<b id="kpi-peers">-</b></span><span
class="kpi">synchronizer<b id="kpi-sync">-</b></span>
<span class="kpi">term<b id="kpi-term">-</b></span><span
class="kpi">global eval loss<b id="last-loss">-</b></span>
<span class="kpi">perplexity<b id="kpi-ppl">-</b></span><span
class="kpi">merged tokens<b id="kpi-tokens">-</b></span>
<span class="kpi">fragment versions<b id="kpi-versions">-</b></span></div>
<div class="grid">
<div class="card"><h2>Global eval loss over time</h2><svg id="c-loss-time"></svg></div>
<div class="card"><h2>Global eval loss over merged tokens</h2><svg id="c-loss-tokens"></svg></div>
<div class="card"><h2>Fragment versions (synchronizer changes marked)</h2><svg id="c-versions"></svg></div>
<div class="card"><h2>Throughput (the peers' tokens/s, summed)</h2><svg id="c-throughput"></svg></div>
<div class="card"><h2>Training loss over time (mean of the live peers')</h2>
<svg id="c-train-loss"></svg></div>
<div class="card"><h2>Synchronizer term</h2><svg id="c-terms"></svg></div>
</div>
<div class="card"><h2>Peers</h2>
<div class="scroll"><table id="t-peers" class="stack"></table></div><div class="more"></div>
<div class="sub" id="bytes"></div></div>
<div class="card"><h2>Last global evaluations</h2>
<div class="scroll"><table id="t-eval"></table></div><div class="more"></div></div>
<div class="grid">
<div class="card"><h2>Contributions (merged tokens per peer)</h2>
<div class="scroll"><table id="t-contrib"></table></div><div class="more"></div></div>
<div class="card"><h2>Rejections by reason</h2>
<div class="scroll"><table id="t-reasons"></table></div><div class="more"></div></div>
<div class="card"><h2>Rejections by sender</h2>
<div class="scroll"><table id="t-senders"></table></div><div class="more"></div></div>
<div class="card"><h2>Synchronizer changes</h2>
<div class="scroll"><table id="t-failovers"></table></div><div class="more"></div></div>
</div>
"""


def render_page(view: dict[str, Any]) -> str:
    """The whole page with `view` embedded as its first data."""
    initial = json.dumps(view).replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    script = _SCRIPT.replace("POLL_MS", str(POLL_MS))
    return (
        "<!doctype html><html lang='en'><head><meta charset='utf-8'>"
        f"<title>p2p_diloco · {_escape(view.get('run_id', ''))}</title><style>{_STYLE}</style></head><body>"
        f"{_BODY}<script id='initial' type='application/json'>{initial}</script><script>{script}</script>"
        "</body></html>"
    )


def _escape(text: str) -> str:
    return str(text).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace("'", "&#39;")
