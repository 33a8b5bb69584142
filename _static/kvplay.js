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
    // One block per line (no "\n" in the text): on a phone a long line wraps under its own text, not under
    // the line numbers (kvcourse.css), and the panel keeps every character of scheduler.py readable.
    pre.replaceChildren();
    for (const fn of source.functions) {
      fn.lines.forEach((text, i) => {
        const n = fn.start + i;
        pre.append(el("span", { class: "kvplay-line", "data-line": String(n) },
          el("span", { class: "kvplay-ln", text: String(n).padStart(4) + " " }), text || " "));
      });
      pre.append(el("span", { class: "kvplay-gap", text: " " }));
    }
  }

  function block(kind, label, title) {
    return el("span", { class: `kvplay-block kvplay-${kind}`, title, text: label });
  }

  // What the form says the host tier is for: Playground gives swap mode a host pool of half the GPU pool.
  function hostNote(config, hostBlocks) {
    if (config.preemption !== "swap") {
      return "unused in recompute mode: a preempted request's blocks are freed and its tokens computed again " +
        "when it returns. Choose swap to give the pool a host tier.";
    }
    return `${hostBlocks} blocks, half the GPU pool's ${config.num_blocks} (the playground's choice): in swap mode ` +
      "a preempted request's blocks are copied here, and back before it runs again" +
      (config.prefix_caching ? "; an evicted prefix-cache block can wait here too." : ".");
  }

  function drawState(w, s) {
    // The pool, block by block.
    w.pool.replaceChildren(...s.pool.map(([kind, refs], b) => {
      const owners = s.owners[String(b)] || [];
      const who = owners.length ? ` in the table of ${owners.join(", ")}` : "";
      return block(kind, String(b), `block ${b}: ${kind}, ${refs} reference${refs === 1 ? "" : "s"}${who}`);
    }));
    w.host.replaceChildren(...s.host.map((kind, b) => block(`host-${kind}`, String(b), `host block ${b}: ${kind}`)));
    w.hostNote.textContent = hostNote(w.config, s.host.length);
    // Block tables.
    const rows = Object.entries(s.tables).map(([name, table]) => {
      const [computed, total, prompt] = s.progress[name];
      const where = s.host_tables[name] ? `host ${JSON.stringify(s.host_tables[name])}` : JSON.stringify(table);
      return el("tr", {}, el("td", { text: name }), el("td", { text: where }),
        el("td", { text: `${computed} / ${total} (prompt ${prompt})` }));
    });
    w.tables.replaceChildren(el("tr", {}, el("th", { text: "request" }), el("th", { text: "block table" }),
      el("th", { text: "computed / tokens" })), ...rows);
    // Queues.
    const q = (label, names) => el("div", {}, el("b", { text: `${label} (${names.length}): ` }), names.join(", ") || "none");
    w.queues.replaceChildren(q("running", s.running), q("waiting", s.waiting), q("swapped", s.swapped),
      q("not arrived yet", s.not_arrived));
  }

  function draw(w, index) {
    const r = w.records[index];
    w.shown = index;
    const budget = r.budget;
    // Records count steps from 0 (arrivals are "at step 0"); the reader counts them from 1.
    w.summary.textContent = (w.restarted && index === 0 ? "Restarted with the settings above. " : "") +
      `Step ${r.step + 1} of ${w.total}: ${budget.used} of ${budget.limit} tokens fed` +
      (r.arrived.length ? `; arrived: ${r.arrived.join(", ")}` : "") +
      (r.finished.length ? `; finished: ${r.finished.join(", ")}` : "") +
      (w.done && index === w.records.length - 1 ? ". Every request has finished." : ".");
    drawState(w, r);
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
    if (!r.decisions.length) w.log.append(el("li", { text: "nothing to schedule this step" }));
    // The budget of every step so far, as bars; the one shown is marked and kept in view.
    w.barsInner.replaceChildren(...w.records.map((s, i) => {
      const bar = el("button", { type: "button", class: "kvplay-bar" + (i === index ? " kvplay-current" : ""),
        title: `step ${s.step + 1}: ${s.budget.used} of ${s.budget.limit} tokens`,
        "aria-label": `step ${s.step + 1}: ${s.budget.used} of ${s.budget.limit} tokens` });
      bar.style.height = `${Math.max(2, Math.round((40 * s.budget.used) / s.budget.limit))}px`;
      bar.addEventListener("click", () => draw(w, i));
      return bar;
    }));
    const current = w.barsInner.children[index];
    w.bars.scrollLeft = Math.max(0, current.offsetLeft + current.offsetWidth / 2 - w.bars.clientWidth / 2);
  }

  function choose(w, line) {
    w.lineNodes.forEach((node) => node.classList.toggle("kvplay-chosen", Number(node.dataset.line) === line));
    const node = w.pre.querySelector(`[data-line="${line}"]`);
    if (node) w.pre.scrollTop = node.offsetTop - w.pre.offsetTop - w.pre.clientHeight / 3;
  }

  // The settings on screen differ from the ones the run was made with: the form says so, and Step (or Enter
  // in a field, or Run to the end) starts a new run with them, as the chapters tell the reader to do.
  function changed(w) {
    return w.running !== undefined && JSON.stringify(readForm(w.form)) !== w.running;
  }

  function markChanged(w) {
    const pending = changed(w);
    w.form.classList.toggle("kvplay-form-changed", pending);
    w.changedNote.hidden = !pending;
    w.stepButton.disabled = w.runButton.disabled = !w.playground || (w.done && !pending);
  }

  function reset(w) {
    // Settings the playground refuses leave the current run as it was: the error is shown beside it.
    const config = readForm(w.form);
    let next, total;
    try {
      const playground = w.rt.py.globals.get("playground");
      next = playground.new(JSON.stringify(config));
      total = playground.count_steps(JSON.stringify(config));
    } catch (err) {
      if (next) next.destroy();
      w.error.textContent = pyError(err);
      return false;
    }
    w.error.textContent = "";
    if (w.playground) w.playground.destroy();
    w.playground = next;
    w.config = config;
    w.running = JSON.stringify(config);
    w.total = total;
    w.records = [];
    w.done = false;
    w.restarted = w.started === true;
    w.started = true;
    [w.summary, w.log, w.barsInner].forEach((n) => n.replaceChildren());
    drawState(w, JSON.parse(next.state_json()));
    w.lineNodes.forEach((node) => node.classList.remove("kvplay-ran", "kvplay-chosen"));
    const requests = config.num_requests * config.samples;
    w.summary.textContent = (w.restarted ? "Restarted with the settings above. " : "") +
      `Ready: ${total} steps serve these ${config.num_requests} requests` +
      (config.samples > 1 ? ` (${requests} sequences with their samples)` : "") +
      ". Press Step to run step 1, the first call of schedule().";
    w.log.append(el("li", { class: "kvplay-empty", text: "Nothing yet: each Step runs schedule() once, and " +
      "what it decided appears here, each decision linked to the line of scheduler.py that made it." }));
    w.caption.textContent = "Tokens fed per step: each bar is one step, as tall as the tokens it fed out of " +
      `the budget of ${config.token_budget}; the dark bar is the step shown above. Click a bar to show that step.`;
    markChanged(w);
    return true;
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
    markChanged(w);
    return true;
  }

  // Step, Enter and Run to the end first apply settings changed on screen (a new run); false if refused.
  function applyChanges(w) {
    return !changed(w) || reset(w);
  }

  function costText(cost) {
    if (!cost) return "";
    const mb = (n) => (n / 1e6).toFixed(1);
    let text = `Opening it downloads ${mb(cost.bytes)} MB once per visit (${mb(cost.wasm_bytes)} MB of it the ` +
      "Python interpreter in WebAssembly; the sizes of this build's files, sent uncompressed: " +
      `${mb(cost.gzip_bytes)} MB where the host gzips every file).`;
    const m = cost.measured;
    if (m) {
      text += ` Measured: the first step was ready ${m.ready_after_click_s.toFixed(1)} s after the click on a ` +
        `${m.throttle.download_mbit_s} Mbit/s connection with ${m.throttle.latency_ms} ms latency (headless ` +
        `Chromium throttled through its DevTools protocol, ${m.machine}, ${m.date}).`;
    }
    return text;
  }

  function mount(root) {
    const preset = root.dataset.preset || "06";
    let cost = null;
    try {
      cost = root.dataset.cost ? JSON.parse(root.dataset.cost) : null;
    } catch (err) {
      cost = null; // a page without the build's numbers still opens the playground
    }
    const status = el("span", { class: "kvplay-status", text: costText(cost) });
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
      w.changedNote = el("p", { class: "kvplay-changed", role: "status",
        text: "Changed: Step (or Enter) restarts the run with these settings; what is drawn below is still the " +
          "run with the previous ones." });
      w.changedNote.hidden = true;
      w.form.addEventListener("input", () => markChanged(w));
      w.form.addEventListener("change", () => markChanged(w));
      w.form.addEventListener("submit", (e) => e.preventDefault());
      w.form.addEventListener("keydown", (e) => {
        // A form of several number fields has no implicit submission: Enter in one of them steps here.
        if (e.key === "Enter" && e.target.tagName === "INPUT") {
          e.preventDefault();
          if (applyChanges(w)) step(w);
        }
      });
      w.error = el("div", { class: "kvplay-error", role: "alert" });
      w.stepButton = el("button", { type: "button", class: "kvplay-step", text: "Step" });
      w.runButton = el("button", { type: "button", class: "kvplay-run", text: "Run to the end" });
      const resetButton = el("button", { type: "button", class: "kvplay-reset", text: "Start over" });
      w.stepButton.disabled = w.runButton.disabled = true; // until a playground is made
      w.summary = el("p", { class: "kvplay-summary", "aria-live": "polite" });
      w.barsInner = el("div", { class: "kvplay-bars-inner" });
      w.bars = el("div", { class: "kvplay-bars" }, w.barsInner);
      w.caption = el("p", { class: "kvplay-caption" });
      w.pool = el("div", { class: "kvplay-pool" });
      w.host = el("div", { class: "kvplay-pool" });
      w.hostNote = el("span", { class: "kvplay-host-note" });
      w.hostRow = el("div", { class: "kvplay-host" }, el("b", { text: "Host tier: " }), w.hostNote, w.host);
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
      w.stepButton.addEventListener("click", () => {
        if (applyChanges(w)) step(w);
      });
      w.runButton.addEventListener("click", () => {
        if (!applyChanges(w)) return;
        let guard = 0;
        while (!w.done && guard++ < 5000 && step(w));
      });
      root.append(w.form, w.changedNote, el("div", { class: "kvplay-buttons" }, w.stepButton, w.runButton, resetButton),
        w.error, w.summary, w.bars, w.caption, el("b", { text: "GPU pool" }), w.pool, legend, w.hostRow, w.queues,
        w.tables, el("b", { text: "What schedule() decided" }), w.log,
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
