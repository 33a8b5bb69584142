/* kvcourse playground: the real scheduler and block manager, stepped in the reader's browser (issue 32).
 *
 * A chapter page holds <div class="kvplay" data-preset="06"></div>. Nothing is loaded until the reader
 * clicks "Open the playground": then Pyodide (CPython in WebAssembly, served with the site under
 * _static/playground/pyodide, from the npm registry at build time) starts, the package's torch-free wheel
 * (_static/playground/*.whl) is unpacked into it, and kvcourse.control.playground drives
 * kvcourse.serving.Scheduler, the code chapter 6's engine runs. Every step is drawn from what that step
 * returned: the pool block by block, each request's block table, the queues, the token budget, and the
 * decisions, each linked to the line of scheduler.py that made it. Nothing is fetched from outside the site.
 * tests/test_browser.py replays a scripted session against CPython.
 */
(function () {
  "use strict";
  const here = document.currentScript ? document.currentScript.src : document.baseURI;
  const BASE = new URL("playground/", here).href;
  let runtime = null; // one Pyodide per page, shared by its widgets

  const FIELDS = [
    ["block_size", "Block size (tokens)", "select", [1, 2, 4, 8, 16]],
    ["num_blocks", "Pool (blocks)", "number", [1, 256]],
    ["num_requests", "Requests", "number", [1, 32]],
    ["arrival", "Arrivals", "select", ["burst", "steady", "shared prompt"]],
    ["token_budget", "Token budget per step (the prefill chunk)", "number", [1, 4096]],
    ["max_num_seqs", "Most running (max_num_seqs)", "number", [1, 64]],
    ["chunked_prefill", "Chunked prefill", "checkbox"],
    ["preemption", "Preemption", "select", ["recompute", "swap"]],
    ["prefix_caching", "Prefix caching", "checkbox"],
    ["samples", "Samples per request (n)", "select", [1, 2, 3, 4]],
    ["seed", "Seed", "number", [0, 1000000]],
  ];

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "class") node.className = v;
      else if (k === "text") node.textContent = v;
      else node.setAttribute(k, v);
    }
    children.forEach((c) => node.append(c));
    return node;
  }

  async function loadRuntime(status) {
    if (runtime) return runtime;
    runtime = (async () => {
      const started = performance.now();
      const manifest = await (await fetch(BASE + "manifest.json")).json();
      const mb = (manifest.bytes / 1e6).toFixed(1);
      status(`Loading Python (Pyodide ${manifest.pyodide}, ${mb} MB, once per visit) ...`);
      const { loadPyodide } = await import(BASE + "pyodide/pyodide.mjs");
      const py = await loadPyodide({ indexURL: BASE + "pyodide/" });
      status("Installing kvcourse's control plane ...");
      const wheel = await (await fetch(BASE + manifest.wheel)).arrayBuffer();
      py.unpackArchive(wheel, "wheel");
      py.runPython("import json\nfrom kvcourse.control import playground");
      const presets = JSON.parse(py.runPython(
        "json.dumps({k: __import__('dataclasses').asdict(v) for k, v in playground.PRESETS.items()})"));
      const source = JSON.parse(py.runPython("json.dumps(playground.scheduler_source())"));
      return { py, presets, source, manifest, loadMs: performance.now() - started };
    })();
    try {
      return await runtime;
    } catch (err) {
      runtime = null;
      throw err;
    }
  }

  function pyError(err) {
    const text = String(err && err.message ? err.message : err).trim().split("\n");
    return text[text.length - 1];
  }

  function buildForm(form, values) {
    form.replaceChildren();
    for (const [name, label, kind, options] of FIELDS) {
      let input;
      if (kind === "select") {
        input = el("select", { name });
        options.forEach((o) => input.append(el("option", { value: String(o), text: String(o) })));
        input.value = String(values[name]);
      } else if (kind === "checkbox") {
        input = el("input", { name, type: "checkbox" });
        input.checked = Boolean(values[name]);
      } else {
        input = el("input", { name, type: "number", min: options[0], max: options[1], step: 1 });
        input.value = String(values[name]);
      }
      form.append(el("label", {}, el("span", { text: label }), input));
    }
  }

  function readForm(form) {
    const config = {};
    for (const [name, , kind, options] of FIELDS) {
      const input = form.elements[name];
      if (kind === "checkbox") config[name] = input.checked;
      else if (kind === "select" && typeof options[0] === "string") config[name] = input.value;
      else config[name] = input.value === "" ? null : Number(input.value);
    }
    return config;
  }

  function drawSource(pre, source) {
    pre.replaceChildren();
    for (const fn of source.functions) {
      fn.lines.forEach((text, i) => {
        const n = fn.start + i;
        pre.append(el("span", { class: "kvplay-line", "data-line": String(n) },
          el("span", { class: "kvplay-ln", text: String(n).padStart(4) + " " }), text + "\n"));
      });
      pre.append("\n");
    }
  }

  function block(kind, label, title) {
    return el("span", { class: `kvplay-block kvplay-${kind}`, title, text: label });
  }

  function draw(w, index) {
    const r = w.records[index];
    w.shown = index;
    const budget = r.budget;
    w.summary.textContent = `Step ${r.step}: ${budget.used} of ${budget.limit} tokens fed` +
      (r.arrived.length ? `; arrived: ${r.arrived.join(", ")}` : "") +
      (r.finished.length ? `; finished: ${r.finished.join(", ")}` : "") +
      (w.done && index === w.records.length - 1 ? ". Every request has finished." : ".");
    // The pool, block by block.
    w.pool.replaceChildren(...r.pool.map(([kind, refs], b) => {
      const owners = r.owners[String(b)] || [];
      const who = owners.length ? ` in the table of ${owners.join(", ")}` : "";
      return block(kind, String(b), `block ${b}: ${kind}, ${refs} reference${refs === 1 ? "" : "s"}${who}`);
    }));
    w.host.replaceChildren(...r.host.map((kind, b) => block(`host-${kind}`, String(b), `host block ${b}: ${kind}`)));
    w.hostRow.hidden = r.host.length === 0;
    // Block tables.
    const rows = Object.entries(r.tables).map(([name, table]) => {
      const [computed, total, prompt] = r.progress[name];
      const where = r.host_tables[name] ? `host ${JSON.stringify(r.host_tables[name])}` : JSON.stringify(table);
      return el("tr", {}, el("td", { text: name }), el("td", { text: where }),
        el("td", { text: `${computed} / ${total} (prompt ${prompt})` }));
    });
    w.tables.replaceChildren(el("tr", {}, el("th", { text: "request" }), el("th", { text: "block table" }),
      el("th", { text: "computed / tokens" })), ...rows);
    // Queues.
    const q = (label, names) => el("div", {}, el("b", { text: `${label} (${names.length}): ` }), names.join(", ") || "none");
    w.queues.replaceChildren(q("running", r.running), q("waiting", r.waiting), q("swapped", r.swapped),
      q("not arrived yet", r.not_arrived));
    // Decisions, each linked to its line; and the lines this step ran.
    const ran = new Set(r.lines);
    w.lineNodes.forEach((node) => {
      node.classList.toggle("kvplay-ran", ran.has(Number(node.dataset.line)));
      node.classList.remove("kvplay-chosen");
    });
    w.log.replaceChildren(...r.decisions.map((d) => {
      const item = el("li", { text: d.text });
      if (d.line !== null) {
        item.dataset.line = String(d.line);
        const link = el("button", { type: "button", class: "kvplay-link", text: `line ${d.line}` });
        link.addEventListener("click", () => choose(w, d.line));
        item.append(" ", link);
      }
      return item;
    }));
    // The budget of every step so far, as bars; the one shown is marked.
    w.bars.replaceChildren(...w.records.map((s, i) => {
      const bar = el("button", { type: "button", class: "kvplay-bar" + (i === index ? " kvplay-current" : ""),
        title: `step ${s.step}: ${s.budget.used} of ${s.budget.limit} tokens` });
      bar.style.height = `${Math.max(2, Math.round((40 * s.budget.used) / s.budget.limit))}px`;
      bar.addEventListener("click", () => draw(w, i));
      return bar;
    }));
  }

  function choose(w, line) {
    w.lineNodes.forEach((node) => node.classList.toggle("kvplay-chosen", Number(node.dataset.line) === line));
    const node = w.pre.querySelector(`[data-line="${line}"]`);
    if (node) w.pre.scrollTop = node.offsetTop - w.pre.offsetTop - w.pre.clientHeight / 3;
  }

  function reset(w) {
    // Settings the playground refuses leave the current run as it was: the error is shown beside it.
    let next;
    try {
      next = w.rt.py.globals.get("playground").new(JSON.stringify(readForm(w.form)));
    } catch (err) {
      w.error.textContent = pyError(err);
      return;
    }
    w.error.textContent = "";
    if (w.playground) w.playground.destroy();
    w.playground = next;
    w.records = [];
    w.done = false;
    [w.summary, w.pool, w.host, w.tables, w.queues, w.log, w.bars].forEach((n) => n.replaceChildren());
    w.summary.textContent = "Ready: press Step.";
    w.stepButton.disabled = w.runButton.disabled = false;
  }

  function step(w) {
    if (!w.playground || w.done) return false;
    try {
      w.records.push(JSON.parse(w.playground.step_json()));
      w.done = w.playground.done;
    } catch (err) {
      w.error.textContent = pyError(err);
      return false;
    }
    draw(w, w.records.length - 1);
    w.stepButton.disabled = w.runButton.disabled = w.done;
    return true;
  }

  function mount(root) {
    const preset = root.dataset.preset || "06";
    const status = el("span", { class: "kvplay-status" });
    const open = el("button", { type: "button", class: "kvplay-open", text: "Open the playground" });
    root.replaceChildren(el("div", { class: "kvplay-head" }, open, status));
    const w = { root, records: [], readyMs: null };
    root.kvplay = w;
    open.addEventListener("click", async () => {
      open.disabled = true;
      const clicked = performance.now();
      let rt;
      try {
        rt = await loadRuntime((text) => (status.textContent = text));
      } catch (err) {
        status.textContent = "The playground could not start: " + pyError(err) +
          " (this copy of the book may have been built without Pyodide; the chapter's notebook runs the same code).";
        open.disabled = false;
        return;
      }
      w.rt = rt;
      w.form = el("form", { class: "kvplay-form" });
      buildForm(w.form, rt.presets[preset] || rt.presets["06"]);
      w.form.addEventListener("submit", (e) => e.preventDefault());
      w.error = el("div", { class: "kvplay-error", role: "alert" });
      w.stepButton = el("button", { type: "button", class: "kvplay-step", text: "Step" });
      w.runButton = el("button", { type: "button", class: "kvplay-run", text: "Run to the end" });
      const resetButton = el("button", { type: "button", class: "kvplay-reset", text: "Reset with these settings" });
      w.stepButton.disabled = w.runButton.disabled = true; // until a playground is made
      w.summary = el("p", { class: "kvplay-summary" });
      w.bars = el("div", { class: "kvplay-bars", title: "tokens fed by each step (click one to see it)" });
      w.pool = el("div", { class: "kvplay-pool" });
      w.host = el("div", { class: "kvplay-pool" });
      w.hostRow = el("div", {}, el("b", { text: "Host tier" }), w.host);
      w.tables = el("table", { class: "kvplay-tables" });
      w.queues = el("div", { class: "kvplay-queues" });
      w.log = el("ol", { class: "kvplay-log" });
      w.pre = el("pre", { class: "kvplay-source" });
      drawSource(w.pre, rt.source);
      w.lineNodes = Array.from(w.pre.querySelectorAll(".kvplay-line"));
      const legend = el("p", { class: "kvplay-legend" }, ...[["free", "free"], ["used", "used (one table)"],
        ["shared", "shared (two or more tables: copy-on-write)"], ["cached", "cached, evictable (prefix cache)"],
        ["host-swapped", "host: a swapped request's"], ["host-cold", "host: an evicted cached block"]].map(
        ([k, label]) => el("span", { class: "kvplay-key" }, block(k, "", label), ` ${label}`)));
      resetButton.addEventListener("click", () => reset(w));
      w.stepButton.addEventListener("click", () => step(w));
      w.runButton.addEventListener("click", () => {
        let guard = 0;
        while (!w.done && guard++ < 5000 && step(w));
      });
      root.append(w.form, el("div", { class: "kvplay-buttons" }, resetButton, w.stepButton, w.runButton), w.error,
        w.summary, w.bars, el("b", { text: "GPU pool" }), w.pool, legend, w.hostRow, w.queues, w.tables,
        el("b", { text: "What schedule() decided" }), w.log,
        el("b", { text: `${rt.source.file}: the lines this step ran are shaded` }), w.pre);
      reset(w);
      w.readyMs = performance.now() - clicked;
      status.textContent = `Python ${rt.py.version ? "(Pyodide " + rt.py.version + ")" : ""} ready in ` +
        `${(w.readyMs / 1000).toFixed(1)} s.`;
      root.dataset.ready = "1";
    });
  }

  function setup() {
    document.querySelectorAll("div.kvplay").forEach(mount);
  }
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", setup);
  else setup();
})();
