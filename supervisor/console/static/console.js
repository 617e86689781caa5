// corral console (docs/console.md). Everything that came from the runtime is put
// in the page as text (textContent, text nodes): never as HTML, never as a URL.
"use strict";

const $ = (id) => document.getElementById(id);
let csrf = "";

function el(tag, props, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(props || {})) {
    if (key === "text") node.textContent = value;
    else if (key === "class") node.className = value;
    else if (key === "onclick") node.addEventListener("click", value);
    else node.setAttribute(key, value);
  }
  for (const child of children) {
    node.append(typeof child === "string" ? document.createTextNode(child) : child);
  }
  return node;
}

function setText(node, text) {
  const value = text === null || text === undefined ? "" : String(text);
  if (node.textContent !== value) node.textContent = value;
}

async function api(path) {
  const response = await fetch(path, { credentials: "same-origin" });
  const body = await response.json();
  if (!response.ok) throw new Error(body.error || `HTTP ${response.status}`);
  return body;
}

async function post(path, data) {
  const response = await fetch(path, {
    method: "POST", credentials: "same-origin",
    headers: { "content-type": "application/json", "x-csrf-token": csrf },
    body: JSON.stringify(data),
  });
  const body = await response.json();
  if (!response.ok) throw new Error(body.error || `HTTP ${response.status}`);
  return body;
}

function sessionLink(name) {
  return el("a", { href: "#session/" + encodeURIComponent(name), text: name });
}

function age(at) {
  if (at === null || at === undefined) return "";
  const s = Math.max(0, Date.now() / 1000 - at);
  if (s < 60) return `${s.toFixed(0)}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m${String(Math.floor(s % 60)).padStart(2, "0")}s`;
  return `${Math.floor(s / 3600)}h${String(Math.floor((s % 3600) / 60)).padStart(2, "0")}m`;
}

function mib(n) {
  return n === null || n === undefined ? "" : `${(n / 1048576).toFixed(1)} MiB`;
}

// --- agents ------------------------------------------------------------------------
const COLUMNS = [
  ["name", "name"], ["kind", "kind"], ["state", "state"], ["phase", "phase"],
  ["turn", "turn"], ["busy", "busy call"], ["waiting", "waiting"], ["restarts", "restarts"],
  ["tokens", "tokens (of budget)"], ["cost", "cost"], ["cpu", "CPU %"], ["rss", "memory"],
  ["heartbeat_at", "heartbeat"], ["started_at", "uptime"], ["last_exit", "last exit"],
];
const agents = new Map(); // name -> {row, cells, data}
let sortKey = "name";
let sortDown = false;
let layoutQueued = false;

function cellText(key, d) {
  switch (key) {
    case "busy": return d.busy ? `${d.busy} ${age(d.busy_at)}` : "";
    case "heartbeat_at": return age(d.heartbeat_at);
    case "started_at": return d.state === "running" ? age(d.started_at) : "";
    case "rss": return mib(d.rss);
    case "cpu": return d.cpu === null ? "" : d.cpu.toFixed(1);
    case "cost": return d.cost === null ? "" : String(d.cost);
    case "waiting": return d.waiting ? String(d.waiting) : "";
    case "tokens": return d.tokens === null ? "" :
      d.budget_tokens ? `${d.tokens} of ${d.budget_tokens}` : String(d.tokens);
    default: return d[key];
  }
}

function buildHead() {
  const head = $("agents-head");
  for (const [key, label] of COLUMNS) {
    const th = el("th", { "data-key": key, text: label });
    th.addEventListener("click", () => {
      sortDown = sortKey === key ? !sortDown : false;
      sortKey = key;
      for (const other of head.children) other.removeAttribute("data-sort");
      th.setAttribute("data-sort", sortDown ? "down" : "up");
      queueLayout();
    });
    head.append(th);
  }
}

let rowTemplate = null; // one <tr> with a <td data-key> per column, cloned per child

function newRow(d) {
  if (!rowTemplate) {
    rowTemplate = el("tr", {}, ...COLUMNS.map(([key]) => el("td", { "data-key": key })));
  }
  const row = rowTemplate.cloneNode(true);
  row.setAttribute("data-name", d.name);
  const cells = {};
  COLUMNS.forEach(([key], i) => { cells[key] = row.children[i]; });
  if (d.kind === "agent") cells.name.append(sessionLink(d.name));
  return { row, cells, data: d };
}

function upsert(d) {
  let entry = agents.get(d.name);
  if (!entry) {
    entry = newRow(d);
    agents.set(d.name, entry);
  }
  entry.data = d;
  for (const [key] of COLUMNS) {
    if (key === "name" && d.kind === "agent") continue;
    setText(entry.cells[key], cellText(key, d));
  }
  if (entry.row.getAttribute("data-state") !== d.state) entry.row.setAttribute("data-state", d.state);
  if (entry.row.getAttribute("data-phase") !== (d.phase || "")) {
    entry.row.setAttribute("data-phase", d.phase || "");
  }
}

function remove(name) {
  const entry = agents.get(name);
  if (entry) { entry.row.remove(); agents.delete(name); }
}

function queueLayout() {
  if (layoutQueued) return;
  layoutQueued = true;
  requestAnimationFrame(layout);
}

function compare(a, b) {
  const x = a.data[sortKey], y = b.data[sortKey];
  if (x === y) return a.data.name < b.data.name ? -1 : 1;
  if (x === null || x === undefined) return 1;
  if (y === null || y === undefined) return -1;
  const order = typeof x === "number" && typeof y === "number" ? x - y
    : (String(x) < String(y) ? -1 : 1);
  return sortDown ? -order : order;
}

function layout() {
  layoutQueued = false;
  const words = $("filter").value.toLowerCase().split(/\s+/).filter(Boolean);
  const all = [...agents.values()].sort(compare);
  const body = $("agents-body");
  let shown = 0;
  const wanted = [];
  for (const entry of all) {
    const d = entry.data;
    let visible = true;
    if (words.length) {
      const hay = `${d.name} ${d.kind} ${d.state} ${d.phase || ""} ${d.busy || ""}`.toLowerCase();
      visible = words.every((w) => hay.includes(w));
    }
    if (entry.row.hidden === visible) entry.row.hidden = !visible;
    if (visible) shown += 1;
    wanted.push(entry.row);
  }
  const current = body.children;
  let same = current.length === wanted.length;
  for (let i = 0; same && i < wanted.length; i += 1) same = current[i] === wanted[i];
  if (!same) {
    const fragment = document.createDocumentFragment();
    for (const row of wanted) fragment.append(row);
    body.append(fragment);
  }
  const agentCount = all.filter((e) => e.data.kind === "agent").length;
  setText($("agents-summary"), `${all.length} children (${agentCount} agents), ${shown} shown`);
  const table = $("agents");
  table.setAttribute("data-rows", String(all.length));
  if (all.length && !table.hasAttribute("data-first-rendered")) {
    // the first full table, for ops/bench_console.py (first byte to rendered table)
    table.setAttribute("data-first-rendered", String(performance.now()));
  }
}

function tickAges() {
  for (const entry of agents.values()) {
    for (const key of ["busy", "heartbeat_at", "started_at"]) {
      setText(entry.cells[key], cellText(key, entry.data));
    }
  }
}

// --- live events -------------------------------------------------------------------
let queueItems = [];

function connect() {
  const source = new EventSource("/api/events");
  source.addEventListener("open", () => setText($("live"), "live"));
  source.addEventListener("error", () => setText($("live"), "reconnecting"));
  source.addEventListener("agents", (event) => {
    if (!performance.getEntriesByName("agents-frame").length) performance.mark("agents-frame");
    const rows = JSON.parse(event.data);
    const names = new Set(rows.map((r) => r.name));
    for (const name of [...agents.keys()]) if (!names.has(name)) remove(name);
    for (const row of rows) upsert(row);
    queueLayout();
  });
  source.addEventListener("delta", (event) => {
    const delta = JSON.parse(event.data);
    for (const name of delta.gone) remove(name);
    for (const row of delta.rows) upsert(row);
    queueLayout();
  });
  source.addEventListener("queue", (event) => {
    queueItems = JSON.parse(event.data);
    renderQueue();
  });
  source.addEventListener("down", (event) => {
    const banner = $("down");
    setText(banner, JSON.parse(event.data).reason);
    banner.hidden = false;
  });
  source.addEventListener("up", () => { $("down").hidden = true; });
}

// --- the operator's queue ---------------------------------------------------------
function resultLine(box) {
  return (promise) => promise.then(
    (body) => { box.className = "result ok"; setText(box, body.line); },
    (error) => { box.className = "result refused"; setText(box, error.message); });
}

function queueCard(item) {
  const card = el("div", { class: "card", "data-agent": item.agent, "data-request": item.request,
                           "data-kind": item.kind });
  const result = el("div", { class: "result" });
  const done = resultLine(result);
  card.append(el("div", { class: "card-head" }, sessionLink(item.agent), ` ${item.request} `,
                 el("span", { class: "tag", text: item.kind })));
  if (item.kind === "clarification") {
    card.append(el("div", { class: "question", text: item.question || "" }));
    const text = el("textarea", { rows: "3", maxlength: "32768", class: "answer-text",
                                  placeholder: "the exact answer" });
    const button = el("button", { type: "button", class: "answer", text: "Answer" });
    button.addEventListener("click", () => done(post("/api/answer", {
      agent: item.agent, request: item.request, text: text.value })));
    card.append(text, button);
  } else {
    card.append(el("div", { class: "permission" }, "asks approval for ",
                   el("code", { text: item.op }), " on ", el("code", { text: item.pattern })));
    const note = el("input", { type: "text", class: "note", placeholder: "note (optional)",
                               maxlength: "2000" });
    const send = (decision, always) => () => done(post("/api/approve", {
      agent: item.agent, request: item.request, decision, always,
      note: note.value ? note.value : null }));
    card.append(note,
      el("button", { type: "button", class: "approve", text: "Approve", onclick: send("approve", false) }),
      el("button", { type: "button", class: "approve-always", text: "Approve always", onclick: send("approve", true) }),
      el("button", { type: "button", class: "deny", text: "Deny", onclick: send("deny", false) }));
  }
  card.append(result);
  return card;
}

const cards = new Map(); // "agent request" -> card

function renderQueue() {
  setText($("queue-count"), queueItems.length);
  $("queue-empty").hidden = queueItems.length > 0;
  const wanted = new Set(queueItems.map((i) => `${i.agent} ${i.request}`));
  for (const [key, card] of cards) {
    if (!wanted.has(key)) {
      // keep the answered card a moment longer only if it shows a result
      card.classList.add("settled");
      card.querySelectorAll("button, textarea, input").forEach((n) => { n.disabled = true; });
      cards.delete(key);
    }
  }
  const box = $("queue");
  for (const item of queueItems) {
    const key = `${item.agent} ${item.request}`;
    if (!cards.has(key)) {
      const card = queueCard(item);
      cards.set(key, card);
      box.append(card);
    }
  }
}

function correctionForm(fixedAgent) {
  const box = el("div", { class: "correct" });
  const agent = el("input", { type: "text", class: "correct-agent", placeholder: "agent",
                              maxlength: "64" });
  if (fixedAgent) { agent.value = fixedAgent; agent.hidden = true; }
  const text = el("textarea", { rows: "3", class: "correct-text", maxlength: "32768",
                                placeholder: "a correction for its next model request" });
  const result = el("div", { class: "result" });
  const button = el("button", { type: "button", class: "correct-send", text: "Send correction" });
  button.addEventListener("click", () => resultLine(result)(post("/api/correct", {
    agent: agent.value, text: text.value })));
  box.append(agent, text, button, result);
  return box;
}

// --- a session ---------------------------------------------------------------------
let traceSource = null;

function showSession(name) {
  setText($("session-title"), name);
  const trace = $("trace");
  trace.replaceChildren();
  $("session-correct").replaceChildren(correctionForm(name));
  if (traceSource) traceSource.close();
  traceSource = new EventSource(`/api/trace/${encodeURIComponent(name)}/events?since=1`);
  traceSource.addEventListener("trace", (event) => {
    const batch = JSON.parse(event.data);
    const atBottom = trace.scrollTop + trace.clientHeight >= trace.scrollHeight - 4;
    const fragment = document.createDocumentFragment();
    for (const record of batch.records) {
      fragment.append(el("div", { class: record.abandoned ? "rec abandoned" : "rec",
                                  "data-seq": String(record.seq), "data-event": record.event,
                                  text: record.text }));
    }
    trace.append(fragment);
    if ($("follow").checked && atBottom) trace.scrollTop = trace.scrollHeight;
  });
  api(`/api/sessions/${encodeURIComponent(name)}`).then(renderLineage, (error) => {
    $("session-lineage").replaceChildren(el("p", { class: "refused", text: error.message }));
  });
}

let newestSession = "";

function renderLineage(data) {
  const box = $("session-lineage");
  box.replaceChildren();
  if (!data.sessions.length) box.append(el("p", { class: "muted", text: "no session yet" }));
  for (const s of data.sessions) {
    const item = el("div", { class: "session" },
      el("code", { text: s.session_id }), ` ${s.status}, ${s.turns} turns`);
    if (s.label) item.append(` "${s.label}"`);
    if (s.parent_session) {
      item.append(el("div", {}, "forked from ", sessionLink(s.parent_agent || ""), " ",
                     el("code", { text: s.parent_session })));
    }
    for (const child of s.children || []) {
      item.append(el("div", {}, "fork: ", sessionLink(child.agent), " ",
                     el("code", { text: child.session })));
    }
    box.append(item);
  }
  const newest = data.sessions[data.sessions.length - 1];
  newestSession = newest ? newest.session_id : data.agent;
  $("cmd-turn").max = String(newest ? Math.max(1, newest.turns) : 1);
  $("cmd-turn").value = String(newest ? Math.max(1, newest.turns) : 1);
  updateCommands();
}

function updateCommands() {
  const turn = Math.max(1, parseInt($("cmd-turn").value, 10) || 1);
  setText($("cmd-rewind"), `supervisor rewind ${newestSession} --to-turn ${turn}`);
  setText($("cmd-fork"), `supervisor fork ${newestSession} --name NEW --at-turn ${turn}`);
}

function copier(id) {
  return () => navigator.clipboard && navigator.clipboard.writeText($(id).textContent);
}

// --- storage -----------------------------------------------------------------------
function showStorage() {
  api("/api/storage").then((data) => {
    const u = data.usage;
    setText($("storage-total"), `${u.state_dir}: ${mib(u.total_bytes)}` +
      (u.max_bytes ? ` of ${mib(u.max_bytes)}` : "") + (u.over_cap ? " OVER CAP" : "") +
      `; WAL ${mib(u.wal_bytes)}; trees store ${u.tree_packs} packs, ${mib(u.tree_pack_bytes)}`);
    const tiers = $("tiers").tBodies[0];
    tiers.replaceChildren(...Object.entries(u.tiers).sort((a, b) => b[1] - a[1]).map(
      ([tier, size]) => el("tr", {}, el("td", { text: tier }), el("td", { text: mib(size) }))));
    const sessions = $("storage-sessions").tBodies[0];
    sessions.replaceChildren(...Object.entries(u.sessions).sort((a, b) => b[1].total - a[1].total)
      .map(([name, s]) => el("tr", {}, el("td", {}, sessionLink(name)),
        el("td", { text: mib(s.total) }), el("td", { text: mib(s.procs) }),
        el("td", { text: mib(s.generations) }), el("td", { text: mib(s.workspace) }),
        el("td", { text: s.pinned ? "pinned" : "" }))));
    const link = $("metrics-link");
    const url = data.metrics_url;
    const ours = typeof url === "string" && /^http:\/\/(127\.0\.0\.1|\[::1\]):\d+\/metrics$/.test(url);
    link.hidden = !ours;
    $("metrics-none").hidden = ours;
    if (ours) { link.href = url; setText(link, `Prometheus metrics (${url})`); }
    showFleet(data.fleet);
  }, (error) => setText($("storage-total"), error.message));
}

function showFleet(fleet) {
  $("fleet").hidden = !fleet;
  if (!fleet) return;
  setText($("fleet-error"), fleet.error || "");
  const state = (h) => (h.dead ? "dead" : h.stale ? "stale" : "live");
  $("fleet-hosts").tBodies[0].replaceChildren(...fleet.hosts.map((h) => el("tr", {},
    el("td", { text: h.host }), el("td", { text: state(h) }),
    el("td", { text: h.age_s === null || h.age_s === undefined ? "-" : `${h.age_s}s ago` }),
    el("td", { text: h.supervisor_pid ? String(h.supervisor_pid) : "-" }),
    el("td", { text: h.agents.join(", ") }))));
}

// --- pages -------------------------------------------------------------------------
function route() {
  const hash = decodeURIComponent(location.hash.slice(1));
  const [page, ...rest] = hash.split("/");
  const name = ["agents", "session", "queue", "storage"].includes(page) ? page : "agents";
  for (const section of document.querySelectorAll(".page")) {
    section.hidden = section.id !== `page-${name}`;
  }
  if (name !== "session" && traceSource) { traceSource.close(); traceSource = null; }
  if (name === "session") showSession(rest.join("/"));
  if (name === "storage") showStorage();
}

async function start() {
  buildHead();
  $("filter").addEventListener("input", queueLayout);
  $("cmd-turn").addEventListener("input", updateCommands);
  $("copy-rewind").addEventListener("click", copier("cmd-rewind"));
  $("copy-fork").addEventListener("click", copier("cmd-fork"));
  $("queue-correct").append(correctionForm(null));
  window.addEventListener("hashchange", route);
  connect(); // the table's first frame comes while the session is read
  try {
    const session = await api("/api/session");
    csrf = session.csrf;
    setText($("state-dir"), session.state_dir);
  } catch (error) {
    $("down").hidden = false;
    setText($("down"), error.message);
    return;
  }
  route();
  setInterval(tickAges, 1000);
}

document.addEventListener("DOMContentLoaded", start);
