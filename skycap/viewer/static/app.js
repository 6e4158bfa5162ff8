// The skycap viewer page: runs on the left, the groups or rollouts table with filters and the
// health band, and the rollout drawer. All state is in the URL; the page polls every 5 s.

import { getJSON, runPath } from "./api.js";
import { Drawer } from "./drawer.js";
import { FILTER_KEYS, firstOrder, readState, tableQuery, writeState } from "./state.js";
import { groupsTable, rolloutsTable } from "./tables.js";
import { el, fill, FLAG_HELP, FLAG_LEVELS, fmtInt } from "./util.js";

const POLL_MS = 5000;
const $ = (selector) => document.querySelector(selector);
const TABLE_KEYS = ["run", "view", "sort", "order", "page", "group_by", ...FILTER_KEYS];
const DRAWER_KEYS = ["open", "tab", "path", "fa", "fb"];

let state = readState();
let runs = [];
let table = null;
let tableKey = null;
let cursorKey = null;
const drawer = new Drawer($("#drawer"), $("#tooltip"), (patch) => update(patch, { push: "open" in patch }));

function currentRun() {
  return runs.find((run) => run.name === state.run);
}

function currentView() {
  return state.view || (currentRun() ? currentRun().default_view : "rollouts");
}

function update(patch, { push = false } = {}) {
  const next = { ...state };
  for (const [key, value] of Object.entries(patch)) {
    if (value === null || value === undefined || value === "") delete next[key];
    else next[key] = String(value);
  }
  state = next;
  writeState(state, { push });
  apply();
}

function notice(message, kind = "warn-box") {
  fill($("#notice"), message ? el("div", { class: kind }, message) : null);
}

async function loadRuns() {
  const data = await getJSON("/api/v1/runs");
  runs = data.runs;
  $("#roots").textContent = data.roots.join(" · ");
  if (!state.run && runs.length) {
    state.run = runs[0].name;
    writeState(state);
  }
  renderRuns();
}

function renderRuns() {
  const nav = $("#runs");
  if (!runs.length) {
    nav.replaceChildren(el("div", { class: "empty-note" }, "No runs yet. Waiting for records…"));
    return;
  }
  nav.replaceChildren(el("h3", {}, "Runs"), ...runs.map((run) => el("a", {
    href: `?run=${encodeURIComponent(run.name)}`,
    class: `run${run.name === state.run ? " active" : ""}`,
    dataset: { run: run.name },
    title: run.path,
    onclick: (e) => {
      e.preventDefault();
      const clear = Object.fromEntries([...TABLE_KEYS, ...DRAWER_KEYS, "group"].map((k) => [k, null]));
      update({ ...clear, run: run.name }, { push: true });
    },
  },
  el("span", { class: "run-name" }, run.name),
  el("span", { class: "run-meta muted" },
    runLabel(run),
    run.unreadable ? el("span", { class: "lvl-error-text" }, ` · ${run.unreadable} unreadable`) : null))));
}

// "5 rollouts, tokens mode", or with several modes "7 rollouts: 5 tokens, 2 text mode".
function runLabel(run) {
  const n = `${fmtInt(run.trajectories)} rollout${run.trajectories === 1 ? "" : "s"}`;
  const modes = Object.entries(run.modes);
  if (!modes.length) return n;
  if (modes.length === 1) return `${n}, ${modes[0][0]} mode`;
  return `${n}: ${modes.map(([m, k]) => `${fmtInt(k)} ${m}`).join(", ")} mode`;
}

function syncControls() {
  const view = currentView();
  for (const button of document.querySelectorAll(".views button")) {
    button.classList.toggle("active", button.dataset.view === view);
  }
  const form = $("#filters");
  for (const key of [...FILTER_KEYS, "sort", "order", "group_by"]) {
    if (form.elements[key] && document.activeElement !== form.elements[key]) {
      form.elements[key].value = state[key] || "";
    }
  }
}

function renderHealth(data) {
  const band = $("#health");
  const unit = data.view === "groups" ? "groups" : "rollouts";
  const chips = data.health.map(({ flag, level, count }) => el("button", {
    type: "button",
    class: `chip lvl-${level}${state.flag === flag ? " active" : ""}`,
    title: `${FLAG_HELP[flag]} — click to ${state.flag === flag ? "clear the filter" : `show only these ${unit}`}`,
    dataset: { flag },
    onclick: () => update({ flag: state.flag === flag ? null : flag, page: null }, { push: true }),
  }, el("b", {}, fmtInt(count)), ` ${flag}`));
  const clear = state.flag && !data.health.some((h) => h.flag === state.flag)
    ? el("button", { type: "button", class: "chip active", onclick: () => update({ flag: null }) }, `${state.flag} ✕`)
    : "";
  const hidden = data.view === "groups" ? data.ungrouped : 0;
  const label = hidden ? `Health (groups, and ${fmtInt(hidden)} ungrouped rollouts):` : `Health (${unit}):`;
  band.replaceChildren(
    el("span", { class: "muted health-label" }, label),
    ...(chips.length ? chips : [el("span", { class: "muted" }, "no flags")]),
    clear,
    hidden ? showUngrouped(data) : "");
}

// Rollouts without a group key are no rows of the Groups view: say so, with their flags,
// and show them in one click (the Rollouts view lists every rollout, the flag filter kept).
function showUngrouped(data) {
  const flags = data.ungrouped_health.map(({ flag, count }) => `${count} ${flag}`).join(", ");
  return el("button", {
    type: "button",
    class: "chip hidden-rows",
    title: "rollouts whose meta lacks a group key (step, instance_id by default) are not in any group",
    onclick: () => update({ view: "rollouts", page: null, sort: null, order: null, group: null }, { push: true }),
  }, `${fmtInt(data.ungrouped)} ungrouped rollout(s) not shown${flags ? ` (${flags})` : ""}: show them`);
}

function renderPager(data) {
  const total = data.view === "groups" ? "groups" : "rollouts";
  const extra = data.view === "groups" && data.ungrouped ? ` · ${data.ungrouped} ungrouped` : "";
  $("#pager").replaceChildren(
    el("button", { type: "button", disabled: data.page <= 1, onclick: () => update({ page: data.page - 1 }, { push: true }) }, "‹ prev"),
    el("span", { class: "muted" }, `page ${data.page} of ${data.pages} · ${fmtInt(data.total)} ${total}${extra}`),
    el("button", { type: "button", disabled: data.page >= data.pages, onclick: () => update({ page: data.page + 1 }, { push: true }) }, "next ›"));
}

function onSort(sort) {
  const order = state.sort === sort ? (state.order === "asc" ? "desc" : "asc") : firstOrder(sort);
  update({ sort, order, page: null }, { push: true });
}

function openRollout(id) {
  update({ open: id, tab: state.open ? state.tab : null, path: null, fa: null, fb: null }, { push: true });
}

function renderTable() {
  if (!table) return;
  const handlers = {
    onSort,
    onOpen: openRollout,
    onToggle: (key) => update({ group: state.group === key ? null : key }, { push: true }),
    onColumns: (keys) => update({ cols: keys.join(",") || null }, { push: true }),
  };
  const node = table.view === "groups" ? groupsTable(table, state, handlers) : rolloutsTable(table, state, handlers);
  $("#table").replaceChildren(node);
  renderHealth(table);
  renderPager(table);
  if (table.view === "groups" && !table.groupable) {
    notice("Fewer than half of this run's rollouts have a group key (meta step + instance_id): the Rollouts view may suit it better.");
  } else notice(null);
  markCursor();
}

async function loadTable({ quiet = false } = {}) {
  const run = currentRun();
  if (!run) {
    $("#table").replaceChildren(runs.length ? el("div", { class: "error-box" }, `No run named ${state.run}.`) : "");
    return;
  }
  const view = currentView();
  const key = `${run.name}|${view}|${tableQuery(state)}`;
  if (quiet && key !== tableKey) return;
  tableKey = key;
  const path = `${runPath(run.name)}/${view === "groups" ? "groups" : "trajectories"}${tableQuery(state)}`;
  try {
    const data = await getJSON(path);
    if (key !== tableKey) return;
    table = data;
    renderTable();
  } catch (error) {
    $("#table").replaceChildren(el("div", { class: "error-box" }, error.message));
  }
}

function apply() {
  syncControls();
  renderRuns();
  const view = currentView();
  const key = `${state.run}|${view}|${tableQuery(state)}`;
  if (key !== tableKey) loadTable();
  else renderTable();
  if (state.open && state.run) drawer.open(state.run, state.open, state);
  else if (drawer.isOpen) drawer.close();
}

// Keyboard: j/k walk the visible rows, Enter expands a group or opens a rollout, Esc closes.
function navRows() {
  return [...document.querySelectorAll("#table tr[data-nav]")];
}

function rowKey(row) {
  return row.dataset.nav === "group" ? `g:${row.dataset.key}` : `r:${row.dataset.id}`;
}

function markCursor() {
  for (const row of navRows()) row.classList.toggle("cursor", rowKey(row) === cursorKey);
}

function moveCursor(delta) {
  const rows = navRows();
  if (!rows.length) return;
  const index = rows.findIndex((row) => rowKey(row) === cursorKey);
  const next = rows[Math.min(rows.length - 1, Math.max(0, index === -1 ? 0 : index + delta))];
  cursorKey = rowKey(next);
  markCursor();
  next.scrollIntoView({ block: "nearest" });
}

function activateCursor() {
  const row = navRows().find((r) => rowKey(r) === cursorKey);
  if (!row) return;
  if (row.dataset.nav === "group") update({ group: state.group === row.dataset.key ? null : row.dataset.key }, { push: true });
  else openRollout(row.dataset.id);
}

document.addEventListener("keydown", (event) => {
  if (event.target.matches("input, select, textarea")) {
    if (event.key === "Escape") event.target.blur();
    return;
  }
  if (event.metaKey || event.ctrlKey || event.altKey) return;
  if (event.key === "Escape") {
    if (state.open) update({ open: null, tab: null, path: null, fa: null, fb: null }, { push: true });
    else if (state.group) update({ group: null }, { push: true });
  } else if (event.key === "j" || event.key === "ArrowDown") {
    event.preventDefault();
    moveCursor(1);
  } else if (event.key === "k" || event.key === "ArrowUp") {
    event.preventDefault();
    moveCursor(-1);
  } else if (event.key === "Enter" && !event.target.matches("button, a")) {
    activateCursor();
  }
});

function setupControls() {
  const flags = $("#filters").elements.flag;
  for (const flag of Object.keys(FLAG_LEVELS)) flags.append(el("option", { value: flag }, flag));
  $("#filters").addEventListener("change", (event) => {
    const { name, value } = event.target;
    if (name) update({ [name]: value, page: null }, { push: true });
  });
  $("#filters").addEventListener("submit", (event) => {
    event.preventDefault();
    const { name, value } = document.activeElement;
    if (name) update({ [name]: value, page: null }, { push: true });
  });
  $("#filters").addEventListener("reset", (event) => {
    event.preventDefault();
    update(Object.fromEntries([...FILTER_KEYS, "sort", "order", "page", "group", "group_by"].map((k) => [k, null])), { push: true });
  });
  for (const button of document.querySelectorAll(".views button")) {
    button.addEventListener("click", () => update({ view: button.dataset.view, page: null, sort: null, order: null, group: null }, { push: true }));
  }
  $("#theme").addEventListener("click", () => {
    const theme = document.documentElement.dataset.theme === "dark" ? "light" : "dark";
    document.documentElement.dataset.theme = theme;
    localStorage.setItem("skycap-theme", theme);
  });
  window.addEventListener("popstate", () => {
    state = readState();
    apply();
  });
}

let lostContact = false;

async function poll() {
  try {
    await loadRuns();
    const run = currentRun();
    if (run && table && run.version !== table.version) loadTable({ quiet: true });
    else if (lostContact) renderTable();
    lostContact = false;
  } catch (error) {
    lostContact = true;
    notice(`Lost contact with the viewer server: ${error.message}`, "error-box");
  }
}

async function main() {
  setupControls();
  try {
    await loadRuns();
  } catch (error) {
    notice(error.message, "error-box");
    return;
  }
  apply();
  setInterval(poll, POLL_MS);
}

main();
