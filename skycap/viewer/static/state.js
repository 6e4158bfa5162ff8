// The page state lives in the URL: run, view, filters, sort, page, open group and rollout,
// drawer tab and chosen paths, so a link (or a reload) reproduces exactly what one sees.

export const FILTER_KEYS = ["step", "task", "status", "ann", "q", "flag"];
const KEYS = ["run", "view", "sort", "order", "page", ...FILTER_KEYS, "group", "open", "tab",
  "path", "fa", "fb", "group_by", "cols"];

// Sorts whose first click is ascending (text); the others start with the largest.
export function firstOrder(sort) {
  return ["task", "status", "stop_reason"].includes(sort) || sort.startsWith("meta.") ? "asc" : "desc";
}

export function readState() {
  const params = new URLSearchParams(location.search);
  const state = {};
  for (const key of KEYS) {
    const value = params.get(key);
    if (value !== null && value !== "") state[key] = value;
  }
  return state;
}

export function writeState(state, { push = false } = {}) {
  const params = new URLSearchParams();
  for (const key of KEYS) {
    if (state[key] !== undefined && state[key] !== null && state[key] !== "") {
      params.set(key, state[key]);
    }
  }
  const query = params.toString();
  const url = query ? `?${query}` : location.pathname;
  if (url === location.search || (!query && !location.search)) return;
  if (push) history.pushState(null, "", url);
  else history.replaceState(null, "", url);
}

// Query string for a table request: the filters, sort, order, page and group key.
export function tableQuery(state) {
  const params = new URLSearchParams();
  for (const key of [...FILTER_KEYS, "sort", "order", "page", "group_by"]) {
    if (state[key]) params.set(key, state[key]);
  }
  const query = params.toString();
  return query ? `?${query}` : "";
}
