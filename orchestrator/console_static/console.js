// The Islands console: polls /api/state once a second and posts actions with the token.
// No library and nothing from the network beyond this console (the page's CSP forbids it).
"use strict";

const $ = (id) => document.getElementById(id);
const TOKEN_KEY = "islands-console-token";

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") node.className = v;
    else if (k.startsWith("data-")) node.setAttribute(k, v);
    else node[k] = v;
  }
  for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(c ?? ""));
  return node;
}

const fmt = {
  ratio: (x) => (x === null || x === undefined ? "–" : (100 * x).toFixed(1) + "%"),
  num: (x, d = 0) => (x === null || x === undefined ? "–" : Number(x).toLocaleString(undefined, {maximumFractionDigits: d, minimumFractionDigits: d})),
  secs: (x) => (x === null || x === undefined ? "–" : x < 1 ? (1000 * x).toFixed(0) + " ms" : x < 120 ? x.toFixed(1) + " s" : (x / 60).toFixed(1) + " min"),
};

async function act(body) {
  const token = $("token").value.trim();
  sessionStorage.setItem(TOKEN_KEY, token);
  const headers = {"Content-Type": "application/json"};
  if (token) headers["Authorization"] = "Bearer " + token;
  const out = $("result");
  try {
    const r = await fetch("/api/action", {method: "POST", headers, body: JSON.stringify(body)});
    const reply = await r.json();
    out.className = "result " + (reply.ok ? "ok" : "err");
    out.textContent = reply.ok ? `${body.action}: ${reply.message}` : `${body.action} refused (HTTP ${r.status}): ${reply.error}`;
    out.dataset.status = r.status;
    return reply;
  } catch (e) {
    out.className = "result err";
    out.textContent = `${body.action} failed: ${e}`;
  } finally {
    poll();
  }
}

// Rows and region blocks are built once and updated in place, so a poll never replaces the
// field an operator is typing in or the button under the pointer.
const rows = {}, regionBoxes = {};
const HEADERS = ["learner", "state", "step", "steps/s", "tokens", "restarts", "incarnation", "last beat", "devices", "profiler", ""];

function learnerRow(name) {
  const drain = el("button", {class: "act", "data-drain": name, title: "finish in-flight pushes, then leave"}, "Drain");
  drain.onclick = () => act({action: "drain", learner: name});
  const restart = el("button", {class: "act", "data-restart": name, title: "kill it; the fleet relaunches it (a crash restart)"}, "Restart");
  restart.onclick = () => act({action: "restart", learner: name});
  // A planned preemption of the node it runs on (islands drain-node): every learner there hands over.
  const node = el("button", {class: "act", "data-drain-node": name, title: "planned preemption of its node: Ray drains the node; its learners hand over to other nodes and leave"}, "Drain node");
  // The head node, or the last node of a region, is refused (Ray cannot undo a drain); the
  // operator may then force it, after a confirmation that names why it was refused.
  node.onclick = async () => {
    if (!node.dataset.node) return;
    const body = {action: "drain_node", node_id: node.dataset.node};
    const reply = await act(body);
    if (reply && !reply.ok && reply.forceable && confirm(`${reply.error}\n\nDrain it anyway?`)) act({...body, force: true});
  };
  const cells = HEADERS.slice(0, -1).map((h, i) => el("td", {class: i >= 2 && i <= 7 && i !== 5 ? "num" : ""}));
  cells[1].append(el("span", {class: "state"}));
  return el("tr", {"data-learner": name}, ...cells, el("td", {}, drain, " ", restart, " ", node));
}

// What JAX gave the learner at start, as it reported it ("gpu 1× NVIDIA H200").
function devicesText(d) {
  return d && d.backend ? `${d.backend} ${d.count}× ${d.kind}` : "–";
}

function updateRow(row, name, l) {
  const restarts = Object.entries(l.restarts || {}).map(([c, n]) => `${c} ${n}`).join(", ") || "0";
  const rate = l.step_time_s ? 1 / l.step_time_s : null;
  const c = row.cells, badge = c[1].firstChild;
  const text = [name, null, fmt.num(l.step), rate === null ? "–" : fmt.num(rate, 1) + "/s", fmt.num(l.tokens_done),
                restarts, String(l.incarnation), fmt.secs(l.last_heartbeat_s), devicesText(l.devices), l.profiler || ""];
  text.forEach((t, i) => { if (t !== null && c[i].textContent !== t) c[i].textContent = t; });
  badge.className = "state " + l.state;
  badge.dataset.state = l.state;
  badge.textContent = l.state;
  const gone = l.state === "retired" || l.state === "failed";
  // A crash loop names its resume step and error (why it is gone for good).
  if (l.crash_loop && !c[1].querySelector(".why")) c[1].append(el("small", {class: "why"}, " crash loop: " + l.crash_loop));
  for (const b of c[HEADERS.length - 1].querySelectorAll("button")) b.disabled = gone;
  const node = c[HEADERS.length - 1].querySelector("[data-drain-node]");
  node.dataset.node = l.node || "";
  node.title = l.node ? `planned preemption of node ${l.node}: its learners hand over to other nodes and leave` : "its node is not known yet";
  if (!l.node) node.disabled = true;
}

function regionBox(region, r) {
  const input = el("input", {type: "number", min: 0, max: r.max_learners, value: r.target, id: "scale-n-" + region});
  const button = el("button", {class: "act", id: "scale-" + region}, "Scale");
  button.onclick = () => act({action: "scale", region, n: parseInt(input.value, 10)});
  const info = el("small", {class: "info"});
  const body = el("tbody");
  const box = el("div", {class: "region", "data-region": region},
    el("div", {class: "region-head"}, el("strong", {}, region), info, r.remote ? "" : input, r.remote ? "" : button),
    el("table", {}, el("thead", {}, el("tr", {}, ...HEADERS.map((h) => el("th", {}, h)))), body));
  return {box, info, body};
}

function renderRegions(s) {
  for (const [region, r] of Object.entries(s.regions)) {
    if (!regionBoxes[region]) {
      regionBoxes[region] = regionBox(region, r);
      $("regions").append(regionBoxes[region].box);
    }
    const {info, body} = regionBoxes[region];
    const mine = Object.entries(s.learners).filter(([, l]) => l.region === region);
    for (const [name, l] of mine) {
      if (!rows[name]) { rows[name] = learnerRow(name); body.append(rows[name]); }
      updateRow(rows[name], name, l);
    }
    const live = mine.filter(([, l]) => !["retired", "failed"].includes(l.state)).length;
    info.textContent = `${live} live · target ${r.target} · max ${r.max_learners}${r.remote ? " · remote" : ""}`;
  }
}

function renderChart(series) {
  // Goodput over the last minutes: the run's (solid) and the sliding window's (dashed), 0..100%.
  const svg = $("chart"), W = 600, H = 120, ns = "http://www.w3.org/2000/svg";
  svg.replaceChildren();
  if (!series.length) return;
  const span = Math.max(30, ...series.map((p) => p[0]));
  $("chart-span").textContent = fmt.secs(span);
  const x = (ago) => W - (ago / span) * W, y = (v) => H - 4 - v * (H - 8);
  for (const v of [0, 0.5, 1]) {
    const g = document.createElementNS(ns, "line");
    Object.entries({x1: 0, x2: W, y1: y(v), y2: y(v), stroke: "#e5e7eb"}).forEach(([k, val]) => g.setAttribute(k, val));
    svg.append(g);
  }
  for (const [i, color, dash] of [[1, "#16a34a", ""], [2, "#2563eb", "4 3"]]) {
    const pts = series.filter((p) => p[i] !== null).map((p) => `${x(p[0]).toFixed(1)},${y(p[i]).toFixed(1)}`);
    if (!pts.length) continue;
    const line = document.createElementNS(ns, "polyline");
    Object.entries({points: pts.join(" "), fill: "none", stroke: color, "stroke-width": 2, "stroke-dasharray": dash, "vector-effect": "non-scaling-stroke"}).forEach(([k, val]) => line.setAttribute(k, val));
    svg.append(line);
  }
}

function renderBadput(g) {
  const box = $("badput");
  box.replaceChildren();
  const rows = [["goodput", g.goodput_s || 0, true], ...Object.entries(g.badput_s || {}).filter(([, v]) => v > 0.005).sort((a, b) => b[1] - a[1])];
  const top = Math.max(1e-9, ...rows.map((r) => r[1]));
  for (const [cause, secs, good] of rows) {
    box.append(el("span", {}, cause), el("div", {class: "bar" + (good ? " good" : ""), style: ""}), el("span", {class: "num"}, fmt.secs(secs)));
    box.children[box.children.length - 2].style.width = (100 * secs / top).toFixed(1) + "%";
  }
}

// Nodes whose device check failed for a region; an operator clears a fixed one
// (islands clear-misconfigured).
function renderMarks(marks) {
  $("misconfigured-card").hidden = !marks.length;
  $("misconfigured").tBodies[0].replaceChildren(...marks.map((m) => {
    const clear = el("button", {class: "act", "data-clear-node": m.node, title: "the node is fixed: its regions may use it again"}, "Clear");
    clear.onclick = () => act({action: "clear_misconfigured", node_id: m.node});
    return el("tr", {}, el("td", {}, m.node), el("td", {}, m.region), el("td", {}, m.blocked ? "yes" : "no"),
              el("td", {}, m.message), el("td", {}, clear));
  }));
}

function render(s) {
  $("job").textContent = s.job;
  const st = $("status");
  const marks = s.misconfigured || [];
  const wrong = marks.map((m) => `region ${m.region} on node ${m.node}${m.blocked ? " (region blocked)" : ""}: ${m.message}`);
  st.textContent = s.paused_reason ? "PAUSED: " + s.paused_reason
    : wrong.length ? "MISCONFIGURED " + wrong.join("; ") : `training · ${fmt.secs(s.elapsed_s)}`;
  st.className = "status " + (s.paused_reason || wrong.length ? "paused" : "ok");
  renderMarks(marks);
  $("goodput-run").textContent = fmt.ratio(s.goodput.goodput);
  $("goodput-window").textContent = fmt.ratio(s.goodput.window && s.goodput.window.ratio);
  $("window-label").textContent = "last " + (s.goodput.window ? s.goodput.window.label : "window");
  $("tokens-applied").textContent = fmt.num(s.tokens.applied);
  $("eval-loss").textContent = s.eval_loss === null ? "–" : s.eval_loss.toFixed(3);
  renderChart(s.goodput_series);
  renderBadput(s.goodput);
  renderRegions(s);
  const shards = s.syncer.shards && s.syncer.shards.length ? s.syncer.shards : [{shard: 0, epoch: s.syncer.epoch, merges: s.syncer.merges}];
  $("syncer").tBodies[0].replaceChildren(...shards.map((sh) => el("tr", {},
    el("td", {}, String(sh.shard)), el("td", {class: "num"}, String(sh.epoch)), el("td", {class: "num"}, fmt.num(sh.merges)),
    el("td", {}, Object.entries(sh.versions || s.syncer.versions || {}).map(([p, v]) => `${p}: ${v}`).join("  ")))));
  $("syncer-restarts").textContent = `syncer restarts: ${s.syncer_restarts}`;
  const part = s.participation || {last: {}};
  $("syncer-participation").textContent = "participation (last merge, learners/live): " +
    (Object.entries(part.last).map(([p, nm]) => `${p}: ${nm}`).join("  ") || "–") +
    (part.mean_ratio === null || part.mean_ratio === undefined ? "" : `; mean ${fmt.ratio(part.mean_ratio)} of the live learners over ${fmt.num(part.merges)} merges`);
  $("spares").tBodies[0].replaceChildren(...Object.entries(s.spares).map(([n, x]) => el("tr", {},
    el("td", {}, n), el("td", {}, x.region), el("td", {}, el("span", {class: "state " + x.state}, x.state)), el("td", {}, fmt.secs(x.age_s)))));
  const line = (e) => {
    const rest = Object.entries(e).filter(([k]) => !["t", "elapsed_s", "event"].includes(k)).map(([k, v]) => `${k}=${typeof v === "object" ? JSON.stringify(v) : v}`).join(" ");
    return el("li", {}, `${e.elapsed_s.toFixed(1)}s ${e.event} ${rest}`);
  };
  $("events").replaceChildren(...s.events.slice().reverse().map(line));
  $("refusals").replaceChildren(...(s.refusals.length ? s.refusals.slice().reverse().map(line) : [el("li", {}, "none")]));
  $("chaos-card").hidden = !s.allow_chaos;
}

let polling = false;
async function poll() {
  if (polling) return;
  polling = true;
  try {
    const r = await fetch("/api/state", {cache: "no-store"});
    render(await r.json());
  } catch (e) {
    $("status").textContent = "console unreachable: " + e;
    $("status").className = "status";
  } finally {
    polling = false;
  }
}

document.addEventListener("DOMContentLoaded", () => {
  $("token").value = sessionStorage.getItem(TOKEN_KEY) || "";
  $("pause").onclick = () => act({action: "pause"});
  $("resume").onclick = () => act({action: "resume"});
  for (const b of document.querySelectorAll("[data-chaos]")) {
    b.onclick = () => {
      const target = $("chaos-target").value.trim(), secs = parseFloat($("chaos-seconds").value);
      const kind = b.dataset.chaos;
      act(kind === "chaos_hang" ? {action: kind, learner: target, duration_s: secs}
        : kind === "chaos_slowdown" ? {action: kind, target, factor: 4, duration_s: secs}
        : {action: kind, region: target});
    };
  }
  poll();
  setInterval(poll, 1000);
});
