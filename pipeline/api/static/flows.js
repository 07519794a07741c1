// The page's flows: start a declared flow, list recent flows, watch one step by step and cancel it.
// Loaded after app.js, whose helpers it uses ($, el, api, shortId, fmtTime, stateLabel, showDetail). A flow is
// followed until its status says `final` (pipeline.flows.view decides); states are the API's, shown as they come.
"use strict";

const FLOW_LIMIT = 20;
const FLOW_ITEMS_SHOWN = 12; // a fan-out step's first jobs get a link each; the rest are counted
const flowState = { kinds: [], open: null, timer: null, listTimer: null, summaries: new Map() };

// --- declared flows and the start form ------------------------------------------------------------------

async function loadFlowKinds() {
  const { status, body } = await api("/flows/kinds");
  if (status !== 200) return;
  flowState.kinds = body;
  const select = $("flow-name");
  const chosen = select.value;
  select.replaceChildren(...body.map((k) => el("option", { value: k.name }, k.name)));
  const preferred = ["invoice", "media"].find((n) => body.some((k) => k.name === n));
  selectFlow(body.some((k) => k.name === chosen) ? chosen : preferred || (body[0] && body[0].name));
}

function selectFlow(name) {
  const info = flowState.kinds.find((k) => k.name === name);
  if (!info) return;
  $("flow-name").value = name;
  const outline = info.steps.map((s) => `${s.name} (${s.task}${s.fan_out ? ", each" : ""})${s.after.length ? ` after ${s.after.join(", ")}` : ""}`);
  $("flow-desc").textContent = `${info.description ? `${info.description} ` : ""}Steps: ${outline.join(", ")}.`;
  $("flow-input").value = JSON.stringify(info.example || {}, null, 2);
  flowMessage("");
}

function flowMessage(text, kind = "info", items = []) {
  const box = $("flow-message");
  box.className = `message ${kind}`;
  box.replaceChildren(text ? el("p", {}, text) : "", ...(items.length ? [el("ul", {}, ...items.map((i) => el("li", {}, i)))] : []));
}

async function startFlow(event) {
  event.preventDefault();
  const name = $("flow-name").value;
  let input;
  try {
    input = JSON.parse($("flow-input").value || "{}");
  } catch (err) {
    flowMessage(`The input is not valid JSON: ${err.message}`, "error");
    return;
  }
  $("flow-start").disabled = true;
  try {
    const { status, body, headers } = await api(`/flows/${encodeURIComponent(name)}`, {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(input),
    });
    if (status === 202) {
      flowMessage(`Started: flow ${shortId(body.id)}.`, "ok");
      showFlow(body.id);
      loadFlows();
    } else if (status === 422 && Array.isArray(body.detail)) {
      flowMessage("The input was refused:", "error", body.detail.map((e) => `${e.loc.filter((p) => p !== "body").join(".") || "input"}: ${e.msg}`));
    } else if (status === 503) {
      flowMessage(`The broker is unreachable; nothing was started. Retry in ${headers.get("Retry-After") || "a few"} s.`, "error");
    } else {
      flowMessage(`Refused (${status}): ${typeof body === "string" ? body : body.detail}`, "error");
    }
  } catch (err) {
    if (err.message !== "unauthorized") flowMessage(`Could not reach the API: ${err.message}`, "error");
  } finally {
    $("flow-start").disabled = false;
  }
}

// --- recent flows (GET /flows) ---------------------------------------------------------------------------

function flowBar(progress, barState, label) {
  const bar = el(
    "div",
    { class: `bar ${barState}`, role: "progressbar", "aria-valuemin": "0", "aria-valuemax": "100", "aria-valuenow": String(Math.round(progress)), "aria-label": label },
    el("div", { class: "fill" }),
  );
  bar.firstChild.style.width = `${progress}%`;
  return bar;
}

async function loadFlows() {
  let response;
  try {
    response = await api(`/flows?limit=${FLOW_LIMIT}`);
  } catch (err) {
    return;
  }
  if (response.status !== 200) return;
  const rows = response.body;
  $("flows-empty").hidden = rows.length > 0;
  $("flow-list").replaceChildren(...rows.map(flowRow));
  for (const row of rows) {
    const before = flowState.summaries.get(row.id);
    flowState.summaries.set(row.id, row);
    // The open flow changed meanwhile (a replay continued it, a cancel elsewhere): show it again.
    if (row.id === flowState.open && before && (before.state !== row.state || before.progress !== row.progress)) showFlow(row.id, false);
  }
}

function flowRow(f) {
  const note = f.failed_step ? `failed at step ${f.failed_step}` : f.finished_at ? `ended ${fmtTime(f.finished_at)}` : `started ${fmtTime(f.created_at)}`;
  return el(
    "li",
    { class: `job ${flowState.open === f.id ? "selected" : ""}`, dataset: { id: f.id, state: f.state }, tabindex: "0", onclick: () => showFlow(f.id), onkeydown: (e) => e.key === "Enter" && showFlow(f.id) },
    el("div", { class: "job-head" }, el("span", { class: "kind-label" }, f.flow), el("code", { class: "muted" }, shortId(f.id)), el("span", { class: `badge ${f.state}` }, f.state)),
    el("div", { class: "job-bar" }, flowBar(f.progress, f.state, `progress of flow ${shortId(f.id)}`), el("span", { class: "percent" }, `${Math.round(f.progress)} %`)),
    el("div", { class: "job-note muted small" }, `${new Date(f.created_at).toLocaleString()} · ${note}`),
  );
}

// --- one flow, step by step (GET /flows/{id}) ---------------------------------------------------------------

async function showFlow(id, scroll = true) {
  clearTimeout(flowState.timer);
  flowState.open = id;
  for (const li of $("flow-list").children) li.classList.toggle("selected", li.dataset.id === id);
  let response;
  try {
    response = await api(`/flows/${encodeURIComponent(id)}`);
  } catch (err) {
    response = null;
  }
  if (flowState.open !== id) return; // another flow was opened meanwhile
  if (response && response.status === 404) {
    flowMessage(`Flow ${shortId(id)} is not kept any more.`, "error");
    $("flow-view").hidden = true;
    flowState.open = null;
    return;
  }
  if (response && response.status === 200) renderFlow(response.body, scroll);
  // Followed until final; a failed flow's other jobs may still move, and a replay continues it (the list says).
  if (!response || response.status !== 200 || !response.body.final) flowState.timer = setTimeout(() => showFlow(id, false), 1500);
}

function renderFlow(f, scroll) {
  const view = $("flow-view");
  const wasHidden = view.hidden;
  view.hidden = false;
  view.dataset.state = f.state;
  if (scroll && wasHidden) view.scrollIntoView({ block: "nearest" });
  $("flow-view-id").textContent = f.id;
  $("flow-view-name").textContent = f.flow;
  $("flow-state").className = `badge ${f.state}`;
  $("flow-state").textContent = f.failed_step ? `failed at step ${f.failed_step}` : f.state;
  $("flow-bar").replaceChildren(flowBar(f.progress, f.state, `progress of flow ${shortId(f.id)}`), el("span", { class: "percent" }, `${Math.round(f.progress)} %`));
  $("flow-times").textContent = `started ${new Date(f.created_at).toLocaleString()}${f.finished_at ? ` · ended ${new Date(f.finished_at).toLocaleString()}` : ""}`;
  // Cancel while it runs, or when it failed (instead of replaying its step).
  $("flow-cancel").hidden = f.final && f.state !== "failed";
  $("flow-steps").replaceChildren(...f.steps.map(stepRow));
  const listed = flowState.summaries.get(f.id);
  if (!listed || listed.state !== f.state || listed.progress !== f.progress) refreshFlowsSoon();
}

function refreshFlowsSoon() {
  // The open flow moved on: its row in the list too (at most one reload per second).
  if (flowState.listTimer === null) flowState.listTimer = setTimeout(() => ((flowState.listTimer = null), loadFlows()), 1000);
}

function stepRow(s) {
  const waiting = s.state === null;
  const badge = waiting
    ? el("span", { class: "badge waiting" }, `waiting for ${s.waiting_for.join(", ")}`)
    : el("span", { class: `badge ${s.state}` }, stateLabel(s.state));
  const done = s.counts.succeeded || 0;
  const moving = ["started", "progress", "retrying"].includes(s.state);
  const links = s.items.slice(0, FLOW_ITEMS_SHOWN).map((job) =>
    el("button", { type: "button", class: `small job-link ${job.state}`, title: `${job.node}: ${stateLabel(job.state)}`, dataset: { id: job.id }, onclick: () => showDetail(job.id, true) }, shortId(job.id)),
  );
  const more = s.jobs - links.length;
  return el(
    "tr",
    { dataset: { step: s.name, state: waiting ? "waiting" : s.state } },
    el("td", {}, el("strong", {}, s.name), s.fan_out ? el("span", { class: "muted small" }, " each") : null, el("div", { class: "muted small" }, el("code", {}, s.task))),
    el("td", {}, badge),
    el("td", { class: "num jobs" }, waiting ? "–" : `${done}/${s.jobs}`),
    el("td", { class: "step-bar" }, waiting ? null : el("div", { class: "job-bar" }, flowBar(s.progress, `${s.state} ${moving ? "running" : ""}`, `progress of step ${s.name}`), el("span", { class: "percent" }, `${Math.round(s.progress)} %`))),
    el("td", {}, el("div", { class: "links" }, ...links, more > 0 ? el("span", { class: "muted small" }, `+${more} more`) : null)),
  );
}

async function cancelFlow() {
  const id = flowState.open;
  if (!id || !window.confirm("Cancel this flow? No further step starts; its waiting and running jobs are cancelled.")) return;
  const { status, body } = await api(`/flows/${encodeURIComponent(id)}/cancel`, { method: "POST" });
  if (status === 200) {
    flowMessage(`Cancelled flow ${shortId(id)}.`, "ok");
    renderFlow(body, false);
  } else {
    flowMessage(`Cancel refused (${status}): ${body.detail}`, "error");
  }
  loadFlows();
}

// --- start (called by app.js once the token is known) ------------------------------------------------------

let flowsStarted = false;

async function startFlows() {
  await loadFlowKinds();
  loadFlows();
  if (flowState.open) showFlow(flowState.open, false);
  if (flowsStarted) return;
  flowsStarted = true;
  setInterval(loadFlows, 5000);
}

document.addEventListener("DOMContentLoaded", () => {
  $("flow-form").addEventListener("submit", startFlow);
  $("flow-name").addEventListener("change", () => selectFlow($("flow-name").value));
  $("flow-reset").addEventListener("click", () => selectFlow($("flow-name").value));
  $("flow-cancel").addEventListener("click", cancelFlow);
  $("flow-close").addEventListener("click", () => {
    clearTimeout(flowState.timer);
    flowState.open = null;
    $("flow-view").hidden = true;
    for (const li of $("flow-list").children) li.classList.remove("selected");
  });
});
