// The rollout drawer: header (flags, problems, warnings) and the Path, Tree, Forks, Calls and
// JSON tabs of one trajectory. Tab, path and the two compared paths are reported to the URL.

import { getJSON, trajectoryPath } from "./api.js";
import { TokenView, versionLabels } from "./tokenview.js";
import {
  el, fill, flagChip, fmtInt, fmtReward, fmtTime, legend, messageText, strip, FLAG_LEVELS,
} from "./util.js";

export const TABS = ["path", "tree", "forks", "calls", "json"];

function blockLabel(block, nodes) {
  const role = (nodes[block.node] || {}).role || "";
  const n = `n${block.node}`;
  switch (block.kind) {
    case "given": return `${n} ${role}`;
    case "sampled-elsewhere": return `${n} → p${block.trained_in}`;
    default: return `${n} ${block.kind}`;
  }
}

function pathOption(path, unit) {
  const amount = unit === "tokens"
    ? `${fmtInt(path.tokens)} tokens · ${fmtInt(path.trainable)} trainable`
    : `${path.nodes.length} nodes`;
  return `p${path.index} · leaf n${path.leaf} · ${amount}`;
}

function bridgedText(value) {
  return value === "absent" ? "absent" : String(value);
}

// A call's bridged cell: an unbridged call a fork explains is expected, not a fault.
function bridgedCell(call) {
  if (call.bridged === false && call.rerender) {
    return el("td", { class: "bridged b-expected", title: `re-rendered in full, as expected: ${call.rerender}` },
      `false · ${call.rerender}`);
  }
  return el("td", { class: `bridged b-${bridgedText(call.bridged)}` }, bridgedText(call.bridged));
}

export class Drawer {
  constructor(root, tooltip, onState) {
    this.root = root;
    this.tooltip = tooltip;
    this.onState = onState;
    this.key = null;
    this.view = null;
  }

  get isOpen() {
    return !this.root.hidden;
  }

  close() {
    this.root.hidden = true;
    this.key = null;
    if (this.view) this.view.destroy();
    this.view = null;
    document.body.classList.remove("drawer-open");
  }

  async open(run, id, state) {
    const key = `${run}/${id}`;
    this.root.hidden = false;
    document.body.classList.add("drawer-open");
    if (this.key !== key) {
      this.key = key;
      this.run = run;
      this.id = id;
      this.graph = null;
      this.calls = null;
      this.paths = new Map();
      fill(this.root, el("div", { class: "loading" }, `Loading ${id}…`));
      try {
        this.detail = await getJSON(trajectoryPath(run, id));
      } catch (error) {
        if (this.key !== key) return;
        fill(this.root, this.closeButton(), el("div", { class: "error-box" }, error.message));
        return;
      }
      if (this.key !== key) return;
      this.renderFrame();
    }
    this.state = state;
    await this.showTab(TABS.includes(state.tab) ? state.tab : "path");
  }

  closeButton() {
    return el("button", { class: "close", title: "close (Esc)", onclick: () => this.onState({ open: null }) }, "✕");
  }

  renderFrame() {
    const d = this.detail;
    const doc = d.document;
    const annotations = doc.annotations || {};
    const group = d.group;
    const groupText = group
      ? [`group ${group.key}`, group.superseded_by ? ` · superseded by ${group.superseded_by}` : "",
        group.supersedes.length ? ` · supersedes ${group.supersedes.length}` : ""].join("")
      : "ungrouped";
    const head = el("header", { class: "dr-head" },
      el("div", { class: "dr-title" },
        el("h2", {}, d.id),
        el("span", { class: `status st-${doc.status}` }, doc.status),
        el("span", { class: "dr-reward" }, `reward ${fmtReward(typeof annotations.reward === "boolean" ? Number(annotations.reward) : annotations.reward)}`),
        annotations.stop_reason ? el("span", { class: "muted" }, `stop reason ${annotations.stop_reason}`) : null,
        this.closeButton()),
      el("div", { class: "dr-sub muted" },
        `${d.run} · ${(doc.capture || {}).mode || "unknown"} mode · created ${fmtTime(doc.created_at)} · `,
        `${d.paths.length} path(s) · ${(doc.nodes || []).length} nodes · ${groupText}`),
      provenanceNote(doc.provenance),
      el("div", { class: "dr-flags" },
        d.group_flags.map((f) => flagChip(f, FLAG_LEVELS[f])),
        d.flags.map(({ flag, level }) => flagChip(flag, level))),
      d.problems.length ? el("div", { class: "error-box problems" },
        el("b", {}, `${d.problems.length} record problem(s): `),
        el("ul", {}, d.problems.slice(0, 20).map((p) => el("li", {}, p))),
        d.problems.length > 20 ? `… and ${d.problems.length - 20} more (see JSON)` : null) : null,
      d.warning ? el("div", { class: "warn-box" }, d.warning) : null,
      openNote(d.id, doc));
    this.tabBar = el("nav", { class: "tabs" }, TABS.map((tab) => el("button", {
      class: "tab", dataset: { tab }, onclick: () => this.onState({ tab }),
    }, tab === "json" ? "JSON" : tab[0].toUpperCase() + tab.slice(1))));
    this.body = el("div", { class: "dr-body" });
    fill(this.root, head, this.tabBar, this.body);
  }

  async showTab(tab) {
    for (const button of this.tabBar.querySelectorAll(".tab")) {
      button.classList.toggle("active", button.dataset.tab === tab);
    }
    if (this.view && tab !== "path") {
      this.view.destroy();
      this.view = null;
    }
    const key = this.key;
    const render = { path: this.pathTab, tree: this.treeTab, forks: this.forksTab, calls: this.callsTab, json: this.jsonTab }[tab];
    try {
      await render.call(this);
    } catch (error) {
      if (this.key === key) fill(this.body, el("div", { class: "error-box" }, error.message));
    }
  }

  async pathPayload(index) {
    if (!this.paths.has(index)) {
      this.paths.set(index, getJSON(`${trajectoryPath(this.run, this.id)}/paths/${index}`));
    }
    return this.paths.get(index);
  }

  async loadGraph() {
    if (!this.graph) this.graph = await getJSON(`${trajectoryPath(this.run, this.id)}/graph`);
    return this.graph;
  }

  async pathTab() {
    const d = this.detail;
    if (!d.paths.length) {
      fill(this.body, el("div", { class: "empty-note" }, "This trajectory has no nodes (no successful model call)."));
      return;
    }
    const index = Math.min(Number(this.state.path || 0), d.paths.length - 1);
    const key = this.key;
    const payload = await this.pathPayload(index);
    if (this.key !== key) return;
    const pathList = el("div", { class: "path-list" }, d.paths.map((p) => el("button", {
      type: "button",
      class: `path-entry${p.index === index ? " active" : ""}`,
      dataset: { path: p.index },
      onclick: () => this.onState({ path: p.index === 0 ? null : String(p.index) }),
    }, el("span", { class: "path-name" }, pathOption(p, d.unit)), strip(p.strip, 160))));
    const ribbon = el("input", { type: "checkbox", class: "ribbon-toggle" });
    const bigStrip = strip(payload.strip, 400);
    bigStrip.classList.add("strip-big");
    bigStrip.title = "click to jump";
    const host = el("div", { class: "tv-host" });
    const counts = payload.token_data
      ? `${fmtInt(payload.tokens)} tokens · ${fmtInt(payload.trainable)} trainable · ${fmtInt(payload.logprobs)} with logprobs`
      : `${payload.blocks.length} blocks (message text, in characters)`;
    fill(this.body, 
      d.paths.length > 1 ? pathList : null,
      el("div", { class: "path-bar" },
        el("b", {}, `p${index}`), bigStrip,
        payload.token_data ? el("label", { class: "muted", title: "colour sampled tokens by probability" }, ribbon, " logprob ribbon") : null),
      el("div", { class: "path-info muted" }, `${payload.id} · ${counts} · `, legend(), versionLegend(payload.blocks)),
      payload.warning && payload.warning !== d.warning ? el("div", { class: "warn-box" }, payload.warning) : null,
      host);
    if (this.view) this.view.destroy();
    this.view = new TokenView(host, this.tooltip);
    this.view.setData(payload, payload.blocks.map((b) => blockLabel(b, d.document.nodes)));
    ribbon.addEventListener("change", () => this.view.setRibbon(ribbon.checked));
    bigStrip.addEventListener("click", (e) => {
      const box = bigStrip.getBoundingClientRect();
      const total = payload.blocks.length ? payload.blocks[payload.blocks.length - 1].end : 0;
      this.view.scrollToToken(Math.floor(((e.clientX - box.left) / box.width) * total));
    });
  }

  nodeSize(node) {
    if (node.tokens !== null && node.tokens !== undefined) return node.tokens;
    return messageText((this.detail.document.nodes[node.id] || {}).message).length;
  }

  nodeCard(graph, id, { path = null } = {}) {
    const node = graph.nodes[id];
    const doc = this.detail.document.nodes[id] || {};
    let kind = node.author === "model" ? "sampled" : node.role === "assistant" ? "replayed" : "given";
    let note = "";
    if (node.author === "model" && path !== null && node.trained_in !== path) {
      kind = "sampled-elsewhere";
      note = ` · trained in p${node.trained_in}`;
    }
    return el("div", { class: `card k-border-${kind}` },
      el("div", { class: "card-head" }, `n${id} · ${node.role ?? "unnamed"} · ${node.author} · ${kind}${note}`,
        el("span", { class: "muted" }, ` · ${fmtInt(this.nodeSize(node))} ${node.tokens === null ? "chars" : "tokens"}`)),
      el("pre", { class: "card-text" }, messageText(doc.message)));
  }

  async treeTab() {
    const key = this.key;
    const graph = await this.loadGraph();
    if (this.key !== key) return;
    const forks = new Map(graph.forks.filter((f) => f.node !== undefined).map((f) => [f.node, f]));
    const leafPath = new Map(graph.paths.map((p) => [p.leaf, p.index]));
    const row = (id) => {
      const node = graph.nodes[id];
      const fork = forks.get(id);
      const details = el("div", { class: "node-details", hidden: true },
        el("pre", { class: "card-text" }, messageText((this.detail.document.nodes[id] || {}).message)),
        node.calls.length ? el("table", { class: "grid mini" },
          el("thead", {}, el("tr", {}, ["call", "model", "finish", "bridged", "ms"].map((h) => el("th", {}, h)))),
          el("tbody", {}, node.calls.map((c, j) => el("tr", {},
            el("td", {}, j), el("td", {}, c.model ?? "—"), el("td", {}, c.finish_reason ?? "—"),
            bridgedCell(c),
            el("td", { class: "num" }, c.t_end && c.t_start ? Math.round((c.t_end - c.t_start) * 1000) : "—"))))) : null);
      const line = el("div", {
        class: `tree-node a-${node.author}${node.children.length > 1 ? " branch-point" : ""}${fork ? " fork" : ""}`,
        dataset: { node: id },
        onclick: () => { details.hidden = !details.hidden; },
      },
      el("span", { class: "nid" }, `n${id}`),
      el("span", { class: "role" }, node.role ?? "unnamed"),
      el("span", { class: "muted" }, node.author === "model" ? "model" : "client"),
      el("span", { class: "muted" }, `${fmtInt(this.nodeSize(node))} ${node.tokens === null ? "chars" : "tok"}`),
      node.signs.map((s) => el("span", { class: "sign" }, s)),
      node.notes.map((s) => el("span", { class: "sign expected" }, s)),
      fork ? el("span", { class: "fork-mark", title: fork.detail }, `fork vs n${fork.vs}: ${fork.cause}`) : null,
      node.children.length > 1 ? el("span", { class: "branch-mark" }, `◆ ${node.children.length} branches`) : null,
      leafPath.has(id) ? el("a", {
        href: "#", class: "leaf-link",
        onclick: (e) => { e.preventDefault(); e.stopPropagation(); this.onState({ tab: "path", path: String(leafPath.get(id)) }); },
      }, `p${leafPath.get(id)}`) : null,
      el("span", { class: "preview" }, node.preview));
      return el("div", {}, line, details);
    };
    const subtree = (id) => {
      const column = el("div", { class: "tree-col" });
      let current = id;
      for (;;) {
        column.append(row(current));
        const kids = graph.nodes[current].children;
        if (kids.length !== 1) {
          if (kids.length > 1) column.append(el("div", { class: "branches" }, kids.map((k) => el("div", { class: "branch" }, subtree(k)))));
          return column;
        }
        current = kids[0];
      }
    };
    const roots = graph.nodes.filter((n) => n.parent === null).map((n) => n.id);
    const tree = roots.length > 1
      ? el("div", { class: "branches" }, roots.map((r) => el("div", { class: "branch" }, subtree(r))))
      : roots.length ? subtree(roots[0]) : el("div", { class: "empty-note" }, "No nodes.");
    const forkErrors = graph.forks.filter((f) => f.error).map((f) => el("div", { class: "warn-box" }, f.error));
    fill(this.body, 
      el("div", { class: "muted tree-info" }, `${graph.nodes.length} nodes · ${graph.paths.length} paths · ${graph.branch_points.length} branch point(s) · click a node for its message and calls`),
      forkErrors, el("div", { class: "tree" }, tree));
  }

  async forksTab() {
    const key = this.key;
    const graph = await this.loadGraph();
    if (this.key !== key) return;
    const paths = graph.paths;
    const check = el("div", { class: `train-once ${graph.train_once.level}` }, graph.train_once.text);
    if (paths.length < 2) {
      fill(this.body, check, el("div", { class: "empty-note" }, `This trajectory has ${paths.length} path(s): nothing to compare.`));
      return;
    }
    const clamp = (v, dflt) => Math.min(paths.length - 1, Math.max(0, Number(v ?? dflt)));
    const a = clamp(this.state.fa, 0);
    const b = clamp(this.state.fb, a === 0 ? 1 : 0);
    const pick = (name, value) => el("select", {
      class: `fork-${name}`, onchange: (e) => this.onState({ [name]: e.target.value }),
    }, paths.map((p) => el("option", { value: p.index, selected: p.index === value }, `p${p.index} · leaf n${p.leaf} · ${p.nodes.length} nodes`)));
    const na = paths[a].nodes, nb = paths[b].nodes;
    let shared = 0;
    while (shared < na.length && shared < nb.length && na[shared] === nb[shared]) shared++;
    const size = (ids) => ids.reduce((sum, id) => sum + this.nodeSize(graph.nodes[id]), 0);
    const unit = graph.nodes.some((n) => n.tokens !== null) ? "tokens" : "chars";
    const last = shared ? na[shared - 1] : null;
    const summary = el("div", { class: "fork-summary" },
      el("div", {}, last === null ? "No common node: the paths start at different roots."
        : `Last common node: n${last} (${graph.nodes[last].role ?? "unnamed"}, ${graph.nodes[last].author})`),
      el("div", { class: "muted" }, `shared ${shared} node(s), ${fmtInt(size(na.slice(0, shared)))} ${unit} · `,
        `p${a} continues ${na.length - shared} node(s), ${fmtInt(size(na.slice(shared)))} ${unit} · `,
        `p${b} continues ${nb.length - shared} node(s), ${fmtInt(size(nb.slice(shared)))} ${unit}`));
    const prefix = el("details", { class: "shared-prefix" },
      el("summary", {}, `Shared prefix: ${shared} node(s)`),
      na.slice(0, shared).map((id) => this.nodeCard(graph, id, { path: a })));
    const column = (index, ids) => el("div", { class: "fork-col" },
      el("h3", {}, `p${index}`),
      ids.length ? ids.map((id) => this.nodeCard(graph, id, { path: index })) : el("div", { class: "empty-note" }, "(ends at the common node)"));
    fill(this.body, 
      el("div", { class: "fork-bar" }, el("label", {}, "A ", pick("fa", a)), el("label", {}, "B ", pick("fb", b))),
      check, summary, prefix,
      el("div", { class: "fork-cols" }, column(a, na.slice(shared)), column(b, nb.slice(shared))));
  }

  async callsTab() {
    const key = this.key;
    if (!this.calls) this.calls = await getJSON(`${trajectoryPath(this.run, this.id)}/calls`);
    if (this.key !== key) return;
    const entries = this.calls.calls;
    const t0 = entries.length && entries[0].t !== null ? entries[0].t : null;
    const rel = (t) => (t === null || t0 === null ? "—" : `+${(t - t0).toFixed(2)}s`);
    const compact = (obj) => (obj ? Object.entries(obj).map(([k, v]) => `${k}=${typeof v === "object" ? JSON.stringify(v) : v}`).join(" ") : "—");
    const rows = entries.map((c) => (c.kind === "call"
      ? el("tr", { class: "call" },
        el("td", { class: "time" }, rel(c.t)), el("td", {}, `n${c.node}`), el("td", {}, c.model ?? "—"),
        el("td", { class: "num" }, c.duration_ms === null ? "—" : Math.round(c.duration_ms)),
        el("td", {}, c.finish_reason ?? "—"),
        bridgedCell(c),
        el("td", { class: "mono" }, compact(c.usage)), el("td", { class: "mono" }, compact(c.sampling)),
        el("td", {}, c.tool_names.length ? c.tool_names.join(", ") : c.tools ?? "—"))
      : el("tr", { class: "failure" },
        el("td", { class: "time" }, rel(c.t)), el("td", {}, c.node === null || c.node === undefined ? "—" : `n${c.node}`),
        el("td", { colspan: 2 }, `failed${c.status === null ? "" : ` · HTTP ${c.status}`}`),
        el("td", { colspan: 5, class: "mono" }, c.error))));
    fill(this.body, 
      el("div", { class: "muted" }, `${entries.filter((c) => c.kind === "call").length} call(s), ${entries.filter((c) => c.kind === "failure").length} failure(s), by time`),
      el("table", { class: "grid calls" },
        el("thead", {}, el("tr", {}, ["time", "node", "model", "ms", "finish", "bridged", "usage", "sampling", "tools"].map((h) => el("th", {}, h)))),
        el("tbody", {}, rows)));
  }

  jsonTab() {
    const d = this.detail;
    fill(this.body, 
      el("h3", {}, "Record problems"),
      d.problems.length ? el("ul", { class: "problems-list" }, d.problems.map((p) => el("li", {}, p))) : el("div", { class: "muted" }, "none"),
      el("h3", {}, "Sidecars read as absent"),
      el("div", { class: "muted" }, d.absent_sidecars.length ? d.absent_sidecars.join(", ") : "none"),
      el("h3", {}, "Document"),
      el("pre", { class: "json" }, JSON.stringify(d.document, null, 1)));
  }
}

// An open trajectory's record is a snapshot: say how it gets finished.
// What produced the record beyond the weights (format.md §4), on one line.
function provenanceNote(p) {
  if (!p || typeof p !== "object") return null;
  const tokenizer = p.tokenizer || {};
  const engine = p.engine || {};
  const short = (digest) => (typeof digest === "string" ? digest.replace("sha256:", "").slice(0, 12) : "?");
  const parts = [
    `skycap ${p.skycap || "?"}`,
    tokenizer.name ? `tokenizer ${tokenizer.name} (${short(tokenizer.digest)})` : null,
    p.chat_template_digest ? `template ${short(p.chat_template_digest)}` : null,
    p.renderer ? `renderer ${p.renderer}` : null,
    p.renderers ? `renderers ${p.renderers}` : null,
    p.transformers ? `transformers ${p.transformers}` : null,
    engine.model || engine.version ? `engine ${engine.model || "?"} (vLLM ${engine.version || "?"})` : null,
  ].filter(Boolean);
  return el("div", { class: "dr-provenance muted", title: JSON.stringify(p, null, 1) }, `provenance: ${parts.join(" · ")}`);
}

// The colour key of the weight versions, when more than one sampled this path.
function versionLegend(blocks) {
  const labels = versionLabels(blocks);
  if (labels.length < 2) return null;
  return el("span", { class: "wv-legend" }, " · weight versions ",
    labels.map((label, k) => el("span", { class: `t wv wv${k % 6}` }, label)));
}

function openNote(id, doc) {
  if (doc.status !== "open" && doc.ended !== false) return null;
  return el("div", { class: "warn-box open-note" },
    el("b", {}, doc.status === "open" ? "Still open. " : "Not ended. "),
    "Finish it on its capture server with ",
    el("code", {}, `POST /trajectories/${id}/finish`),
    " (in Python: ", el("code", {}, "await trajectory.finish({...})"),
    "). A server with a record directory ends an idle trajectory as abandoned after its ",
    el("code", {}, "--ttl"),
    "; a server that stopped wrote it as it stood, and a finish on a restarted server still completes it.");
}
