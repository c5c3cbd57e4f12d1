// rfopt's study page (rfopt/dashboard/pages.py, served by rfopt/dashboard/routes.py): draws the charts with plotly.js
// (served by the dashboard), sorts the leaderboard, posts the trial buttons' requests and shows each answer next to the
// trial acted on, builds the clone form from the trial's config, and keeps the page current:
//
// - while a process runs the study it asks for the page's data every 5 s with the version it has (an ETag): the
//   server answers 304 while nothing changed, and otherwise only the parts and charts that changed are redrawn (an
//   open clone form, what is typed in it, and open samples stay as they are);
// - while nobody runs the study (finished, or idle) it stops asking; it asks again when you act on the page, come
//   back to its tab, or click "check now";
// - times that move ("for 1m12s", "in ~45s") are counted here, every second, from the timestamps the server sent.
"use strict";

const feedback = new Map(); // trial number -> {text, error, op}: shown on its card across refreshes; a request's until it applies
let said = null; // {op, trial, at}: what the line by the study's buttons says, cleared once it applied (applyFeedback)
const IDLE_HALT = "nobody is running this study: there is nothing to stop";
let sortState = null; // {index, dir}: the leaderboard's sort, kept across refreshes
let refreshing = false;
let timer = null;
let lastNote = ""; // what the last refresh found: "updated 12:03:05", "checked 12:03:10: no change"
let xMode = "step"; // the charts' x axis: "step" (optimizer step / chunk) or "time" (wall time)
const drawn = new Map(); // figure key -> the JSON (and x mode) it was drawn from
const parts = new Map(); // part name -> the HTML it shows
let figures = []; // the charts' figures, as last received
const page = JSON.parse(document.getElementById("rfopt-page").textContent); // {version, running, refresh}
const study = document.getElementById("live").dataset.study;
const PARTS = {facts: "facts", liveness: "liveness-part", now: "now", warnings: "warnings", leaderboard: "board", why: "parallel",
  versus: "versus"};

const slug = (key) => key.replace(/[^A-Za-z0-9]/g, "-");

// ---------------------------------------------------------------- charts
function withAxis(figure) {
  if (xMode !== "time" || figure.section !== "charts") return [figure.data, figure.layout];
  const data = figure.data.map((t) => (t.meta && Array.isArray(t.meta.t)
    ? {...t, x: t.meta.t.map((ms) => (ms === null || ms === undefined ? null : new Date(ms)))} : t));
  const xaxis = {...figure.layout.xaxis, type: "date", title: {text: "wall time"}};
  delete xaxis.dtick; delete xaxis.tick0; delete xaxis.tickformat;
  return [data, {...figure.layout, xaxis, shapes: [], annotations: [], uirevision: figure.key + "-time"}];
}

function drawFigures(figures) {
  const keep = new Set();
  for (const figure of figures) {
    const section = figure.section || "charts";
    const box = document.querySelector(`[data-section="${section}"]`);
    const id = "chart-" + slug(figure.key);
    keep.add(id);
    let el = document.getElementById(id);
    if (!el) {
      el = document.createElement("div");
      el.className = "chart";
      el.id = id;
      el.dataset.key = figure.key;
    }
    if (el.parentNode !== box || box.lastElementChild !== el) box.appendChild(el); // in the figures' order
    const source = JSON.stringify(figure) + xMode;
    if (drawn.get(id) === source) continue; // unchanged: not redrawn (a chart keeps its zoom: layout.uirevision)
    drawn.set(id, source);
    const [data, layout] = withAxis(figure);
    Plotly.react(el, data, layout, {displaylogo: false, responsive: true});
  }
  for (const box of document.querySelectorAll("[data-section]")) {
    for (const el of [...box.children]) if (el.classList.contains("chart") && !keep.has(el.id)) {
      drawn.delete(el.id);
      el.remove();
    }
  }
}

// ---------------------------------------------------------------- leaderboard
function cellValue(row, index, kind) {
  const raw = row.cells[index].dataset.sort;
  if (raw === "" || raw === undefined) return null;
  if (kind === "text") return raw;
  const number = Number(raw);
  return kind === "num" || !Number.isNaN(number) ? number : raw;
}

function applySort() {
  const table = document.querySelector("table.leaderboard");
  if (!table || !sortState) return;
  const th = table.tHead.rows[0].cells[sortState.index];
  if (!th) return;
  const kind = th.dataset.kind;
  const rows = [...table.tBodies[0].rows];
  const sign = sortState.dir === "asc" ? 1 : -1;
  rows.sort((a, b) => {
    const x = cellValue(a, sortState.index, kind), y = cellValue(b, sortState.index, kind);
    if (x === null || y === null) return (x === null) - (y === null); // no value: last either way
    if (typeof x === "number" && typeof y === "number") return sign * (x - y);
    return sign * String(x).localeCompare(String(y), undefined, {numeric: true});
  });
  for (const row of rows) table.tBodies[0].appendChild(row);
  for (const cell of table.tHead.rows[0].cells) cell.removeAttribute("aria-sort");
  th.setAttribute("aria-sort", sortState.dir === "asc" ? "ascending" : "descending");
}

// ---------------------------------------------------------------- clocks
function span(seconds) {
  seconds = Math.max(0, Math.round(seconds));
  if (seconds < 60) return `${seconds}s`;
  const m = Math.floor(seconds / 60), s = seconds % 60;
  if (m < 60) return `${m}m${String(s).padStart(2, "0")}s`;
  return `${Math.floor(m / 60)}h${String(m % 60).padStart(2, "0")}m`;
}

// A unit in flight that has not moved (no step ended) for several of its usual step times reads as stuck: the data
// does not change while it hangs (nothing is written), so the page tells it from the clock, every second.
function tick() {
  const now = Date.now() / 1000;
  let held = false;
  for (const li of document.querySelectorAll("#now li[data-stuck-at]")) {
    const stuck = now >= Number(li.dataset.stuckAt);
    li.classList.toggle("stuck", stuck);
    held = held || stuck;
    const box = li.querySelector(".silence");
    if (box) {
      box.textContent = stuck ? `${li.dataset.quiet} for ${span(now - Number(li.dataset.moved))} (${li.dataset.usual}): `
        + "stuck or very slow; ETAs on hold" : "";
    }
  }
  const eta = document.getElementById("eta");
  if (eta) eta.classList.toggle("on-hold", held);
  for (const el of document.querySelectorAll(".clock[data-since]")) el.textContent = `for ${span(now - Number(el.dataset.since))}`;
  for (const el of document.querySelectorAll(".clock[data-into]")) el.textContent = `${span(now - Number(el.dataset.into))} into its turn`;
  for (const el of document.querySelectorAll(".clock[data-until]")) {
    if (el.closest("li.stuck") || (held && el.closest("#eta"))) { el.textContent = "on hold: no progress"; continue; }
    const left = Number(el.dataset.until) - now;
    el.textContent = left > 0 ? `in ~${span(left)}` : `any moment now (${span(-left)} later than its pace says)`;
  }
}

// ---------------------------------------------------------------- trials
function showFeedback(card) {
  const note = feedback.get(card.dataset.trial);
  const el = card.querySelector(".feedback");
  if (!el) return;
  if (!note) { el.textContent = ""; return; }
  el.textContent = note.text;
  el.classList.toggle("error", note.error);
}

async function loadInto(details, selector) {
  const body = details.querySelector(selector);
  const response = await fetch(details.dataset.url, {credentials: "same-origin"});
  body.innerHTML = response.ok ? await response.text() : `<p class="hint">could not load: HTTP ${response.status}</p>`;
  details.dataset.loaded = details.dataset.version || "1";
}

function mergeCards(cards) {
  const box = document.getElementById("trials");
  const active = document.activeElement;
  const selection = active && "selectionStart" in active && active.type !== "number" && active.type !== "checkbox"
    ? [active.selectionStart, active.selectionEnd] : null;
  const fresh = new Map();
  for (const {trial, html} of cards) {
    const old = box.querySelector(`section.trial[data-trial="${trial}"]`);
    if (old && old.dataset.html === html) { fresh.set(String(trial), old); continue; }
    const holder = document.createElement("div");
    holder.innerHTML = html;
    const card = holder.firstElementChild;
    card.dataset.html = html;
    if (old) {
      const form = old.querySelector("details.clone[open]");
      const slot = card.querySelector("details.clone");
      if (form && slot) slot.replaceWith(form); // the data is refreshed, the open form is not
      const samples = old.querySelector("details.samples[open]");
      const place = card.querySelector("details.samples");
      if (samples && place) {
        if (samples.dataset.loaded === place.dataset.version) place.replaceWith(samples);
        else { place.open = true; loadInto(place, ".samples-body"); }
      }
    }
    const note = feedback.get(String(trial));
    if (note && note.op && !note.error && !(card.dataset.pending || "").split(" ").includes(note.op)) {
      feedback.delete(String(trial)); // "pause requested" said until it applied (or was withdrawn): not after
    }
    showFeedback(card);
    fresh.set(String(trial), card);
  }
  for (const el of [...box.children]) if (!fresh.has(el.dataset.trial) || fresh.get(el.dataset.trial) !== el) el.remove();
  for (const {trial} of cards) box.appendChild(fresh.get(String(trial))); // in leaderboard order
  if (active && active.isConnected && document.activeElement !== active) {
    active.focus();
    if (selection) active.setSelectionRange(...selection);
  }
}

function apply(data) {
  for (const [name, id] of Object.entries(PARTS)) {
    const html = data.parts[name] || "";
    if (parts.get(name) === html) continue;
    parts.set(name, html);
    const el = document.getElementById(id);
    if (el) el.innerHTML = html;
    if (name === "leaderboard") applySort();
  }
  figures = data.figures;
  drawFigures(figures);
  mergeCards(data.cards);
  page.version = data.version;
  page.running = data.running;
  page.refresh = data.refresh;
  applyFeedback(data);
  tick();
}

// Feedback that clears: the study's stop button acts only while a process runs the study; the line by the buttons
// says a request until it applied (a halt: once nobody runs the study; a trial's pause, resume or stop: once its card
// no longer lists it as pending), and an answer that applied at once (cancel, withdraw, clone) for 15 s.
function applyFeedback(data) {
  const halt = document.getElementById("halt");
  if (halt) {
    halt.disabled = !data.running;
    halt.title = data.running ? "" : IDLE_HALT;
  }
  if (!said) return;
  const done = said.op === "halt" ? !data.running
    : said.op ? !feedback.has(String(said.trial)) : Date.now() - said.at > 15000;
  if (done) {
    const status = document.getElementById("status");
    if (!status.classList.contains("error")) status.textContent = "";
    said = null;
  }
}

function stamp(text, paused) {
  const el = document.getElementById("refreshed");
  el.innerHTML = text;
  el.className = paused ? "paused" : "";
}

function schedule() {
  clearTimeout(timer);
  timer = null;
  const auto = document.getElementById("autorefresh");
  if (!auto.checked) {
    stamp("refresh paused: tick the box to resume", true);
  } else if (page.running && page.refresh) {
    stamp(lastNote, false);
    timer = setTimeout(refresh, page.refresh * 1000);
  } else {
    stamp(`${lastNote ? lastNote + " · " : ""}nobody is running this study: not refreshing (it checks again when you `
      + `act here or come back to this tab) <button type="button" id="check-now">check now</button>`, false);
  }
}

async function refresh() {
  if (refreshing) return;
  refreshing = true;
  clearTimeout(timer);
  try {
    const response = await fetch(`/rfopt/api/studies/${study}/page`, {
      credentials: "same-origin", cache: "no-cache", headers: {"If-None-Match": `"${page.version}"`},
    });
    if (response.status === 304) {
      lastNote = `checked ${new Date().toLocaleTimeString()}: no change`;
    } else if (response.ok) {
      apply(await response.json());
      lastNote = `updated ${new Date().toLocaleTimeString()}`;
    } else {
      throw new Error(`HTTP ${response.status}`);
    }
  } catch (error) {
    stamp(`refresh failed (${error.message}); trying again in 5 s`, true);
    refreshing = false;
    timer = setTimeout(refresh, 5000);
    return;
  }
  refreshing = false;
  schedule();
}
window.rfoptRefresh = refresh; // for tests and screenshots: refresh now, and wait for it

// ---------------------------------------------------------------- the clone form
const GROUPS = [
  ["searched", "Searched: the params the leaderboard compares"],
  ["set", "Set for this trial: the fields not at TRL's default"],
  ["peft_config", "LoRA (PEFT config)"],
  ["trial", "Model and reward functions"],
];

function fieldInput(f) {
  const id = `f-${Math.random().toString(36).slice(2)}`;
  let input;
  if (f.kind === "bool") {
    input = `<input type="checkbox" id="${id}" ${f.value ? "checked" : ""}>`;
  } else if (f.kind === "choice") {
    const options = [...(f.nullable ? [null] : []), ...f.choices].map((c) =>
      `<option value='${escapeAttr(JSON.stringify(c))}' ${JSON.stringify(c) === JSON.stringify(f.value) ? "selected" : ""}>`
      + `${escapeHtml(c === null ? "None" : String(c))}</option>`).join("");
    input = `<select id="${id}">${options}</select>`;
  } else if (f.kind === "float" || f.kind === "int") {
    const value = f.value === null || f.value === undefined ? "" : String(f.value);
    input = `<input type="number" id="${id}" step="${f.kind === "int" ? 1 : "any"}" value="${escapeAttr(value)}"`
      + `${f.nullable ? ' placeholder="None"' : " required"}>`;
  } else if (f.kind === "text") {
    input = `<input type="text" id="${id}" value="${escapeAttr(f.value === null ? "" : String(f.value))}"`
      + `${f.nullable ? ' placeholder="None"' : ""}>`;
  } else {
    input = `<textarea id="${id}" rows="1">${escapeHtml(JSON.stringify(f.value))}</textarea>`;
  }
  const label = f.label || f.name;
  const also = label === f.name ? "" : ` <span class="field-path">${escapeHtml(f.name)}</span>`;
  return `<div class="field" data-name="${escapeAttr(f.name)}" data-label="${escapeAttr(label)}" data-kind="${f.kind}">`
    + `<label for="${id}" title="${escapeAttr(f.help)}">${escapeHtml(label)}${also}</label>${input}`
    + '<span class="field-error"></span></div>';
}

function buildForm(details, config) {
  const form = details.querySelector("form");
  const byGroup = (g) => config.fields.filter((f) => f.group === g);
  let html = "";
  for (const [group, title] of GROUPS) {
    const fields = byGroup(group);
    if (fields.length) html += `<fieldset data-group="${group}"><legend>${title}</legend>${fields.map(fieldInput).join("")}</fieldset>`;
  }
  const rest = byGroup("more");
  html += `<details class="all-fields"><summary>Every other field, at its default: GRPOConfig, PEFT (${rest.length})</summary>`
    + `<input type="search" class="filter" placeholder="filter by name"><div class="rest">${rest.map(fieldInput).join("")}`
    + "</div></details>";
  const warm = config.warm_start;
  html += warm.available
    ? `<label class="warm"><input type="checkbox" name="warm_start"> warm start ${escapeHtml(warm.why)}</label>`
    : `<p class="hint warm">no warm start: ${escapeHtml(warm.why)}</p>`;
  html += `<div class="form-buttons"><button type="button" class="op check" data-op="check" data-url="${details.dataset.config.replace(/config$/, "clone")}">Check</button>`
    + `<button type="button" class="op clone" data-op="clone" data-url="${details.dataset.config.replace(/config$/, "clone")}">Clone</button>`
    + `<span class="checking" role="status"></span></div><p class="form-error" role="alert"></p>`;
  form.innerHTML = html;
  form.fields = new Map(config.fields.map((f) => [f.name, f]));
  details.dataset.built = "1";
}

function readField(el, f) {
  const input = el.querySelector("input, select, textarea");
  if (f.kind === "bool") return input.checked;
  if (f.kind === "choice") return JSON.parse(input.value);
  const text = input.value.trim();
  if (text === "" && f.nullable) return null;
  if (f.kind === "float" || f.kind === "int") {
    if (!input.checkValidity() || text === "") throw new Error(`expected ${f.kind === "int" ? "a whole number" : "a number"}`);
    return Number(text);
  }
  if (f.kind === "text") return input.value;
  try { return JSON.parse(text); } catch (e) { throw new Error(`not valid JSON (${e.message})`); }
}

function overridesOf(form) {
  const overrides = {};
  let bad = 0;
  for (const el of form.querySelectorAll(".field")) {
    const f = form.fields.get(el.dataset.name);
    el.querySelector(".field-error").textContent = "";
    el.classList.remove("invalid");
    try {
      const value = readField(el, f);
      const changed = JSON.stringify(value) !== JSON.stringify(f.value);
      el.classList.toggle("changed", changed);
      if (changed) overrides[f.name] = value;
    } catch (error) {
      bad += 1;
      el.classList.add("invalid");
      el.querySelector(".field-error").textContent = error.message;
    }
  }
  return bad ? null : overrides;
}

function markError(form, message) {
  form.querySelector(".form-error").textContent = message;
  for (const el of form.querySelectorAll(".field")) {
    const name = el.dataset.name, bare = name.replace(/^peft_config\./, "");
    const named = message.includes(`${name}:`) || message.includes(`${el.dataset.label}:`) || message.includes(`args.${name}`)
      || message.includes(` ${bare}:`)
      || message.includes(`'${bare}'`);
    el.classList.toggle("invalid", named);
    if (named) {
      el.querySelector(".field-error").textContent = "see the error below";
      el.closest("details.all-fields")?.setAttribute("open", "");
    }
  }
}

// ---------------------------------------------------------------- events
const CONFIRM = {
  stop: (n) => `Stop trial ${n}? It ends PRUNED at its next chunk boundary.`,
  cancel: (n) => `Cancel trial ${n}? It leaves the queue and never starts.`,
  halt: () => "Stop the study? Every process running it stops at its trials' next chunk boundary; the trials stay " +
    "resumable (run the study again to continue).",
};

async function post(url, body) {
  const response = await fetch(url, {
    method: "POST", credentials: "same-origin", headers: {"Content-Type": "application/json"}, body: JSON.stringify(body),
  });
  const data = await response.json().catch(() => ({error: `HTTP ${response.status}`}));
  return [response.ok, data];
}

async function cloneClicked(button, card, trial) {
  const form = button.closest("form");
  const overrides = overridesOf(form);
  const errorBox = form.querySelector(".form-error");
  if (overrides === null) {
    errorBox.textContent = "fix the fields marked in red";
    return;
  }
  const check = button.dataset.op === "check";
  const warm = form.querySelector("input[name='warm_start']");
  const status = form.querySelector(".checking");
  const started = Date.now();
  const counter = setInterval(() => { status.textContent = `the server checks the clone… ${span((Date.now() - started) / 1000)}`; }, 1000);
  status.textContent = "the server checks the clone (its values against TRL, the optimizer and LR scheduler it builds, the reward functions, the chunk plan)…";
  errorBox.textContent = "";
  for (const b of form.querySelectorAll("button")) b.disabled = true;
  let ok, data;
  try {
    [ok, data] = await post(button.dataset.url, {overrides, warm_start: Boolean(warm && warm.checked), check_only: check});
  } catch (error) {
    [ok, data] = [false, {error: String(error)}];
  } finally {
    clearInterval(counter);
    status.textContent = "";
    for (const b of form.querySelectorAll("button")) b.disabled = false;
  }
  if (!ok) {
    markError(form, data.error); // it names the parent: "clone of trial 3: learning_rate: ..."
    return;
  }
  if (check) {
    status.textContent = data.message;
    return;
  }
  button.closest("details").open = false;
  feedback.set(trial, {text: data.message, error: false});
  feedback.set(String(data.trial), {text: `new: clone of trial ${trial}`, error: false});
  showFeedback(card);
  document.getElementById("status").textContent = data.message;
  await refresh();
}

document.addEventListener("click", async (event) => {
  if (event.target.id === "check-now") { refresh(); return; }
  const th = event.target.closest("table.leaderboard th");
  if (th) {
    const index = th.cellIndex;
    const dir = sortState && sortState.index === index ? (sortState.dir === "asc" ? "desc" : "asc") : th.dataset.first;
    sortState = {index, dir};
    applySort();
    return;
  }
  const button = event.target.closest("button[data-op]");
  if (!button) return;
  const op = button.dataset.op;
  const card = button.closest("[data-trial]");
  const trial = card ? card.dataset.trial : null;
  if (op === "clone" || op === "check") { await cloneClicked(button, card, trial); return; }
  let body = {};
  if (op === "withdraw") body = {op: button.dataset.what};
  else if (op === "confirm") { // replicates of the best configs with new seeds
    body = {top: Number(button.dataset.top), seeds: Number(button.dataset.seeds)};
    if (!confirm(`Train the ${body.top} best configs again, each with ${body.seeds} new seeds, as new trials? A ` +
      "process running the study trains them when a slot frees; otherwise run the study again.")) return;
  }
  else if (CONFIRM[op] && !confirm(CONFIRM[op](trial))) return;
  button.disabled = true;
  let note;
  try {
    const [ok, data] = await post(button.dataset.url, body);
    const who = trial === null ? "" : `trial ${trial}: `;
    const pending = ["pause", "resume", "stop"].includes(op) ? op : null; // shown until it applies
    note = ok ? {text: data.message, error: false, op: pending} : {text: `${who}${data.error}`, error: true};
  } catch (error) {
    note = {text: `${trial === null ? "" : `trial ${trial}: `}${error}`, error: true};
  } finally {
    button.disabled = op === "halt" ? !page.running : false;
  }
  const status = document.getElementById("status");
  status.textContent = note.text;
  status.className = note.error ? "error" : "";
  said = note.error ? null : {op: op === "halt" ? "halt" : note.op, trial, at: Date.now()};
  if (card) {
    feedback.set(trial, note);
    showFeedback(card);
  }
  if (!note.error) await refresh();
});

document.addEventListener("toggle", async (event) => {
  const details = event.target;
  if (!details.matches || !details.open) return;
  if (details.matches("details.samples") && details.dataset.loaded !== details.dataset.version) loadInto(details, ".samples-body");
  if (details.matches("#side-by-side") && !details.dataset.loaded) loadInto(details, ".side-body");
  if (details.matches("details.clone") && !details.dataset.built) {
    const response = await fetch(details.dataset.config, {credentials: "same-origin"});
    const data = await response.json().catch(() => ({error: `HTTP ${response.status}`}));
    if (response.ok) buildForm(details, data);
    else details.querySelector("form").innerHTML = `<p class="form-error">${escapeHtml(data.error)}</p>`;
  }
}, true);

document.addEventListener("change", (event) => {
  const target = event.target;
  if (target.name === "xaxis") { xMode = target.value; drawFigures(figures); return; }
  if (target.id === "autorefresh") { if (target.checked) refresh(); else schedule(); return; }
  if (target.matches("select.chunk-picker")) { // the trials compared after another chunk
    const details = target.closest("details");
    details.dataset.url = `${target.dataset.url}?unit=${encodeURIComponent(target.value)}`;
    loadInto(details, ".side-body");
    return;
  }
  if (target.matches("select.prompt-picker")) {
    for (const section of target.closest(".side-body").querySelectorAll("section.prompt")) {
      section.hidden = section.dataset.prompt !== target.value;
    }
    return;
  }
  const form = target.closest("form.clone-form");
  if (form && form.fields) overridesOf(form); // marks what changed, and what cannot be read
});

document.addEventListener("input", (event) => {
  if (!event.target.matches("input.filter")) return;
  const text = event.target.value.toLowerCase();
  for (const el of event.target.closest("details").querySelectorAll(".field")) {
    el.hidden = !el.dataset.name.toLowerCase().includes(text) && !el.dataset.label.toLowerCase().includes(text);
  }
});

document.addEventListener("visibilitychange", () => {
  if (document.visibilityState === "visible" && !page.running) refresh();
});

function escapeHtml(text) {
  return String(text).replace(/[&<>]/g, (c) => ({"&": "&amp;", "<": "&lt;", ">": "&gt;"}[c]));
}

function escapeAttr(text) {
  return escapeHtml(text).replace(/["']/g, (c) => (c === '"' ? "&quot;" : "&#39;"));
}

document.addEventListener("DOMContentLoaded", () => {
  figures = JSON.parse(document.getElementById("rfopt-figures").textContent);
  drawFigures(figures);
  for (const [name, id] of Object.entries(PARTS)) {
    const el = document.getElementById(id);
    if (el) parts.set(name, el.innerHTML);
  }
  for (const card of document.querySelectorAll("#trials section.trial")) card.dataset.html = card.outerHTML;
  tick();
  setInterval(tick, 1000);
  schedule();
});
