// Small shared helpers for the skycap viewer page: DOM building, formatting, colours.

export const FLAG_HELP = {
  "no-signal": "group: every counting rollout has the same numeric reward (no learning signal)",
  masked: "group: a counting rollout stopped with agent_timeout or error",
  short: "group: fewer counting rollouts than the run's usual group size",
  retried: "group: some repetition has more than one attempt",
  "malformed-record": "a node slices into a sidecar kind the manifest does not list",
  "tokens-missing": "the manifest lists a tokens sidecar that is not beside the document",
  "failed-calls": "some model calls failed and produced no node",
  incomplete: "the trajectory never ended (status open or ended=false)",
  "no-logprobs": "token mode: some trainable tokens have no logprobs",
  unbridged: "some call re-rendered its prompt in full with no fork or branch switch to explain it: worth a look (the Tree tab marks the node)",
  "unbridged-expected": "calls re-rendered their prompt in full where that is expected: after a fork (resample, compaction, edited reply) or a call on another branch; the Tree tab names each cause",
  "unbridged-inferred": "a re-tokenized copy of a model reply precedes a model call (old record)",
  replayed: "a client-written assistant message is on a path (not sampled by the model)",
  "no-train": "token mode: some path trains zero tokens",
  empty: "no model call captured",
  truncated: "some call stopped at max tokens (finish_reason length)",
  abandoned: "ended by the idle TTL, not by finish",
  forked: "more than one root-to-leaf path",
  "bridged-unknown": "written before calls recorded `bridged`",
};

export const KIND_HELP = {
  given: "given: a client message the model read",
  replayed: "replayed: an assistant message written by the client, not sampled",
  scaffold: "scaffold: template tokens before the sampled reply",
  sampled: "sampled: trained on this path",
  "sampled-elsewhere": "sampled, trained on another path",
};

export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value === undefined || value === null || value === false) continue;
    if (key === "class") node.className = value;
    else if (key === "text") node.textContent = value;
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else if (key === "dataset") Object.assign(node.dataset, value);
    else node.setAttribute(key, value === true ? "" : value);
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : String(child));
  }
  return node;
}

// Replace a node's children, skipping null, undefined and false (arrays are flattened).
export function fill(node, ...children) {
  node.replaceChildren(...children.flat(Infinity).filter((c) => c !== null && c !== undefined && c !== false));
  return node;
}

const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };
export function esc(text) {
  return String(text).replace(/[&<>"']/g, (c) => ESCAPES[c]);
}

export function fmtInt(n) {
  return n === null || n === undefined ? "—" : Number(n).toLocaleString("en-US");
}

export function fmtRange(range) {
  if (!range) return "—";
  const [lo, hi] = range;
  return lo === hi ? fmtInt(lo) : `${fmtInt(lo)}–${fmtInt(hi)}`;
}

export function fmtReward(r) {
  if (r === null || r === undefined) return "—";
  return Number.isInteger(r) ? String(r) : r.toFixed(3).replace(/0+$/, "").replace(/\.$/, "");
}

export function fmtTime(seconds) {
  if (seconds === null || seconds === undefined) return "—";
  const d = new Date(seconds * 1000);
  return d.toISOString().replace("T", " ").slice(0, 19);
}

export function fmtStep(step) {
  return step === null || step === undefined ? "—" : String(step);
}

// Red→green over the run-wide reward range; all equal → the midpoint (viewer.md §5).
export function rewardColor(reward, range) {
  if (reward === null || reward === undefined) return null;
  let t = 0.5;
  if (range && range.max > range.min) t = (reward - range.min) / (range.max - range.min);
  t = Math.min(1, Math.max(0, t));
  return `hsl(${Math.round(t * 120)} 65% 45%)`;
}

export function flagChip(flag, level, extra = "") {
  return el("span", {
    class: `flag lvl-${level || "info"}`,
    title: FLAG_HELP[flag] || flag,
    text: extra ? `${extra} ${flag}` : flag,
  });
}

export const FLAG_LEVELS = {
  "no-signal": "warn", masked: "warn", short: "warn", retried: "info",
  "malformed-record": "error", "tokens-missing": "warn", "failed-calls": "error",
  incomplete: "error", "no-logprobs": "error", unbridged: "warn",
  "unbridged-inferred": "warn", "unbridged-expected": "info", replayed: "warn", "no-train": "warn", empty: "warn",
  truncated: "warn", abandoned: "info", forked: "info", "bridged-unknown": "info",
};

// A proportional strip of [kind, length] runs: where one path's tokens train.
export function strip(runs, width = 120) {
  const total = runs.reduce((sum, [, n]) => sum + n, 0);
  const bar = el("span", { class: "strip", style: `width:${width}px` });
  if (!total) {
    bar.classList.add("strip-empty");
    return bar;
  }
  for (const [kind, n] of runs) {
    bar.append(el("span", {
      class: `k-${kind}`,
      style: `flex-grow:${n}`,
      title: `${kind}: ${fmtInt(n)}`,
    }));
  }
  return bar;
}

export function legend() {
  return el("span", { class: "legend" },
    Object.entries(KIND_HELP).map(([kind, help]) =>
      el("span", { class: "legend-item", title: help },
        el("span", { class: `swatch k-${kind}` }), kind)));
}

// What a reader sees of a message (the same rule as the server's fallback text).
export function messageText(message) {
  if (!message || typeof message !== "object") return "";
  const parts = [];
  const reasoning = message.reasoning_content || message.reasoning;
  if (typeof reasoning === "string" && reasoning) parts.push(`<think>\n${reasoning}\n</think>`);
  const content = message.content;
  if (typeof content === "string") parts.push(content);
  else if (Array.isArray(content)) {
    for (const part of content) {
      if (part && typeof part.text === "string") parts.push(part.text);
      else if (part && part.type === "opaque") {
        // Kept as sent: name what it holds.
        const held = part.value && typeof part.value === "object" ? part.value.type : null;
        parts.push(`[${held || "opaque"}]`);
      } else if (part && part.type) parts.push(`[${part.type}]`);
    }
  }
  for (const call of Array.isArray(message.tool_calls) ? message.tool_calls : []) {
    const fn = (call && call.function) || {};
    const args = typeof fn.arguments === "string" ? fn.arguments : JSON.stringify(fn.arguments);
    parts.push(`[tool call] ${fn.name}(${args})`);
  }
  return parts.filter(Boolean).join("\n");
}
