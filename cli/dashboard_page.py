"""The page `rlfabric dashboard` serves: plain HTML, CSS and a little JavaScript (no build
step). It reads `/api/stream` (server-sent events) and redraws the fleet at every event:
workers, jobs, what the fleet is to serve, the last commands with their acks, tokens served
per minute. Elements carry `data-` attributes (worker id, state, version) for scripts."""

PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>rlfabric fleet</title>
<style>
  body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5em; color: #1d2330; }
  h1 { font-size: 1.3em; margin: 0 0 .2em; } h2 { font-size: 1.05em; margin: 1.4em 0 .4em; }
  #status { color: #667; } #status.down { color: #b3261e; }
  table { border-collapse: collapse; width: 100%; }
  th, td { text-align: left; padding: .3em .6em; border-bottom: 1px solid #e3e6ee; }
  th { font-weight: 600; color: #556; background: #f6f7fb; }
  td.num { text-align: right; font-variant-numeric: tabular-nums; }
  .state { padding: .1em .5em; border-radius: .8em; background: #e8ecf7; }
  .state.ready { background: #dcf3e3; } .state.updating { background: #fff2cc; }
  .state.paused, .state.sleeping { background: #e9e4f7; } .state.draining { background: #fbe1de; }
  .note { color: #b3261e; } .muted { color: #889; }
  svg { width: 100%; height: 90px; background: #f6f7fb; }
</style>
</head>
<body>
<h1>rlfabric fleet <span id="prefix" class="muted"></span></h1>
<div id="status">connecting...</div>
<div id="desired"></div>
<h2>Workers (<span id="count">0</span>)</h2>
<table><thead><tr><th>worker</th><th>engine</th><th>model</th><th>state</th><th>version</th>
<th>in flight</th><th>adapters</th><th>up</th><th></th></tr></thead>
<tbody id="workers"></tbody></table>
<h2>Jobs</h2>
<table><thead><tr><th>job</th><th>state</th><th>adapters</th><th>in flight</th>
<th>weight</th><th>share (1 min)</th></tr></thead><tbody id="jobs"></tbody></table>
<h2>Last commands</h2>
<table><thead><tr><th>when</th><th>command</th><th>acked</th><th>refused</th><th>missing</th>
<th>seconds</th></tr></thead><tbody id="commands"></tbody></table>
<h2>Tokens served per minute <span id="chartmax" class="muted"></span></h2>
<svg id="chart" viewBox="0 0 600 90" preserveAspectRatio="none"></svg>
<script>
const $ = (id) => document.getElementById(id);
const esc = (v) => String(v ?? "").replace(/[&<>"]/g, (c) =>
  ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;"})[c]);
const when = (t) => new Date(t * 1000).toLocaleTimeString();
function rows(el, items, cells) {
  el.innerHTML = items.map(cells).join("") ||
    '<tr><td colspan="9" class="muted">none</td></tr>';
}
function draw(f) {
  $("prefix").textContent = "(" + f.prefix + ")";
  $("desired").textContent = f.desired;
  $("count").textContent = f.workers.length;
  rows($("workers"), f.workers, (w) =>
    `<tr data-worker="${esc(w.worker_id)}" data-state="${esc(w.state)}" ` +
    `data-version="${esc(w.weight_version)}"><td>${esc(w.worker_id)}</td>` +
    `<td>${esc(w.engine)}</td><td>${esc(w.model)}</td>` +
    `<td><span class="state ${esc(w.state)}">${esc(w.state)}</span></td>` +
    `<td class="num">${esc(w.weight_version)}</td>` +
    `<td class="num">${esc(w.in_flight)} / ${esc(w.capacity)}</td>` +
    `<td>${esc(w.adapters)}</td><td class="num">${Math.round(w.age_s)} s</td>` +
    `<td class="note">${esc(w.note)}</td></tr>`);
  rows($("jobs"), f.jobs, (j) =>
    `<tr data-job="${esc(j.job)}"><td>${esc(j.job || "(pool)")}</td><td>${esc(j.state)}</td>` +
    `<td>${esc(j.adapters)}</td><td class="num">${esc(j.in_flight)}</td>` +
    `<td class="num">${esc(j.weight)}</td><td class="num">${esc(j.share_1m)}</td></tr>`);
  rows($("commands"), f.commands, (c) =>
    `<tr data-op="${esc(c.op)}" data-version="${esc(c.version)}" title="${esc(c.text)}">` +
    `<td>${when(c.at)}</td><td>${esc(c.op)}${c.version >= 0 ? " v" + c.version : ""}</td>` +
    `<td>${esc(c.ok.join(", ") || "-")}</td>` +
    `<td>${esc(Object.entries(c.failed).map(([w, e]) => w + " (" + e + ")").join(", ") || "-")}` +
    `</td><td>${esc(c.missing.join(", ") || "-")}</td>` +
    `<td class="num">${c.seconds.toFixed(3)}</td></tr>`);
  const pts = f.tokens_per_min, top = Math.max(1, ...pts.map((p) => p[1]));
  const t0 = pts.length ? pts[0][0] : 0, span = Math.max(1, (pts.at(-1) || [0])[0] - t0);
  $("chart").innerHTML = '<polyline fill="none" stroke="#3d5afe" stroke-width="2" points="' +
    pts.map((p) => `${(600 * (p[0] - t0) / span).toFixed(1)},${(85 - 80 * p[1] / top).toFixed(1)}`)
      .join(" ") + '"/>';
  $("chartmax").textContent = "(" + top + " at most, over the last minutes)";
  $("status").textContent = "live, as of " + when(f.at);
  $("status").className = "";
}
const source = new EventSource("api/stream");
source.onmessage = (e) => draw(JSON.parse(e.data));
source.onerror = () => {
  $("status").textContent = "reconnecting...";
  $("status").className = "down";
};
</script>
</body>
</html>
"""
