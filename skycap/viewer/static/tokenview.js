// A virtualized view of one path: its blocks laid out into fixed-height lines, of which only
// the lines on screen are in the DOM. Each token is one span; hovering it shows its id,
// logprob and text. Without tokens (text-only fallback or text mode) blocks show message text.
// When more than one weight version sampled the path, sampled tokens are coloured by version.

import { esc } from "./util.js";

const LINE_HEIGHT = 20;
const OVERSCAN = 20;
const GUTTER_CHARS = 16;

function visible(text) {
  if (text === "") return "·";
  return text.replace(/\n/g, "↵").replace(/\t/g, "⇥").replace(/\r/g, "␍");
}

const VERSION_COLOURS = 6;

// The weight versions that sampled a path's blocks, in order of first appearance.
export function versionLabels(blocks) {
  const labels = [];
  for (const block of blocks) {
    for (const [label] of block.versions || []) if (!labels.includes(label)) labels.push(label);
  }
  return labels;
}

function versionAt(block, i) {
  const span = (block.versions || []).find(([, start, end]) => start <= i && i < end);
  return span ? span[0] : null;
}

export class TokenView {
  constructor(container, tooltip) {
    this.container = container;
    this.tooltip = tooltip;
    this.ribbon = false;
    this.payload = null;
    this.labels = [];
    this.scroller = document.createElement("div");
    this.scroller.className = "tv";
    this.spacer = document.createElement("div");
    this.spacer.className = "tv-spacer";
    this.window = document.createElement("div");
    this.window.className = "tv-window";
    this.spacer.append(this.window);
    this.scroller.append(this.spacer);
    container.replaceChildren(this.scroller);
    this.scroller.addEventListener("scroll", () => this.schedule());
    this.window.addEventListener("mouseover", (e) => this.hover(e));
    this.window.addEventListener("mousemove", (e) => this.place(e));
    this.window.addEventListener("mouseleave", () => this.hideTip());
    this.resize = new ResizeObserver(() => this.relayout());
    this.resize.observe(this.scroller);
    this.rendered = [-1, -1];
    this.lines = new Map();
  }

  destroy() {
    this.resize.disconnect();
    this.hideTip();
  }

  // payload: the /paths/{i} answer; labels[b] is the gutter text of block b.
  setData(payload, labels) {
    this.payload = payload;
    this.labels = labels;
    this.versions = versionLabels(payload.blocks);
    this.scroller.scrollTop = 0;
    this.cols = 0;
    this.relayout();
  }

  setRibbon(on) {
    this.ribbon = on;
    this.clear();
    this.render();
  }

  charWidth() {
    const probe = document.createElement("span");
    probe.className = "tv-probe";
    probe.textContent = "x".repeat(100);
    this.window.append(probe);
    const width = probe.getBoundingClientRect().width / 100 || 8;
    probe.remove();
    return width;
  }

  relayout() {
    if (!this.payload) return;
    const width = this.scroller.clientWidth || 800;
    const cols = Math.max(20, Math.floor(width / this.charWidth()) - GUTTER_CHARS - 3);
    if (cols === this.cols) return;
    this.cols = cols;
    if (this.payload.token_data) this.layoutTokens();
    else this.layoutChars();
    this.spacer.style.height = `${this.lineBlock.length * LINE_HEIGHT}px`;
    this.clear();
    this.render();
  }

  tokenText(i) {
    const { offsets, text, count } = this.payload.token_data;
    return text.slice(offsets[i], i + 1 < count ? offsets[i + 1] : text.length);
  }

  layoutTokens() {
    const blocks = this.payload.blocks;
    const lineBlock = [], lineFirst = [], lineEnd = [];
    const cols = this.cols;
    blocks.forEach((block, b) => {
      let first = block.start, col = 0;
      const close = (end) => {
        lineBlock.push(b); lineFirst.push(first); lineEnd.push(end);
        first = end; col = 0;
      };
      for (let i = block.start; i < block.end; i++) {
        const raw = this.tokenText(i);
        const width = Math.max(1, raw.length);
        if (col > 0 && col + width > cols) close(i);
        col += width;
        if (raw.includes("\n")) close(i + 1);
      }
      if (first < block.end || block.start === block.end) close(block.end);
    });
    this.lineBlock = Int32Array.from(lineBlock);
    this.lineFirst = Int32Array.from(lineFirst);
    this.lineEnd = Int32Array.from(lineEnd);
  }

  layoutChars() {
    const lineBlock = [], lineFirst = [], lineEnd = [];
    const cols = this.cols;
    this.payload.blocks.forEach((block, b) => {
      const text = block.text || "";
      let start = 0;
      if (!text.length) {
        lineBlock.push(b); lineFirst.push(0); lineEnd.push(0);
      }
      while (start < text.length) {
        let newline = text.indexOf("\n", start);
        if (newline === -1) newline = text.length;
        const end = Math.min(newline, start + cols);
        lineBlock.push(b); lineFirst.push(start); lineEnd.push(end);
        start = end === newline ? end + 1 : end;
      }
    });
    this.lineBlock = Int32Array.from(lineBlock);
    this.lineFirst = Int32Array.from(lineFirst);
    this.lineEnd = Int32Array.from(lineEnd);
  }

  schedule() {
    if (this.pending) return;
    this.pending = requestAnimationFrame(() => {
      this.pending = null;
      this.render();
    });
  }

  // Lines [top, bottom) around the viewport are in the DOM, each absolutely placed; a scroll
  // removes the lines that left the range and adds only the ones that entered it.
  render() {
    if (!this.lineBlock) return;
    const lines = this.lineBlock.length;
    const first = Math.floor(this.scroller.scrollTop / LINE_HEIGHT);
    const shown = Math.ceil((this.scroller.clientHeight || 600) / LINE_HEIGHT);
    const top = Math.max(0, first - OVERSCAN);
    const bottom = Math.min(lines, first + shown + OVERSCAN);
    if (this.rendered[0] === top && this.rendered[1] === bottom) return;
    this.rendered = [top, bottom];
    for (const [line, node] of this.lines) {
      if (line < top || line >= bottom) {
        node.remove();
        this.lines.delete(line);
      }
    }
    const added = [];
    const html = [];
    for (let line = top; line < bottom; line++) {
      if (this.lines.has(line)) continue;
      added.push(line);
      html.push(this.lineHtml(line));
    }
    if (!added.length) return;
    const template = document.createElement("template");
    template.innerHTML = html.join("");
    [...template.content.children].forEach((node, i) => this.lines.set(added[i], node));
    this.window.append(template.content);
  }

  clear() {
    this.window.replaceChildren();
    this.lines.clear();
    this.rendered = [-1, -1];
  }

  lineHtml(line) {
    const b = this.lineBlock[line];
    const block = this.payload.blocks[b];
    const firstOfBlock = line === 0 || this.lineBlock[line - 1] !== b;
    const label = firstOfBlock ? esc(this.labels[b] || block.kind) : "";
    const cls = `ln k-${block.kind}${firstOfBlock ? " ln-first" : ""}`;
    let body;
    if (this.payload.token_data) {
      const parts = [];
      const { ids, logprobs } = this.payload.token_data;
      for (let i = this.lineFirst[line]; i < this.lineEnd[line]; i++) {
        const raw = this.tokenText(i);
        const special = /^<\|.*\|>$|^<\/?[a-z_]+>$/.test(raw);
        let style = "";
        if (this.ribbon && logprobs[i] !== null && block.kind === "sampled") {
          const p = Math.exp(logprobs[i]);
          style = ` style="background:hsl(${Math.round(p * 120)} 70% 50% / 0.35)"`;
        }
        const version = this.versions.length > 1 && !this.ribbon ? versionAt(block, i) : null;
        const colour = version === null ? "" : ` wv wv${this.versions.indexOf(version) % VERSION_COLOURS}`;
        const extra = (raw === "" ? " empty" : special ? " special" : "") + colour;
        parts.push(`<span class="t${extra}" data-i="${i}" data-id="${ids[i]}"${style}>${esc(visible(raw))}</span>`);
      }
      body = parts.join("");
      if (block.start === block.end) body = '<span class="note">(no tokens)</span>';
    } else {
      const text = (block.text || "").slice(this.lineFirst[line], this.lineEnd[line]);
      body = esc(text) || (block.text ? "" : '<span class="note">(no text)</span>');
    }
    return `<div class="${cls}" style="top:${line * LINE_HEIGHT}px;height:${LINE_HEIGHT}px"><span class="gut" title="${label}">${label}</span><span class="tx">${body}</span></div>`;
  }

  // Scroll so that token (or, text-only, block) `index` is at the top.
  scrollToToken(index) {
    if (!this.lineFirst) return;
    let line = 0;
    if (this.payload.token_data) {
      let lo = 0, hi = this.lineFirst.length - 1;
      while (lo < hi) {
        const mid = (lo + hi + 1) >> 1;
        if (this.lineFirst[mid] <= index) lo = mid;
        else hi = mid - 1;
      }
      line = lo;
    } else {
      const block = this.payload.blocks.findIndex((b) => b.end > index);
      line = Math.max(0, this.lineBlock.indexOf(block === -1 ? this.payload.blocks.length - 1 : block));
    }
    this.scroller.scrollTop = line * LINE_HEIGHT;
  }

  hover(event) {
    const span = event.target.closest(".t");
    if (!span || !this.payload.token_data) {
      this.hideTip();
      return;
    }
    const i = Number(span.dataset.i);
    const { ids, logprobs } = this.payload.token_data;
    const lp = logprobs[i];
    const block = this.payload.blocks.find((b) => b.start <= i && i < b.end);
    const prob = lp === null ? "" : ` (p ${Math.exp(lp).toFixed(3)})`;
    this.tooltip.innerHTML =
      `<div class="tt-head">token ${i.toLocaleString("en-US")} · ${esc(block ? `${block.kind} · n${block.node}` : "")}</div>` +
      `<div>id <b class="tt-id">${ids[i]}</b></div>` +
      `<div>logprob <b class="tt-logprob">${lp === null ? "none" : lp.toFixed(4)}</b>${prob}</div>` +
      (block && versionAt(block, i) !== null ? `<div>weight version <b class="tt-version">${esc(versionAt(block, i))}</b></div>` : "") +
      `<div>text <code class="tt-text">${esc(JSON.stringify(this.tokenText(i)))}</code></div>`;
    this.tooltip.hidden = false;
    this.place(event);
  }

  place(event) {
    if (this.tooltip.hidden) return;
    const x = Math.min(event.clientX + 14, window.innerWidth - this.tooltip.offsetWidth - 8);
    const y = event.clientY + 18 + this.tooltip.offsetHeight > window.innerHeight
      ? event.clientY - this.tooltip.offsetHeight - 10 : event.clientY + 18;
    this.tooltip.style.left = `${x}px`;
    this.tooltip.style.top = `${y}px`;
  }

  hideTip() {
    this.tooltip.hidden = true;
  }
}
