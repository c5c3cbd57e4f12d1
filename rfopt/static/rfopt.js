// rfopt's study page (rfopt/dashboard.py): draws the comparison charts with plotly.js (served by the dashboard),
// sorts the leaderboard, posts the trial buttons' requests and shows each answer next to the trial acted on, and
// refreshes the page's data every 5 s: an open clone form (and what is typed in it) and open samples stay as they are.
"use strict";

const feedback = new Map(); // trial number -> {text, error}: shown on its card, kept across refreshes
let sortState = null; // {index, dir}: the leaderboard's sort, kept across refreshes
let refreshing = false;

const slug = (key) => key.replace(/[^A-Za-z0-9]/g, "-");

function drawCharts(page) {
  const figures = JSON.parse(page.getElementById("rfopt-figures").textContent);
  const box = document.querySelector("#comparison .charts");
  const keep = new Set();
  for (const figure of figures) {
    const id = "chart-" + slug(figure.key);
    keep.add(id);
    let el = document.getElementById(id);
    if (!el) {
      el = document.createElement("div");
      el.className = "chart";
      el.id = id;
      el.dataset.key = figure.key;
    }
    box.appendChild(el); // in the figures' order; a chart already drawn keeps its zoom (layout.uirevision)
    Plotly.react(el, figure.data, figure.layout, {displaylogo: false, responsive: true});
  }
  for (const el of [...box.children]) if (!keep.has(el.id)) el.remove();
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

// ---------------------------------------------------------------- trials
function showFeedback(card) {
  const note = feedback.get(card.dataset.trial);
  const el = card.querySelector(".feedback");
  if (!note || !el) return;
  el.textContent = note.text;
  el.classList.toggle("error", note.error);
}

async function loadSamples(details) {
  const body = details.querySelector(".samples-body");
  const response = await fetch(details.dataset.url, {credentials: "same-origin"});
  body.innerHTML = response.ok ? await response.text() : `<p class="hint">could not load: HTTP ${response.status}</p>`;
  details.dataset.loaded = details.dataset.version;
}

function mergeTrials(fresh) {
  const active = document.activeElement;
  const selection = active && "selectionStart" in active ? [active.selectionStart, active.selectionEnd] : null;
  for (const card of fresh.querySelectorAll("section.trial")) {
    const old = document.querySelector(`#trials section.trial[data-trial="${card.dataset.trial}"]`);
    if (old) {
      const form = old.querySelector("details.clone[open]");
      const slot = card.querySelector("details.clone");
      if (form && slot) slot.replaceWith(form); // the data is refreshed, the open form is not
      const samples = old.querySelector("details.samples[open]");
      const place = card.querySelector("details.samples");
      if (samples && place) {
        if (samples.dataset.loaded === place.dataset.version) place.replaceWith(samples);
        else { place.open = true; loadSamples(place); }
      }
    }
    showFeedback(card);
  }
  document.getElementById("trials").replaceWith(fresh);
  if (active && active.isConnected && document.activeElement !== active) {
    active.focus();
    if (selection) active.setSelectionRange(...selection);
  }
}

async function refresh() {
  if (refreshing) return;
  refreshing = true;
  const stamp = document.getElementById("refreshed");
  try {
    const response = await fetch(location.href, {credentials: "same-origin"});
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    const page = new DOMParser().parseFromString(await response.text(), "text/html");
    for (const selector of ["#liveness", "p.facts"]) {
      const fresh = page.querySelector(selector);
      if (fresh) document.querySelector(selector).replaceWith(fresh);
    }
    document.getElementById("leaderboard").replaceWith(page.getElementById("leaderboard"));
    applySort();
    drawCharts(page);
    mergeTrials(page.getElementById("trials"));
    stamp.textContent = `updated ${new Date().toLocaleTimeString()}`;
    stamp.className = "";
  } catch (error) {
    stamp.textContent = `refresh failed (${error.message}); trying again in 5 s`;
    stamp.className = "paused";
  } finally {
    refreshing = false;
  }
}

// ---------------------------------------------------------------- events
const CONFIRM = {
  stop: (n) => `Stop trial ${n}? It ends PRUNED at its next chunk boundary.`,
  cancel: (n) => `Cancel trial ${n}? It leaves the queue and never starts.`,
};

document.addEventListener("click", async (event) => {
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
  const trial = card.dataset.trial;
  let body = {};
  if (op === "clone") {
    const form = button.closest("form");
    body = {
      set: form.elements.set.value.split("\n").map((s) => s.trim()).filter(Boolean),
      warm_start: form.elements.warm_start.checked,
    };
  } else if (op === "withdraw") {
    body = {op: button.dataset.what};
  } else if (CONFIRM[op] && !confirm(CONFIRM[op](trial))) {
    return;
  }
  button.disabled = true;
  let note;
  try {
    const response = await fetch(button.dataset.url, {
      method: "POST",
      credentials: "same-origin",
      headers: {"Content-Type": "application/json"},
      body: JSON.stringify(body),
    });
    const data = await response.json().catch(() => ({error: `HTTP ${response.status}`}));
    note = response.ok ? {text: data.message, error: false} : {text: `trial ${trial}: ${data.error}`, error: true};
    if (response.ok && op === "clone") {
      button.closest("details").open = false;
      feedback.set(String(data.trial), {text: `new: clone of trial ${trial}`, error: false});
    }
  } catch (error) {
    note = {text: `trial ${trial}: ${error}`, error: true};
  } finally {
    button.disabled = false;
  }
  feedback.set(trial, note);
  const status = document.getElementById("status");
  status.textContent = note.text;
  status.className = note.error ? "error" : "";
  showFeedback(card);
  if (!note.error) await refresh();
});

document.addEventListener("toggle", (event) => {
  const details = event.target;
  if (details.matches && details.matches("details.samples") && details.open && details.dataset.loaded !== details.dataset.version) {
    loadSamples(details);
  }
}, true);

document.addEventListener("DOMContentLoaded", () => {
  drawCharts(document);
  setInterval(() => {
    const stamp = document.getElementById("refreshed");
    if (document.getElementById("autorefresh").checked) refresh();
    else {
      stamp.textContent = "refresh paused: tick the box to resume";
      stamp.className = "paused";
    }
  }, 5000);
});
