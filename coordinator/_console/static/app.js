// saga console: one page over the console's JSON API. Everything shown comes from the
// log, which is hostile until proven otherwise: text goes in with textContent only.
"use strict";

const TOKEN = document.querySelector('meta[name="saga-console-token"]').content;
const OPERATOR = document.querySelector('meta[name="saga-console-operator"]').content;
const REFRESH_MS = 1500;
const HISTORY_MS = 5000;

const $ = (id) => document.getElementById(id);
let selected = null;        // the tx_id whose detail is open
let selectedRow = null;     // its latest row
let historyAt = 0;          // when its timeline was last fetched
let tab = "sagas";
let capabilities = {};

function el(tag, text, cls) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  if (cls) node.className = cls;
  return node;
}

function when(ms) {
  if (ms === null || ms === undefined) return "";
  const d = new Date(Number(ms));
  return isNaN(d) ? String(ms) : d.toLocaleString();
}

function ago(ms) {
  const s = Math.round((Date.now() - Number(ms)) / 1000);
  if (!isFinite(s)) return "";
  if (s < 0) return "in " + (-s) + " s";
  if (s < 120) return s + " s ago";
  if (s < 7200) return Math.round(s / 60) + " min ago";
  return Math.round(s / 3600) + " h ago";
}

function stateBadge(state) {
  return el("span", state, "state s-" + state);
}

async function api(path, options) {
  const response = await fetch(path, Object.assign({ credentials: "same-origin" }, options || {}));
  let body = null;
  try { body = await response.json(); } catch (e) { body = null; }
  if (!response.ok) {
    throw new Error((body && body.error) || ("the console answered " + response.status));
  }
  return body;
}

async function post(path, payload) {
  return api(path, {
    method: "POST",
    headers: { "Content-Type": "application/json", "X-Saga-Console-Token": TOKEN },
    body: JSON.stringify(payload),
  });
}

function toast(message, bad) {
  const t = $("toast");
  t.textContent = message;
  t.className = bad ? "bad" : "";
  t.hidden = false;
  clearTimeout(toast.timer);
  toast.timer = setTimeout(() => { t.hidden = true; }, 6000);
}

function replaceRows(tbody, rows) {
  tbody.replaceChildren(...rows);
}

// ---------------------------------------------------------------- sagas

async function refreshSagas() {
  const q = $("search").value.trim();
  const state = $("state").value;
  const params = new URLSearchParams({ q, state, limit: "200" });
  const data = await api("/api/sagas?" + params);
  // Rows are kept per tx_id and updated in place: the table refreshes every second or
  // two, and a row under the pointer must stay the same element.
  const tbody = $("sagas");
  const kept = new Map([...tbody.children].map((tr) => [tr.dataset.tx, tr]));
  const rows = data.sagas.map((s) => {
    let tr = kept.get(s.tx_id);
    if (!tr) {
      tr = el("tr");
      tr.dataset.tx = s.tx_id;
      for (let i = 0; i < 6; i++) tr.append(el("td"));
      tr.addEventListener("click", () => openSaga(tr.dataset.tx));
    }
    const [id, saga, state, steps, updated, reason] = tr.children;
    id.textContent = s.tx_id; id.className = "mono";
    saga.textContent = s.saga;
    if (state.textContent !== s.state) state.replaceChildren(stateBadge(s.state));
    steps.textContent = s.steps.map((p) => p.participant + ":" + p.status).join(" ");
    steps.className = "mono small";
    updated.textContent = ago(s.updated_ms);
    reason.textContent = s.reason || ""; reason.className = "reason";
    tr.classList.toggle("selected", s.tx_id === selected);
    return tr;
  });
  tbody.replaceChildren(...rows);
  $("row-count").textContent = rows.length + (rows.length >= 200 ? "+ rows (newest)" : " rows");
}

async function refreshMetrics() {
  const m = await api("/api/metrics");
  for (const [state, n] of Object.entries(m.counts)) {
    const node = $("m-" + state);
    if (node) node.textContent = n;
  }
  $("m-decided").textContent = m.decided_last_minute;
  $("m-dlq").textContent = m.dlq;
  const health = $("view-health");
  const ok = m.view === "ok";
  health.textContent = ok ? (m.caught_up ? "view live · " + m.database : "view catching up…")
    : "view: " + m.view;
  health.className = "tag " + (ok ? "ok" : "bad");
  if (m.forged_skipped) health.textContent += " · " + m.forged_skipped + " forged skipped";
  capabilities = m.capabilities || {};
  capabilities.why = m.actions_disabled;
  // The participants tab exists only where the participant registry is installed.
  $("tab-participants").hidden = !capabilities.participants;
}

// ---------------------------------------------------------------- one saga

function openSaga(txId) {
  selected = txId;
  selectedRow = null;
  historyAt = 0;
  $("detail").hidden = false;
  $("detail-tx").textContent = txId;
  $("timeline").replaceChildren();
  $("timeline-note").textContent = "loading…";
  if (location.hash !== "#tx=" + encodeURIComponent(txId)) {
    history.replaceState(null, "", "#tx=" + encodeURIComponent(txId));
  }
  for (const tr of $("sagas").children) tr.classList.toggle("selected", tr.dataset.tx === txId);
  refreshDetail();
}

function closeSaga() {
  selected = null;
  $("detail").hidden = true;
  history.replaceState(null, "", "#");
}

async function refreshDetail() {
  if (!selected) return;
  const txId = selected;
  let data;
  try {
    data = await api("/api/sagas/" + encodeURIComponent(txId));
  } catch (e) {
    $("detail-state").textContent = "not in the view (yet)";
    $("detail-state").className = "state";
    return;
  }
  if (txId !== selected) return;
  const s = data.saga;
  selectedRow = s;
  const state = $("detail-state");
  state.textContent = s.state;
  state.className = "state s-" + s.state;
  $("detail-saga").textContent = s.saga;
  $("detail-reason").textContent = s.reason || "—";
  $("detail-created").textContent = when(s.created_ms);
  $("detail-deadline").textContent = when(s.deadline_ms) + " (" + ago(s.deadline_ms) + ")";
  $("detail-updated").textContent = when(s.updated_ms);
  replaceRows($("detail-steps"), s.steps.map((p, i) => {
    const tr = el("tr");
    tr.append(el("td", i), el("td", p.participant), el("td", p.status, "step-" + p.status));
    return tr;
  }));
  const abort = $("abort");
  abort.disabled = s.state !== "pending" || !capabilities.abort;
  abort.title = !capabilities.abort ? (capabilities.why || "actions are off")
    : s.state !== "pending" ? "only a pending saga can be aborted" : "roll this saga back";
  $("resolve").hidden = !(capabilities.resolve && s.state === "failed");
  replaceRows($("detail-dlq"), data.dead_letters.length
    ? data.dead_letters.map((d) => el("li", when(d.at_ms) + " · " + d.error + " (from " +
        (d.source_topic || "?") + ")"))
    : [el("li", "none", "hint")]);
  if (Date.now() - historyAt > HISTORY_MS) {
    historyAt = Date.now();
    refreshTimeline(txId);
  }
}

async function refreshTimeline(txId) {
  let data;
  try {
    data = await api("/api/sagas/" + encodeURIComponent(txId) + "/history");
  } catch (e) {
    $("timeline-note").textContent = "history unavailable: " + e.message;
    return;
  }
  if (txId !== selected) return;
  $("timeline-note").textContent = data.entries.length + " records, oldest first";
  replaceRows($("timeline"), data.entries.map((e) => {
    const li = el("li", null, "kind-" + String(e.kind || "").replace(/[^a-z_.-]/gi, ""));
    li.append(
      el("span", when(e.timestamp_ms), "when"),
      el("span", e.kind || "record", "kind"),
      el("span", (e.topic || "") + " " + e.partition + "@" + e.offset, "where mono"),
    e.signer ? el("span", " signed " + e.signer, "where") : "",
      el("div", e.summary || "", "summary"),
    );
    return li;
  }));
}

// ---------------------------------------------------------------- actions

function askAbort() {
  if (!selected) return;
  $("abort-tx").textContent = selected;
  $("abort-reason").value = "";
  for (const w of document.querySelectorAll(".who")) w.textContent = OPERATOR;
  $("abort-dialog").returnValue = "";
  $("abort-dialog").showModal();
  $("abort-reason").focus();
}

async function doAbort() {
  const txId = selected;
  const reason = $("abort-reason").value;
  try {
    toast("abort of " + txId + " sent; waiting for the coordinator…");
    const result = await post("/api/sagas/" + encodeURIComponent(txId) + "/abort", { reason });
    toast(result.message, result.verdict !== "honoured" && result.verdict !== "already");
  } catch (e) {
    toast("abort refused: " + e.message, true);
  }
  historyAt = 0;  // the timeline shows the abort and the decision at the next refresh
  refreshAudit();
  refreshDetail();
}

function askResolve() {
  if (!selectedRow) return;
  const select = $("resolve-step");
  // Only a step whose compensation failed can be resolved by hand.
  const failed = selectedRow.steps
    .map((p, i) => [p, i])
    .filter(([p]) => p.status === "compensation_failed");
  select.replaceChildren(...failed.map(([p, i]) => {
    const o = el("option", i + " · " + p.participant + " · " + p.status);
    o.value = String(i);
    return o;
  }));
  for (const w of document.querySelectorAll(".who")) w.textContent = OPERATOR;
  $("resolve-note").value = "";
  $("resolve-dialog").returnValue = "";
  $("resolve-dialog").showModal();
}

async function doResolve() {
  const txId = selected;
  try {
    const result = await post("/api/sagas/" + encodeURIComponent(txId) + "/resolve",
      { step: Number($("resolve-step").value), note: $("resolve-note").value });
    toast(result.message, result.verdict !== "honoured");
  } catch (e) {
    toast("resolve refused: " + e.message, true);
  }
  refreshAudit();
}

async function doRedrive(d) {
  if (!confirm("Send this dead letter (" + d.partition + "@" + d.offset + ") back to " +
      (d.source_topic || "its topic") + "? Recorded as done by " + OPERATOR + ".")) return;
  try {
    const result = await post("/api/dlq/redrive", { partition: d.partition, offset: d.offset });
    toast("dead letter " + result.redriven + " sent again to " + result.to);
  } catch (e) {
    toast("redrive refused: " + e.message, true);
  }
  refreshAudit();
}

// ---------------------------------------------------------------- other tabs

async function refreshParticipants() {
  const data = await api("/api/participants");
  $("participants-note").textContent = data.available
    ? data.participants.length + " participants announced themselves"
    : "This install has no participant registry (streams._registry): nothing to show.";
  replaceRows($("participants"), data.participants.map((p) => {
    const beat = p.last_heartbeat_ms;
    const status = p.state || "";
    const tr = el("tr");
    tr.append(
      el("td", p.name, "mono"),
      el("td", p.storage ?? p.kind ?? ""),
      el("td", Array.isArray(p.targets) ? p.targets.join(", ") : (p.targets ?? "")),
      el("td", p.version ?? ""),
      el("td", beat ? when(beat) + " (" + ago(beat) + ")" : ""),
      el("td", status, "state s-" + status),
    );
    return tr;
  }));
}

async function refreshDlq() {
  const data = await api("/api/dlq");
  replaceRows($("dlq"), data.dead_letters.map((d) => {
    const tr = el("tr");
    const act = el("td");
    if (capabilities.redrive) {
      const b = el("button", "Redrive…", "small");
      b.addEventListener("click", () => doRedrive(d));
      act.append(b);
    }
    tr.append(
      el("td", when(d.at_ms)),
      el("td", d.tx_id || "", "mono"),
      el("td", d.error, "reason"),
      el("td", (d.source_topic || "?") + " " + (d.source_partition ?? "?") + "@" +
        (d.source_offset ?? "?"), "mono small"),
      el("td", d.size),
      el("td", d.excerpt.slice(0, 160), "mono small excerpt"),
      act,
    );
    return tr;
  }));
}

async function refreshAudit() {
  const data = await api("/api/audit");
  replaceRows($("audit"), data.audit.map((a) => {
    const tr = el("tr");
    tr.append(el("td", when(a.at_ms)), el("td", a.operator, "operator"), el("td", a.action),
      el("td", a.tx_id || "", "mono"), el("td", a.detail), el("td", a.outcome));
    return tr;
  }));
}

function showTab(name) {
  tab = name;
  for (const b of document.querySelectorAll("nav [role=tab]")) {
    b.setAttribute("aria-selected", String(b.dataset.tab === name));
  }
  for (const p of document.querySelectorAll("main > .panel")) p.hidden = p.id !== "panel-" + name;
  tick(true);
}

// ---------------------------------------------------------------- the loop

let busy = false;
async function tick(force) {
  if (busy && !force) return;
  busy = true;
  try {
    await refreshMetrics();
    if (tab === "sagas") {
      await refreshSagas();
      await refreshDetail();
    } else if (tab === "participants") {
      await refreshParticipants();
    } else if (tab === "dlq") {
      await refreshDlq();
    } else if (tab === "audit") {
      await refreshAudit();
    }
  } catch (e) {
    const health = $("view-health");
    health.textContent = "console unreachable: " + e.message;
    health.className = "tag bad";
  } finally {
    busy = false;
  }
}

document.addEventListener("DOMContentLoaded", () => {
  $("operator").textContent = OPERATOR;
  $("filters").addEventListener("submit", (e) => { e.preventDefault(); tick(true); });
  $("search").addEventListener("input", () => tick(true));
  $("state").addEventListener("change", () => tick(true));
  $("detail-close").addEventListener("click", closeSaga);
  $("abort").addEventListener("click", askAbort);
  $("resolve").addEventListener("click", askResolve);
  $("abort-dialog").addEventListener("close", () => {
    if ($("abort-dialog").returnValue === "confirm") doAbort();
  });
  $("resolve-dialog").addEventListener("close", () => {
    if ($("resolve-dialog").returnValue === "confirm") doResolve();
  });
  for (const b of document.querySelectorAll("nav [role=tab]")) {
    b.addEventListener("click", () => showTab(b.dataset.tab));
  }
  const m = location.hash.match(/^#tx=(.+)$/);
  if (m) openSaga(decodeURIComponent(m[1]));
  tick(true);
  setInterval(tick, REFRESH_MS);
});
