// The two tables: groups (one row per prompt per step, expandable in place) and rollouts
// (one row per trajectory). Rows carry data-nav so j/k can walk them in DOM order.

import {
  el, flagChip, fmtInt, fmtRange, fmtReward, fmtStep, fmtTime, rewardColor, strip, FLAG_LEVELS,
} from "./util.js";

function header(columns, state, onSort) {
  return el("thead", {}, el("tr", {}, columns.map(([label, sort, cls]) => {
    if (!sort) return el("th", { class: cls }, label);
    const active = state.sort === sort;
    const arrow = active ? (state.order === "asc" ? " ▲" : " ▼") : "";
    return el("th", {
      class: `sortable ${cls || ""}${active ? " sorted" : ""}`,
      title: `sort by ${sort}`,
      dataset: { sort },
      onclick: () => onSort(sort),
    }, label + arrow);
  })));
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

function statusCell(status) {
  return el("td", {}, el("span", { class: `status st-${status}` }, status));
}

const ROLLOUT_COLUMNS = [
  ["Rollout", null, "id"], ["Mask", null], ["Tokens", "tokens", "num"],
  ["Trainable", null, "num"], ["Turns", "turns", "num"], ["Paths", null, "num"],
  ["Reward", "reward", "num"], ["Flags", "health"], ["Status", null], ["Step", "step", "num"],
  ["Task", "task"], ["Created", "created"],
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

function rolloutRow(row, range, onOpen, { inGroup = false } = {}) {
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
    el("td", {}, strip(row.strip)),
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
      el("td", { class: "num" }, fmtStep(row.step)),
      el("td", { class: "task" }, row.task ?? "—"),
      el("td", { class: "time" }, fmtTime(row.created_at)),
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

export function rolloutsTable(data, state, { onSort, onOpen }) {
  const body = el("tbody", {}, data.rows.map((row) => rolloutRow(row, data.reward_range, onOpen)));
  if (!data.rows.length) {
    body.append(el("tr", {}, el("td", { colspan: ROLLOUT_COLUMNS.length, class: "empty-row" },
      "No rollouts match these filters.")));
  }
  return el("table", { class: "grid rollouts" }, header(ROLLOUT_COLUMNS, state, onSort), body);
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
  const task = el("td", { class: "task" }, group.task ?? "—",
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
