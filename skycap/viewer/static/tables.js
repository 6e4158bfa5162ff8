// The two tables: groups (one row per prompt per step, expandable in place) and rollouts
// (one row per trajectory). Rows carry data-nav so j/k can walk them in DOM order.

import {
  el, flagChip, fmtInt, fmtRange, fmtReward, fmtStep, fmtTime, rewardColor, strip, FLAG_LEVELS,
} from "./util.js";

function header(columns, state, onSort, extra = []) {
  // Two columns may sort by one key (a group's reward dots and its mean): one arrow, on the first.
  const arrowAt = columns.findIndex(([, sort]) => sort && sort === state.sort);
  return el("thead", {}, el("tr", {}, columns.map(([label, sort, cls, remove], i) => {
    if (!sort) return el("th", { class: cls }, label);
    const removeButton = remove ? el("button", {
      type: "button", class: "col-remove", title: `remove the ${label} column`,
      onclick: (e) => { e.stopPropagation(); remove(); },
    }, "×") : null;
    const active = i === arrowAt;
    const arrow = active ? (state.order === "asc" ? " ▲" : " ▼") : "";
    return el("th", {
      class: `sortable ${cls || ""}${active ? " sorted" : ""}`,
      title: `sort by ${sort}`,
      dataset: { sort },
      onclick: () => onSort(sort),
    }, label + arrow, removeButton);
  }), extra));
}

// The meta keys shown as columns (the URL's `cols`), in the order chosen.
function chosenColumns(state) {
  return (state.cols || "").split(",").filter(Boolean);
}

// A header cell offering the run's meta keys as more columns.
function columnChooser(data, state, onColumns) {
  const chosen = chosenColumns(state);
  const free = (data.meta_keys || []).filter((key) => !chosen.includes(key));
  if (!free.length || !onColumns) return [];
  return [el("th", { class: "add-col" }, el("select", {
    class: "add-col", title: "show a meta key as a column",
    onchange: (e) => { if (e.target.value) onColumns([...chosen, e.target.value]); },
  }, el("option", { value: "" }, "+ column"), free.map((key) => el("option", { value: key }, key))))];
}

// One thin strip per path (the first STRIPS_SHOWN), so forks show what each path trains.
function strips(row) {
  const runs = row.strips && row.strips.length ? row.strips : [row.strip];
  const more = row.paths > runs.length ? el("span", { class: "muted strips-more" }, `+${row.paths - runs.length}`) : null;
  return el("span", {
    class: `strips${runs.length > 1 ? " multi" : ""}`,
    title: runs.length > 1 ? `${row.paths} paths: one strip each` : null,
  }, runs.map((r) => strip(r)), more);
}

function flagList(flags, groupFlags = []) {
  return el("span", { class: "flags" },
    groupFlags.map((f) => el("span", {
      class: `flag lvl-${FLAG_LEVELS[f]} group-flag`, title: `group flag: ${f}`, text: f,
    })),
    flags.map((f) => flagChip(f, FLAG_LEVELS[f])));
}

function rewardCell(reward, range) {
  const color = rewardColor(reward, range);
  return el("td", { class: "num reward" },
    color ? el("span", { class: "dot", style: `background:${color}` }) : null,
    fmtReward(reward));
}

// Date and time may sit on two lines in a narrow window, never a date cut at its hyphens.
function timeCell(seconds) {
  const [date, time] = fmtTime(seconds).split(" ");
  return el("td", { class: "time" }, el("span", { class: "date" }, date), time ? ` ${time}` : null);
}

function statusCell(status) {
  return el("td", {}, el("span", { class: `status st-${status}` }, status));
}

const ROLLOUT_COLUMNS = [
  ["Rollout", null, "id"], ["Mask", null], ["Tokens", "tokens", "num"],
  ["Train\u00adable", "trainable", "num"], ["Turns", "turns", "num"], ["Paths", "paths", "num"],
  ["Reward", "reward", "num"], ["Flags", "health"], ["Status", "status"],
  ["Stop reason", "stop_reason"], ["Step", "step", "num"], ["Task", "task"],
  ["Created", "created"],
];

// What the run index (index/<phase>/step-N.json) says of a rollout: trained or not, and
// superseded when the grouping did not already say so.
function indexMark(indexed, shownSuperseded) {
  if (!indexed) return null;
  const where = `${indexed.phase} step ${indexed.step}`;
  const marks = [];
  if (indexed.trained === true) {
    marks.push(el("span", { class: "idx trained", title: `trained in ${where}` }, "trained"));
  } else if (indexed.trained === false) {
    marks.push(el("span", { class: "idx untrained", title: `not trained (${where})` }, "not trained"));
  }
  if (indexed.superseded && !shownSuperseded) {
    marks.push(el("span", { class: "idx superseded", title: `superseded in ${where}` }, "superseded"));
  }
  return marks.length ? el("span", { class: "idx-marks" }, marks) : null;
}

function rolloutRow(row, range, onOpen, { inGroup = false, metaKeys = [] } = {}) {
  const problems = row.problems
    ? el("span", { class: "problem-mark", title: `${row.problems} record problem(s)` }, "⚠")
    : null;
  const superseded = row.superseded_by
    ? el("span", { class: "sup-note", title: `superseded by ${row.superseded_by}` }, "↳ superseded")
    : null;
  const cells = [
    el("td", { class: "id" }, superseded, el("a", {
      href: "#", onclick: (e) => { e.preventDefault(); onOpen(row.id); },
    }, row.id), problems, indexMark(row.indexed, !!row.superseded_by)),
    el("td", {}, strips(row)),
    el("td", { class: "num" }, fmtInt(row.tokens)),
    el("td", { class: "num" }, fmtInt(row.trainable)),
    el("td", { class: "num" }, fmtInt(row.turns)),
    el("td", { class: "num" }, fmtInt(row.paths)),
    rewardCell(row.reward, range),
    el("td", {}, flagList(row.flags, inGroup ? [] : row.group_flags)),
    statusCell(row.status),
  ];
  if (!inGroup) {
    cells.push(
      el("td", { class: "muted" }, row.stop_reason ?? ""),
      el("td", { class: "num" }, fmtStep(row.step)),
      el("td", { class: "task" }, row.task ?? "—"),
      timeCell(row.created_at),
      ...metaKeys.map((key) => el("td", { class: "meta-col" }, (row.meta || {})[key] ?? "—")),
    );
  } else {
    cells.push(el("td", { class: "muted" }, row.stop_reason ?? ""));
  }
  return el("tr", {
    class: `rollout${row.superseded_by ? " superseded" : ""}`,
    dataset: { nav: "rollout", id: row.id },
    ondblclick: () => onOpen(row.id),
  }, cells);
}

export function rolloutsTable(data, state, { onSort, onOpen, onColumns }) {
  const metaKeys = chosenColumns(state);
  const columns = [...ROLLOUT_COLUMNS, ...metaKeys.map((key) => [key, `meta.${key}`, "meta-col",
    () => onColumns(metaKeys.filter((k) => k !== key))])];
  const body = el("tbody", {}, data.rows.map((row) => rolloutRow(row, data.reward_range, onOpen, { metaKeys })));
  if (!data.rows.length) {
    body.append(el("tr", {}, el("td", { colspan: columns.length, class: "empty-row" },
      "No rollouts match these filters.")));
  }
  const extra = columnChooser(data, state, onColumns);
  return el("table", { class: "grid rollouts" }, header(columns, state, onSort, extra), body);
}

const GROUP_COLUMNS = [
  ["", null, "caret"], ["Step", "step", "num"], ["Task", "task"], ["Rewards", "reward"],
  ["Mean", "reward", "num"], ["Turns", "turns", "num"], ["Tokens", "tokens", "num"],
  ["Group flags", "health"], ["Rollout flags", null],
];

// One dot per counting rollout, in repetition order (viewer.md §5).
function rewardDots(group, range, onOpen) {
  return el("span", { class: "dots" }, group.dots.map((dot) => {
    const color = rewardColor(dot.reward, range);
    const stop = dot.stop_reason ? ` (${dot.stop_reason})` : "";
    return el("span", {
      class: `dot${color ? "" : " none"}`,
      style: color ? `background:${color}` : null,
      title: `repetition ${dot.repetition}: reward ${fmtReward(dot.reward)}${stop} — ${dot.id}`,
      dataset: { id: dot.id },
      onclick: (e) => { e.stopPropagation(); onOpen(dot.id); },
    });
  }));
}

function rollup(counts) {
  return el("span", { class: "rollup" }, Object.entries(counts).map(([flag, n]) =>
    flagChip(flag, FLAG_LEVELS[flag], String(n))));
}

function groupRows(group, data, expanded, handlers) {
  const { onToggle, onOpen } = handlers;
  const short = group.flags.includes("short");
  const task = el("td", { class: "task", title: `group ${group.key}` }, group.task ?? "—",
    group.label ? el("span", { class: "group-label" }, ` · ${group.label}`) : null,
    short ? el("span", { class: "short-note", title: "short group" }, ` ${group.size} of ${group.modal}`) : null);
  const pass = group.binary ? el("span", { class: "pass" }, ` ${group.pass}/${group.size}`) : null;
  const row = el("tr", {
    class: `group${expanded ? " open" : ""}`,
    dataset: { nav: "group", key: group.key },
    onclick: () => onToggle(group.key),
  },
  el("td", { class: "caret" }, expanded ? "▾" : "▸"),
  el("td", { class: "num" }, fmtStep(group.step)),
  task,
  el("td", {}, rewardDots(group, data.reward_range, onOpen), pass),
  rewardCell(group.mean_reward, data.reward_range),
  el("td", { class: "num" }, fmtRange(group.turns)),
  el("td", { class: "num" }, fmtRange(group.tokens)),
  el("td", {}, flagList(group.flags)),
  el("td", {}, rollup(group.rollup)));
  if (!expanded) return [row];
  const inner = el("table", { class: "grid inner" },
    el("thead", {}, el("tr", {}, ["Rollout", "Mask", "Tokens", "Trainable", "Turns", "Paths",
      "Reward", "Flags", "Status", "Stop reason"].map((h) => el("th", {}, h)))),
    el("tbody", {}, group.rollouts.map((r) => rolloutRow(r, data.reward_range, onOpen, { inGroup: true }))));
  const attempts = group.attempts > group.size ? ` · ${group.attempts - group.size} superseded attempt(s) greyed` : "";
  return [row, el("tr", { class: "group-body" }, el("td", { colspan: GROUP_COLUMNS.length },
    el("div", { class: "group-meta" }, `group ${group.key} · ${group.size} counting rollout(s)${attempts}`),
    inner))];
}

export function groupsTable(data, state, handlers) {
  const body = el("tbody", {});
  for (const group of data.groups) {
    body.append(...groupRows(group, data, state.group === group.key, handlers));
  }
  if (!data.groups.length) {
    body.append(el("tr", {}, el("td", { colspan: GROUP_COLUMNS.length, class: "empty-row" },
      "No groups match these filters.")));
  }
  return el("table", { class: "grid groups" }, header(GROUP_COLUMNS, state, handlers.onSort), body);
}
