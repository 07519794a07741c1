// The job page: start jobs, follow them live, inspect results, operate the dead-letter queue (flows: flows.js).
// Plain JavaScript, no build step. Every call carries the API token as a bearer header; the token lives
// in sessionStorage only. Job events are read with fetch() streaming (EventSource cannot send headers,
// and a token in a URL would end up in access logs).
"use strict";

const TOKEN_KEY = "pipeline.token";
const JOBS_KEY = "pipeline.jobs";
// A job is followed until its status says `final` (pipeline.status decides; the server ends the stream there).
const isFinal = (status) => status.final === true;
const MAX_STREAMS = 4; // browsers allow ~6 connections per host: keep some for ordinary calls
const MAX_JOBS = 30;

const $ = (id) => document.getElementById(id);
const state = {
  kinds: [],
  kind: null,
  jobs: new Map(),
  streams: new Map(),
  selected: null,
  // The job browser: which queue and state it lists, the cursors of the pages before this one, this page's.
  browser: { queue: "default", state: "waiting", back: [], cursor: null, next: null },
};
const BROWSE_STATES = ["waiting", "scheduled", "running", "retrying", "succeeded", "failed", "dead_lettered", "cancelled"];
const BROWSE_LIMIT = 20;
const DEAD_LETTER_QUEUE = "dead_letter";

// --- elements ------------------------------------------------------------------------------------

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value === null || value === undefined || value === false) continue;
    if (key === "class") node.className = value;
    else if (key === "dataset") Object.assign(node.dataset, value);
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value);
  }
  for (const child of children) {
    if (child !== null && child !== undefined) node.append(child instanceof Node ? child : String(child));
  }
  return node;
}

const shortId = (id) => (id || "").slice(0, 8);
const fmtTime = (iso) => (iso ? new Date(iso).toLocaleTimeString() : "–");
const fmtSeconds = (s) => (s >= 90 ? `${Math.round(s / 60)} min` : `${Math.max(0, Math.round(s))} s`);

// --- token and API calls ---------------------------------------------------------------------------

function token() {
  return sessionStorage.getItem(TOKEN_KEY);
}

function askToken(message) {
  const dialog = $("token-dialog");
  $("token-error").textContent = message || "";
  $("token-input").value = "";
  if (!dialog.open) dialog.showModal();
  $("token-input").focus();
}

async function api(path, options = {}) {
  const headers = { ...(options.headers || {}), Authorization: `Bearer ${token() || ""}` };
  let response;
  try {
    response = await fetch(path, { ...options, headers });
  } catch (err) {
    setConn(false, "API unreachable");
    throw err;
  }
  if (response.status === 401) {
    sessionStorage.removeItem(TOKEN_KEY);
    askToken("That token was refused. Paste the API token again.");
    throw new Error("unauthorized");
  }
  setConn(response.status !== 503, response.status === 503 ? "broker unreachable" : "connected");
  const type = response.headers.get("content-type") || "";
  const body = type.includes("application/json") ? await response.json() : await response.text();
  return { status: response.status, body, headers: response.headers };
}

function setConn(ok, text) {
  const conn = $("conn");
  conn.textContent = text;
  conn.classList.toggle("bad", !ok);
}

// --- kinds and the form ----------------------------------------------------------------------------

async function loadKinds() {
  const { status, body } = await api("/kinds");
  if (status !== 200) return;
  state.kinds = body;
  const tabs = $("kinds");
  tabs.replaceChildren(
    ...body.map((k) =>
      el("button", { type: "button", role: "tab", class: "kind", dataset: { kind: k.kind }, onclick: () => selectKind(k.kind) }, k.kind),
    ),
  );
  const preferred = ["transcode", "email", "pdf", "webhook", "probe"].find((k) => body.some((x) => x.kind === k));
  selectKind(state.kind || preferred || (body[0] && body[0].kind));
}

function selectKind(kind) {
  const info = state.kinds.find((k) => k.kind === kind);
  if (!info) return;
  state.kind = kind;
  for (const tab of $("kinds").children) tab.setAttribute("aria-selected", String(tab.dataset.kind === kind));
  $("kind-desc").textContent = `${info.task} → queue ${info.queue}. ${info.description}`;
  $("payload").value = JSON.stringify(info.example || {}, null, 2);
  const props = info.payload_schema.properties || {};
  const required = new Set(info.payload_schema.required || []);
  $("fields").replaceChildren(
    ...Object.entries(props).map(([name, spec]) =>
      el(
        "tr",
        {},
        el("td", {}, el("code", {}, name), required.has(name) ? el("span", { class: "req", title: "required" }, " *") : null),
        el("td", { class: "muted" }, typeOf(spec)),
        el("td", { class: "muted" }, spec.description || (spec.default !== undefined ? `default ${JSON.stringify(spec.default)}` : "")),
      ),
    ),
  );
  showMessage("");
}

function typeOf(spec) {
  if (spec.enum) return spec.enum.join(" | ");
  if (spec.type === "array") return `array of ${spec.items ? typeOf(spec.items) : "any"}`;
  if (spec.anyOf) return spec.anyOf.map(typeOf).join(" | ");
  return spec.format ? `${spec.type} (${spec.format})` : spec.type || "any";
}

function showMessage(text, kind = "info", items = []) {
  const box = $("form-message");
  box.className = `message ${kind}`;
  box.replaceChildren(text ? el("p", {}, text) : "", ...(items.length ? [el("ul", {}, ...items.map((i) => el("li", {}, i)))] : []));
}

async function submitJob(event) {
  event.preventDefault();
  let payload;
  try {
    payload = JSON.parse($("payload").value || "{}");
  } catch (err) {
    showMessage(`The payload is not valid JSON: ${err.message}`, "error");
    return;
  }
  const params = new URLSearchParams();
  if ($("delay").value) params.set("delay_seconds", $("delay").value);
  const headers = { "Content-Type": "application/json" };
  if ($("idem").value.trim()) headers["Idempotency-Key"] = $("idem").value.trim();
  const query = params.toString() ? `?${params}` : "";
  $("enqueue").disabled = true;
  try {
    const { status, body, headers: h } = await api(`/jobs/${encodeURIComponent(state.kind)}${query}`, {
      method: "POST",
      headers,
      body: JSON.stringify(payload),
    });
    if (status === 202) {
      const known = state.jobs.has(body.id);
      track(body.id, state.kind);
      showMessage(known ? `Same idempotency key: job ${shortId(body.id)} again.` : `Accepted: job ${shortId(body.id)}.`, "ok");
    } else if (status === 422 && Array.isArray(body.detail)) {
      showMessage("The payload was refused:", "error", body.detail.map((e) => `${e.loc.filter((p) => p !== "body").join(".") || "payload"}: ${e.msg}`));
    } else if (status === 503) {
      showMessage(`The broker is unreachable; nothing was stored. Retry in ${h.get("Retry-After") || "a few"} s.`, "error");
    } else {
      showMessage(`Refused (${status}): ${typeof body === "string" ? body : body.detail}`, "error");
    }
  } catch (err) {
    if (err.message !== "unauthorized") showMessage(`Could not reach the API: ${err.message}`, "error");
  } finally {
    $("enqueue").disabled = false;
  }
}

// --- the job list ----------------------------------------------------------------------------------

function saveJobs() {
  const list = [...state.jobs.values()].map((j) => ({ id: j.id, kind: j.kind, added: j.added }));
  sessionStorage.setItem(JOBS_KEY, JSON.stringify(list.slice(-MAX_JOBS)));
}

function kindOfTask(task) {
  const info = state.kinds.find((k) => k.task === task);
  return info ? info.kind : task || "job";
}

function track(id, kind, added = Date.now()) {
  if (!state.jobs.has(id)) {
    state.jobs.set(id, { id, kind, added, status: { id, state: "queued", progress: null } });
    while (state.jobs.size > MAX_JOBS) state.jobs.delete(state.jobs.keys().next().value);
    saveJobs();
  }
  render(id);
  follow(id);
}

function update(id, status) {
  const job = state.jobs.get(id);
  if (!job) return;
  const was = job.status.state;
  job.status = status;
  if (status.task && (!job.kind || job.kind === "job")) job.kind = kindOfTask(status.task);
  render(id);
  if (state.selected === id) showDetail(id, false);
  if (status.state === "dead_lettered" && was !== "dead_lettered") loadDlq();
  if (status.state !== was) refreshBrowserSoon();
}

function render(id) {
  const job = state.jobs.get(id);
  const s = job.status;
  const percent = s.state === "succeeded" ? 100 : s.progress ? s.progress.percent : 0;
  const running = ["started", "progress", "retrying"].includes(s.state);
  const bar = el(
    "div",
    { class: `bar ${running ? "running" : ""} ${s.state}`, role: "progressbar", "aria-valuemin": "0", "aria-valuemax": "100", "aria-valuenow": String(Math.round(percent)), "aria-label": `progress of job ${shortId(id)}` },
    el("div", { class: "fill" }),
  );
  const over = s.state === "dead_lettered" || s.state === "failed";
  bar.firstChild.style.width = `${over ? 100 : percent}%`; // a failed job's bar is full and red
  let note = "";
  if (s.state === "progress" && s.progress && s.progress.eta_s !== null && s.progress.eta_s !== undefined) note = `${fmtSeconds(s.progress.eta_s)} left`;
  else if (s.state === "scheduled" && s.eta) note = `runs at ${fmtTime(s.eta)}`;
  else if (s.state === "retrying") note = `attempt ${s.attempts} failed, retrying`;
  else if (s.state === "succeeded") note = `done ${fmtTime(s.finished_at)}`;
  else if (s.state === "dead_lettered") note = "in the dead-letter queue";
  else if (s.state === "cancelled") note = `cancelled ${fmtTime(s.finished_at)}`;
  const row = el(
    "li",
    { class: `job ${state.selected === id ? "selected" : ""}`, dataset: { id, state: s.state }, tabindex: "0", onclick: () => showDetail(id, true), onkeydown: (e) => e.key === "Enter" && showDetail(id, true) },
    el("div", { class: "job-head" }, el("span", { class: "kind-label" }, job.kind), el("code", { class: "muted" }, shortId(id)), el("span", { class: `badge ${s.state}` }, s.state.replace("_", " "))),
    el("div", { class: "job-bar" }, bar, el("span", { class: "percent" }, over ? "–" : `${Math.round(percent)} %`)),
    el("div", { class: "job-note muted small" }, note || "\u00a0"),
  );
  const list = $("job-list");
  const existing = list.querySelector(`li[data-id="${CSS.escape(id)}"]`);
  if (existing) existing.replaceWith(row);
  else list.prepend(row);
  $("jobs-empty").hidden = state.jobs.size > 0;
}

// --- following jobs: one fetch() event stream per running job, polling beyond MAX_STREAMS -----------

function follow(id) {
  const job = state.jobs.get(id);
  if (!token() || !job || isFinal(job.status) || state.streams.has(id)) return;
  if (state.streams.size >= MAX_STREAMS) {
    setTimeout(() => poll(id), 2000);
    return;
  }
  const controller = new AbortController();
  state.streams.set(id, controller);
  stream(id, controller.signal)
    .catch(() => {})
    .finally(() => {
      state.streams.delete(id);
      const current = state.jobs.get(id);
      if (current && !isFinal(current.status)) setTimeout(() => follow(id), 2000);
    });
}

async function poll(id) {
  const job = state.jobs.get(id);
  if (!job || isFinal(job.status) || state.streams.has(id)) return;
  try {
    const { status, body } = await api(`/jobs/${encodeURIComponent(id)}`);
    if (status === 200) update(id, body);
  } catch (err) {
    /* retried below */
  }
  follow(id);
}

async function stream(id, signal) {
  const response = await fetch(`/jobs/${encodeURIComponent(id)}/events`, {
    headers: { Authorization: `Bearer ${token() || ""}`, Accept: "text/event-stream" },
    signal,
  });
  if (response.status === 401) {
    sessionStorage.removeItem(TOKEN_KEY);
    askToken("That token was refused. Paste the API token again.");
    return;
  }
  if (!response.ok || !response.body) return;
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value.replace(/\r\n/g, "\n");
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      let event = "message";
      const data = [];
      for (const line of block.split("\n")) {
        if (line.startsWith("event:")) event = line.slice(6).trim();
        else if (line.startsWith("data:")) data.push(line.slice(5).trimStart());
      }
      if (event === "status" && data.length) update(id, JSON.parse(data.join("\n")));
    }
  }
}

// --- job detail ----------------------------------------------------------------------------------------

async function showDetail(id, fetchFresh) {
  state.selected = id;
  for (const li of $("job-list").children) li.classList.toggle("selected", li.dataset.id === id);
  const job = state.jobs.get(id);
  let s = job ? job.status : null;
  if (fetchFresh) {
    const { status, body } = await api(`/jobs/${encodeURIComponent(id)}`);
    if (status === 200) {
      s = body;
      if (job) job.status = body;
    }
  }
  if (!s) return;
  const wasHidden = $("detail").hidden;
  $("detail").hidden = false;
  if (wasHidden || fetchFresh) $("detail").scrollIntoView({ block: "nearest" });
  $("detail-id").textContent = id;
  const facts = [
    ["state", el("span", { class: `badge ${s.state}` }, s.state.replace("_", " "))],
    ["task", s.task || "–"],
    ["queue", s.queue || "–"],
    ["attempts", String(s.attempts)],
    ["accepted", fmtTime(s.accepted_at)],
    ["finished", fmtTime(s.finished_at)],
  ];
  if (s.eta) facts.push(["not before", fmtTime(s.eta)]);
  if (s.worker) facts.push(["worker", s.worker]);
  if (s.dlq_id) facts.push(["dead letter", el("button", { type: "button", class: "small", onclick: () => replay(s.dlq_id) }, "Replay")]);
  // Not finished yet (`failed` only until its dead-letter entry is written): it can be cancelled.
  if (!isFinal(s) && s.state !== "failed") facts.push(["cancel", el("button", { type: "button", id: "detail-cancel", class: "small danger", onclick: () => cancelJob(id) }, "Cancel job")]);
  $("detail-facts").replaceChildren(...facts.flatMap(([k, v]) => [el("dt", {}, k), el("dd", {}, v)]));
  const failed = s.error && !["succeeded"].includes(s.state);
  $("detail-output-title").textContent = failed ? "Error" : "Result";
  $("detail-output").className = `output ${failed ? "error" : ""}`;
  $("detail-output").textContent = failed
    ? `${s.error.type}: ${s.error.message}`
    : s.result !== null && s.result !== undefined
      ? JSON.stringify(s.result, null, 2)
      : `(no result yet: ${s.state.replace("_", " ")})`;
}

async function cancelJob(id) {
  if (!window.confirm("Cancel this job? Waiting, it never runs; running, it is stopped.")) return;
  const { status, body } = await api(`/jobs/${encodeURIComponent(id)}/cancel`, { method: "POST" });
  if (status === 200) {
    update(id, body);
    showMessage(`Cancelled job ${shortId(id)}.`, "ok");
  } else {
    showMessage(`Cancel refused (${status}): ${body.detail}`, "error");
  }
  showDetail(id, true);
  loadBrowser();
}

// --- job browser: every queue's jobs by state (GET /jobs) ------------------------------------------------

const stateLabel = (name) => name.replace("_", " ");

async function loadBrowser() {
  const b = state.browser;
  const params = new URLSearchParams({ queue: b.queue, state: b.state, limit: String(BROWSE_LIMIT) });
  if (b.cursor) params.set("cursor", b.cursor);
  let response;
  try {
    response = await api(`/jobs?${params}`);
  } catch (err) {
    return;
  }
  if (response.status === 422 && b.cursor) {
    browseFrom(b.queue, b.state); // a cursor from before a restart or a change: start over
    return;
  }
  if (response.status !== 200) return;
  const page = response.body;
  b.next = page.next_cursor;
  renderCounts(page.counts, page.waiting_levels || {});
  $("browser-list-title").textContent = `${stateLabel(page.state)} in ${page.queue} (${page.total})`;
  $("browser-empty").hidden = page.jobs.length > 0;
  $("browser-table").hidden = page.jobs.length === 0;
  $("browser-rows").replaceChildren(...page.jobs.map(browserRow));
  $("browser-first").disabled = b.back.length === 0;
  $("browser-next").disabled = !b.next;
  $("browser-position").textContent = `page ${b.back.length + 1}`;
}

// Waiting jobs per priority level ("P0 2 · P3 40"; levels with none left out): workers take P0 first.
function levelsText(levels) {
  return Object.entries(levels || {})
    .filter(([, n]) => n > 0)
    .map(([level, n]) => `P${level} ${n}`)
    .join(" · ");
}

function renderCounts(counts, waitingLevels) {
  $("counts-head").replaceChildren(el("th", {}, "Queue"), ...BROWSE_STATES.map((name) => el("th", {}, stateLabel(name))));
  $("counts-rows").replaceChildren(
    ...Object.entries(counts).map(([queue, byState]) =>
      el(
        "tr",
        { dataset: { queue } },
        el("td", {}, queue),
        ...BROWSE_STATES.map((name) => {
          const n = byState[name] || 0;
          const selected = queue === state.browser.queue && name === state.browser.state;
          const levels = name === "waiting" ? levelsText(waitingLevels[queue]) : "";
          return el(
            "td",
            {},
            el(
              "button",
              { type: "button", class: `small ${n ? "" : "zero"}`, dataset: { queue, state: name }, "aria-pressed": String(selected), "aria-label": `${stateLabel(name)} in ${queue}: ${n}`, onclick: () => browseFrom(queue, name) },
              String(n),
            ),
            levels ? el("div", { class: "muted small levels", dataset: { queue }, title: "waiting per priority level: P0 holds priorities 0-2 and is taken first, then P3 (3-5), P6 (6-8), P9" }, levels) : null,
          );
        }),
      ),
    ),
  );
}

function browserRow(job) {
  const done = job.due_at || job.finished_at;
  return el(
    "tr",
    { dataset: { id: job.id, state: job.state }, tabindex: "0", onclick: () => showDetail(job.id, true), onkeydown: (e) => e.key === "Enter" && showDetail(job.id, true) },
    el("td", {}, el("code", { title: job.id }, shortId(job.id))),
    el("td", {}, el("code", {}, job.task || "?")),
    el("td", {}, el("span", { class: `badge ${job.state}` }, stateLabel(job.state))),
    el("td", { class: "nowrap" }, job.enqueued_at ? new Date(job.enqueued_at).toLocaleString() : "–"),
    el("td", { class: "nowrap" }, done ? new Date(done).toLocaleString() : "–"),
    el("td", { class: "num" }, job.attempts === null || job.attempts === undefined ? "–" : String(job.attempts)),
    el("td", { class: "num" }, job.priority === null || job.priority === undefined ? "–" : String(job.priority)),
    el("td", { class: "muted small" }, job.exception ? job.exception.split(".").pop() : ""),
  );
}

let browserTimer = null;

function refreshBrowserSoon() {
  // A job this tab follows changed state: the counts changed too (at most one reload per second).
  if (browserTimer === null) browserTimer = setTimeout(() => ((browserTimer = null), loadBrowser()), 1000);
}

function browseFrom(queue, name) {
  Object.assign(state.browser, { queue, state: name, back: [], cursor: null, next: null });
  loadBrowser();
}

function browseNext() {
  const b = state.browser;
  if (!b.next) return;
  b.back.push(b.cursor);
  b.cursor = b.next;
  loadBrowser();
}

// --- dead-letter queue -----------------------------------------------------------------------------

async function loadDlq() {
  let response;
  try {
    response = await api("/dlq?limit=50");
  } catch (err) {
    return;
  }
  if (response.status !== 200) return;
  const rows = response.body;
  $("dlq-count").textContent = String(rows.length);
  $("dlq-empty").hidden = rows.length > 0;
  $("dlq-table").hidden = rows.length === 0;
  $("dlq-rows").replaceChildren(
    ...rows.map((r) =>
      el(
        "tr",
        { dataset: { id: r.id, taskId: r.task_id || "" } },
        el("td", { class: "nowrap" }, new Date(r.failed_at).toLocaleString()),
        el("td", {}, el("code", {}, r.task || "?"), el("div", { class: "muted small" }, shortId(r.task_id))),
        el("td", {}, el("strong", {}, r.exception.split(".").pop()), el("div", { class: "muted small clip" }, r.message)),
        el("td", { class: "num" }, String(r.attempts)),
        el(
          "td",
          { class: "nowrap right" },
          el("button", { type: "button", class: "small", disabled: r.replayable ? null : "disabled", title: r.replayable ? null : "no payload to replay", onclick: () => replay(r.id) }, "Replay"),
          " ",
          el("button", { type: "button", class: "small danger", onclick: () => removeEntry(r.id) }, "Delete"),
        ),
      ),
    ),
  );
}

async function replay(entryId) {
  const { status, body } = await api(`/dlq/${encodeURIComponent(entryId)}/replay`, { method: "POST" });
  if (status === 202) {
    const entry = [...$("dlq-rows").children].find((tr) => tr.dataset.id === entryId);
    const task = entry ? entry.querySelector("code").textContent : null;
    track(body.new_task_id, kindOfTask(task));
    showMessage(`Replayed as job ${shortId(body.new_task_id)}.`, "ok");
  } else {
    showMessage(`Replay refused (${status}): ${body.detail}`, "error");
  }
  loadDlq();
}

async function removeEntry(entryId) {
  if (!window.confirm("Delete this dead-letter entry without running it?")) return;
  await api(`/dlq/${encodeURIComponent(entryId)}`, { method: "DELETE" });
  loadDlq();
}

// --- queues --------------------------------------------------------------------------------------------

async function loadQueues() {
  let response;
  try {
    response = await api("/queues");
  } catch (err) {
    return;
  }
  if (response.status !== 200) return;
  $("queues").replaceChildren(
    ...response.body.queues.map((q) =>
      el(
        "li",
        {
          class: `queue ${q.depth ? "busy" : ""} ${q.paused ? "paused" : ""}`,
          dataset: { queue: q.name, state: q.paused ? "paused" : "running" },
          title: (q.paused ? "paused: no job starts until it is resumed; " : "") + (q.oldest_wait_s !== null ? `oldest waiting ${fmtSeconds(q.oldest_wait_s)}` : "nothing waiting"),
        },
        el("span", {}, q.name),
        el("strong", {}, String(q.depth)),
        q.depth && levelsText(q.levels) ? el("span", { class: "muted small levels" }, levelsText(q.levels)) : null,
        q.paused ? el("span", { class: "small" }, "paused") : null,
        q.in_flight ? el("span", { class: "muted small" }, `+${q.in_flight} running`) : null,
        q.name === DEAD_LETTER_QUEUE ? null : queueSwitch(q.name, q.paused ? "resume" : "pause"),
      ),
    ),
  );
}

// Pause (jobs keep being accepted, none starts) or resume a work queue; the dead-letter queue has no consumer.
function queueSwitch(name, action) {
  const label = action === "pause" ? "Pause" : "Resume";
  return el("button", { type: "button", class: "switch", "aria-label": `${label} ${name}`, title: `${label} queue ${name}`, onclick: () => switchQueue(name, action) }, action === "pause" ? "❚❚" : "▶");
}

async function switchQueue(name, action) {
  const { status, body } = await api(`/queues/${encodeURIComponent(name)}/${action}`, { method: "POST" });
  if (status === 200) {
    showMessage(body.paused ? `Queue ${name} paused: its jobs wait until it is resumed.` : `Queue ${name} resumed.`, "ok");
  } else {
    showMessage(`${action === "pause" ? "Pause" : "Resume"} refused (${status}): ${body.detail}`, "error");
  }
  loadQueues();
}

// --- start -------------------------------------------------------------------------------------------

let started = false;

async function start() {
  await loadKinds();
  loadDlq();
  loadQueues();
  loadBrowser();
  startFlows(); // flows.js
  if (started) {
    for (const id of state.jobs.keys()) follow(id); // a new token after a refusal: resume following
    return;
  }
  started = true;
  const saved = JSON.parse(sessionStorage.getItem(JOBS_KEY) || "[]");
  for (const job of saved) track(job.id, job.kind, job.added);
  setInterval(loadQueues, 5000);
  setInterval(loadDlq, 10000);
  setInterval(loadBrowser, 5000);
}

document.addEventListener("DOMContentLoaded", () => {
  $("job-form").addEventListener("submit", submitJob);
  $("reset-example").addEventListener("click", () => selectKind(state.kind));
  $("dlq-refresh").addEventListener("click", loadDlq);
  $("browser-refresh").addEventListener("click", loadBrowser);
  $("browser-next").addEventListener("click", browseNext);
  $("browser-first").addEventListener("click", () => browseFrom(state.browser.queue, state.browser.state));
  $("detail-close").addEventListener("click", () => {
    $("detail").hidden = true;
    state.selected = null;
    for (const li of $("job-list").children) li.classList.remove("selected");
  });
  $("sign-out").addEventListener("click", () => {
    sessionStorage.removeItem(TOKEN_KEY);
    for (const controller of state.streams.values()) controller.abort();
    askToken("");
  });
  $("token-form").addEventListener("submit", async (event) => {
    event.preventDefault();
    const value = $("token-input").value.trim();
    if (!value) return;
    const check = await fetch("/kinds", { headers: { Authorization: `Bearer ${value}` } }).catch(() => null);
    if (!check) {
      $("token-error").textContent = "The API is unreachable.";
    } else if (check.status === 401) {
      $("token-error").textContent = "That token is not valid for this API.";
    } else {
      sessionStorage.setItem(TOKEN_KEY, value);
      $("token-dialog").close();
      start();
    }
  });
  $("token-dialog").addEventListener("cancel", (event) => event.preventDefault()); // no way around it
  if (token()) start().catch(() => {});
  else askToken("");
});
