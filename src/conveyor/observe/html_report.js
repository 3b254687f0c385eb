// Draws the run report (observe/html_report.py) from the JSON in #report-data: charts as SVG,
// tables and samples as HTML. Every text from the run goes in through textContent, never as
// markup. It knows the shape of collect()'s data and nothing else; when everything is drawn it
// sets data-rendered="1" on <body> (the page's tests wait for that mark).
"use strict";
(function () {
  const D = JSON.parse(document.getElementById("report-data").textContent);
  const SVGNS = "http://www.w3.org/2000/svg";
  const COLORS = ["#4269d0", "#efb118", "#ff725c", "#6cc5b0", "#3ca951", "#ff8ab7", "#a463f2", "#97bbf5",
    "#9c6b4e", "#9498a0", "#b07aa1", "#d95f02"];

  function el(tag, attrs, text) {
    const e = document.createElement(tag);
    for (const k in attrs || {}) e.setAttribute(k, attrs[k]);
    if (text !== undefined && text !== null) e.textContent = String(text);
    return e;
  }
  function svg(tag, attrs, text) {
    const e = document.createElementNS(SVGNS, tag);
    for (const k in attrs || {}) e.setAttribute(k, attrs[k]);
    if (text !== undefined && text !== null) e.textContent = String(text);
    return e;
  }
  function add(parent, child) { parent.appendChild(child); return child; }
  function note(parent, text) { add(parent, el("p", { class: "note" }, text)); }
  function fmt(v) {
    if (v === null || v === undefined || Number.isNaN(v)) return "-";
    if (typeof v !== "number") return String(v);
    const a = Math.abs(v);
    if (Number.isInteger(v) || a >= 1000) return v.toFixed(0);
    if (a >= 10) return v.toFixed(1);
    if (a >= 0.001) return v.toFixed(3);
    return v.toExponential(1);
  }
  // A tick's label shows as many decimals as the tick step needs (0, 0.5, 1 rather than 0.000, 0.500).
  function tickFmt(t, step) {
    const decimals = Math.max(0, Math.min(6, -Math.floor(Math.log10(step) + 1e-9)));
    return Math.abs(t) >= 1e5 ? t.toExponential(1) : t.toFixed(decimals);
  }
  function seconds(s) {
    if (s === 0) return "0";
    return s >= 100 ? s.toFixed(0) + " s" : s >= 1 ? s.toFixed(2) + " s" : (s * 1e3).toFixed(1) + " ms";
  }
  // Round tick values between lo and hi, about n of them; each carries its label.
  function ticks(lo, hi, n, integers) {
    const span = hi - lo || Math.abs(hi) || 1;
    const raw = span / n, mag = Math.pow(10, Math.floor(Math.log10(raw)));
    let step = [1, 2, 5, 10].map(m => m * mag).find(s => span / s <= n) || 10 * mag;
    if (integers) step = Math.max(1, Math.round(step));
    const out = [];
    for (let i = Math.ceil(lo / step - 1e-9); i * step <= hi + step * 1e-9; i++) {
      out.push({ v: i * step, label: tickFmt(i * step, step), step: step });
    }
    return out;
  }
  function legend(parent, items) {
    const box = add(parent, el("div", { class: "legend" }));
    for (const [name, color] of items) {
      const item = add(box, el("span"));
      add(item, el("i", { style: "background:" + color }));
      item.appendChild(document.createTextNode(name));
    }
  }
  function card(parent, title) {
    const c = add(parent, el("div", { class: "chart" }));
    add(c, el("h3", {}, title));
    return c;
  }

  // series: [{name, x, y, color, dots, dash}]; opts: yMin, yMax, xLabel
  function lineChart(parent, title, series, opts) {
    opts = opts || {};
    const c = card(parent, title);
    const pts = series.flatMap(s => s.x.map((x, i) => [x, s.y[i]])).filter(p => p[1] !== null && p[1] !== undefined);
    if (!pts.length) { note(c, "nothing logged"); return; }
    const W = 560, H = 240, L = 52, R = 12, T = 10, B = 34;
    let x0 = Math.min(...pts.map(p => p[0])), x1 = Math.max(...pts.map(p => p[0]));
    let y0 = opts.yMin !== undefined ? opts.yMin : Math.min(...pts.map(p => p[1]));
    let y1 = opts.yMax !== undefined ? opts.yMax : Math.max(...pts.map(p => p[1]));
    if (x1 === x0) { x0 -= 1; x1 += 1; }
    if (y1 === y0) { y0 -= Math.abs(y0) * 0.1 || 1; y1 += Math.abs(y1) * 0.1 || 1; }
    const X = x => L + (x - x0) / (x1 - x0) * (W - L - R), Y = y => T + (1 - (y - y0) / (y1 - y0)) * (H - T - B);
    const s = add(c, svg("svg", { viewBox: `0 0 ${W} ${H}`, width: "100%", role: "img" }));
    for (const t of ticks(y0, y1, 5)) {
      add(s, svg("line", { x1: L, x2: W - R, y1: Y(t.v), y2: Y(t.v), stroke: "#eceef2" }));
      add(s, svg("text", { x: L - 6, y: Y(t.v) + 4, "text-anchor": "end" }, t.label));
    }
    for (const t of ticks(x0, x1, 8, true)) {
      add(s, svg("text", { x: X(t.v), y: H - B + 16, "text-anchor": "middle" }, t.label));
    }
    add(s, svg("text", { x: (L + W - R) / 2, y: H - 4, "text-anchor": "middle" }, opts.xLabel || "step"));
    add(s, svg("line", { x1: L, x2: W - R, y1: H - B, y2: H - B, stroke: "#999" }));
    for (const ser of series) {
      let d = "", pen = "M";
      ser.x.forEach((x, i) => {
        const y = ser.y[i];
        if (y === null || y === undefined) { pen = "M"; return; }
        d += `${pen}${X(x).toFixed(1)},${Y(y).toFixed(1)}`;
        pen = "L";
      });
      if (!ser.dotsOnly && d) add(s, svg("path", { d: d, fill: "none", stroke: ser.color, "stroke-width": 1.6,
        "stroke-dasharray": ser.dash || "" }));
      if (ser.dots || ser.dotsOnly) {
        ser.x.forEach((x, i) => {
          const y = ser.y[i];
          if (y === null || y === undefined) return;
          const dot = add(s, svg("circle", { cx: X(x), cy: Y(y), r: 3.2, fill: ser.color }));
          add(dot, svg("title", {}, `${ser.name} at step ${x}: ${fmt(y)}`));
        });
      }
    }
    legend(c, series.map(ser => [ser.name, ser.color]));
  }

  function barChart(parent, title, labels, values, color, xLabel) {
    const c = card(parent, title);
    const W = 560, H = 220, L = 52, R = 12, T = 10, B = 34;
    const top = Math.max(...values, 1e-9) * 1.12, bw = Math.min((W - L - R) / labels.length, 90);  // room for labels
    const Y = v => T + (1 - v / top) * (H - T - B);
    const s = add(c, svg("svg", { viewBox: `0 0 ${W} ${H}`, width: "100%", role: "img" }));
    for (const t of ticks(0, top, 4)) {
      add(s, svg("line", { x1: L, x2: W - R, y1: Y(t.v), y2: Y(t.v), stroke: "#eceef2" }));
      add(s, svg("text", { x: L - 6, y: Y(t.v) + 4, "text-anchor": "end" }, t.label));
    }
    labels.forEach((lab, i) => {
      const x = L + i * bw + bw * 0.15, bar = add(s, svg("rect", { x: x, y: Y(values[i]), width: bw * 0.7,
        height: Math.max(Y(0) - Y(values[i]), 0), fill: color }));
      add(bar, svg("title", {}, `${lab}: ${(100 * values[i]).toFixed(1)}%`));
      add(s, svg("text", { x: x + bw * 0.35, y: H - B + 16, "text-anchor": "middle" }, lab));
      const share = (100 * values[i]).toFixed(1) + "%";
      add(s, svg("text", { x: x + bw * 0.35, y: Y(values[i]) - 4, "text-anchor": "middle" }, share));
    });
    add(s, svg("text", { x: (L + W - R) / 2, y: H - 4, "text-anchor": "middle" }, xLabel));
  }

  function table(parent, header, rows) {
    const t = add(parent, el("table"));
    const hr = add(add(t, el("thead")), el("tr"));
    for (const h of header) add(hr, el("th", {}, h));
    const body = add(t, el("tbody"));
    for (const row of rows) {
      const tr = add(body, el("tr"));
      for (const v of row) add(tr, el("td", {}, typeof v === "number" ? fmt(v) : v));
    }
    return t;
  }

  function overview() {
    const sec = document.getElementById("overview");
    document.getElementById("title").textContent = "conveyor report: " + D.run;
    document.getElementById("subtitle").textContent = D.path;
    document.title = "conveyor report: " + D.run;
    const row = add(sec, el("div", { class: "row" }));
    if (D.heldout.length) {
      const c = card(row, "held-out");
      const cols = [["initial", "initial"], ["warm-start", "warmstart"], ["after RL", "final"]]
        .filter(([, k]) => D.heldout.some(r => r[k] !== null && r[k] !== undefined));
      table(c, ["", ...cols.map(([n]) => n)], D.heldout.map(r => [r.label, ...cols.map(([, k]) => r[k])]));
    } else note(row, D.notes.summary || D.notes.eval || "no held-out numbers");
    if (D.totals.length || D.config.length) {
      const c = card(row, "the run");
      table(c, ["", ""], D.totals.concat(D.config));
    }
    if (D.notes.metrics) note(sec, D.notes.metrics);
  }

  function line(name, x, y, color, extra) { return Object.assign({ name: name, x: x, y: y, color: color }, extra); }
  function mean(a) {
    const v = (a || []).filter(x => x !== null && x !== undefined);
    return v.length ? v.reduce((p, q) => p + q, 0) / v.length : null;
  }
  function engineName(key) { return key.replace("engine", "engine "); }

  function rewards() {
    const sec = document.getElementById("rewards"), row = add(sec, el("div", { class: "row" }));
    const T = D.train, E = D.eval, series = [];
    if (T.reward) {
      series.push(line("train reward (mean)", T.step, T.reward, COLORS[0]));
      if (T.reward_std) {
        const sd = T.reward_std;
        const band = sign => T.reward.map((r, i) => r === null || sd[i] === null ? null : r + sign * sd[i]);
        series.push(line("mean + std", T.step, band(1), "#a9b8e8", { dash: "3 3" }));
        series.push(line("mean - std", T.step, band(-1), "#a9b8e8", { dash: "3 3" }));
      }
    }
    if (E.eval_reward) series.push(line("held-out, greedy", E.step, E.eval_reward, COLORS[2], { dots: true }));
    if (E.eval_sampled_reward) {
      series.push(line("held-out, sampled", E.step, E.eval_sampled_reward, COLORS[4], { dots: true }));
    }
    if (series.length) lineChart(row, "reward per step; held-out reward at each evaluation", series);
    else note(row, "no reward was logged");
    if (E.eval_exact) {
      const exact = line("exact", E.step, E.eval_exact, COLORS[6], { dots: true });
      lineChart(row, "held-out exact answers (greedy)", [exact], { yMin: 0 });
    }
    if (D.notes.eval) note(sec, D.notes.eval);
  }

  function rollouts() {
    const sec = document.getElementById("rollouts"), row = add(sec, el("div", { class: "row" }));
    if (D.staleness.length) {
      barChart(row, "staleness: versions behind the policy trained, share of samples",
        D.staleness.map(([lag]) => String(lag)), D.staleness.map(([, share]) => share), COLORS[1], "versions behind");
    } else note(row, "no staleness histogram was logged");
    const T = D.train, series = [];
    const lengths = [["response_len_max", "max", COLORS[9], "2 3"], ["response_len_p99", "p99", COLORS[2], ""],
      ["response_len", "mean", COLORS[0], ""], ["response_len_p50", "median", COLORS[3], "5 3"]];
    for (const [key, name, color, dash] of lengths) {
      if (T[key]) series.push(line(name, T.step, T[key], color, { dash: dash }));
    }
    if (series.length) lineChart(row, "completion length in tokens over the steps", series, { yMin: 0 });
    else note(row, "no completion lengths were logged");
    if (T.truncated_frac) {
      lineChart(row, "share of completions cut at max_new_tokens",
        [line("truncated", T.step, T.truncated_frac, COLORS[5])], { yMin: 0 });
    }
  }

  function throughput() {
    const sec = document.getElementById("throughput"), row = add(sec, el("div", { class: "row" }));
    const T = D.train, engines = Object.keys(D.engines_idle), idle = [];
    if (T.samples_per_s) {
      const rate = line("samples/s", T.step, T.samples_per_s, COLORS[0]);
      lineChart(row, "trained samples per second", [rate], { yMin: 0 });
    }
    if (T.trainer_idle_frac) idle.push(line("trainer", T.step, T.trainer_idle_frac, COLORS[2]));
    engines.forEach((k, i) => {
      idle.push(line(engineName(k), T.step, D.engines_idle[k], COLORS[(i + 3) % COLORS.length]));
    });
    if (idle.length) {
      lineChart(row, "idle fraction per role (share of the step spent waiting)", idle, { yMin: 0, yMax: 1 });
    }
    if (!T.samples_per_s && !idle.length) { note(row, "no throughput was logged"); return; }
    const rows = [["trainer idle (waits for scored groups)", mean(T.trainer_idle_frac)]];
    engines.forEach(k => rows.push([engineName(k) + " idle", mean(D.engines_idle[k])]));
    const step = mean(T["time/step"]);
    for (const [key, what] of [["time/wait", "wait"], ["time/prepare", "prepare"], ["time/train", "train + publish"]]) {
      if (T[key] && step) rows.push([`share of a step in ${what}`, mean(T[key]) / step]);
    }
    rows.push(["samples/s (mean over steps)", mean(T.samples_per_s)], ["seconds per step (mean)", step]);
    const c = card(row, "means over the steps");
    table(c, ["", ""], rows.filter(r => r[1] !== null));
  }

  function gantt(parent, TL, which, title, origin) {
    const c = add(parent, el("div"));
    add(c, el("h3", {}, title));
    const span = which === "overview" ? TL.span_s : TL.closeup[1];
    const rowH = 16, L = 190, W = 1200, top = 6, H = top + TL.tracks.length * rowH + 28;
    const s = add(c, svg("svg", { viewBox: `0 0 ${W} ${H}`, width: "100%", role: "img" }));
    const X = t => L + Math.max(0, Math.min(t, span)) / (span || 1) * (W - L - 8);
    TL.tracks.forEach((tr, r) => {
      const y = top + r * rowH;
      if (r % 2 === 0) add(s, svg("rect", { x: 0, y: y, width: W, height: rowH, fill: "#f7f8fa" }));
      add(s, svg("text", { x: 4, y: y + 12 }, `${tr.role} · ${tr.track}`));
      for (const [start, dur, name, depth, count] of tr[which]) {
        if (start + dur < 0 || start > span) continue;
        const x = X(start), w = Math.max(X(start + dur) - x, 0.6), inset = Math.min(depth, 3) * 2.5;
        const rect = add(s, svg("rect", { x: x, y: y + 1 + inset, width: w, height: rowH - 2 - 2 * inset,
          fill: COLORS[name % COLORS.length], "fill-opacity": depth ? 0.95 : 0.8 }));
        const merged = count > 1 ? ` (${count} spans drawn as one)` : "";
        add(rect, svg("title", {}, `${TL.names[name]}: ${seconds(dur)} at ${seconds(start + origin)}${merged}`));
      }
    });
    const y = top + TL.tracks.length * rowH;
    for (const t of ticks(0, span, 10)) {
      add(s, svg("line", { x1: X(t.v), x2: X(t.v), y1: top, y2: y, stroke: "#dde1e7", "stroke-width": 0.5 }));
      const label = tickFmt(t.v + origin, t.step) + " s";
      add(s, svg("text", { x: X(t.v), y: y + 14, "text-anchor": "middle" }, label));
    }
  }

  function timeline() {
    const sec = document.getElementById("timeline"), TL = D.timeline;
    if (!TL) { note(sec, D.notes.timeline || "no timeline"); return; }
    add(sec, el("p", { class: "muted" }, "Each row is a thread of a role (an engine, a trainer rank, a reward " +
      "worker, an environment slot, the controller's loop). Hover a bar for its name and duration. timeline.json " +
      "in the run directory opens in the Perfetto UI (ui.perfetto.dev) with every span and the counters."));
    legend(sec, TL.names.map((n, i) => [n, COLORS[i % COLORS.length]]));
    gantt(sec, TL, "overview", `the whole run (${seconds(TL.span_s)}; time from the first span)`, 0);
    gantt(sec, TL, "closeup",
      `close-up: the last ${TL.closeup_steps} training steps (or the whole run when it had fewer)`, TL.closeup[0]);
    const row = add(sec, el("div", { class: "row" }));
    const c = card(row, `busy share of each row over RL (${seconds(TL.busy_window[1])} from the first wait for a ` +
      "batch to the end of the last train; waits count as idle)");
    table(c, ["role", "row", "busy", "spans"], TL.tracks.map(t => [t.role, t.track,
      t.busy === null ? "-" : (100 * t.busy).toFixed(1) + "%", String(t.count)]));
  }

  function samples() {
    const sec = document.getElementById("samples");
    if (D.notes.samples) note(sec, D.notes.samples);
    if (!D.samples.length) return;
    const tagColor = { best: COLORS[4], worst: COLORS[2], random: COLORS[9] };
    for (const group of D.samples) {
      add(sec, el("h3", {}, `step ${group.step}`));
      for (const smp of group.samples) {
        const box = add(sec, el("div", { class: "sample" }));
        const head = add(box, el("div"));
        add(head, el("span", { class: "tag", style: "background:" + tagColor[smp.kind] }, smp.kind));
        const extra = Object.entries(smp.info).map(([k, v]) => `${k} ${fmt(v)}`).join(", ");
        head.appendChild(document.createTextNode(`reward ${fmt(smp.reward)} · ${smp.finish} · ${smp.tokens} tokens` +
          (smp.versions ? ` · ${smp.versions}` : "") + (smp.turns ? ` · ${smp.turns} turns` : "") +
          (extra ? ` · ${extra}` : "") + ` · ${smp.task}`));
        add(box, el("div", { class: "muted" }, "prompt"));
        add(box, el("pre", {}, smp.prompt));
        add(box, el("div", { class: "muted" }, "completion"));
        add(box, el("pre", {}, smp.completion));
      }
    }
  }

  overview();
  rewards();
  rollouts();
  throughput();
  timeline();
  samples();
  document.body.setAttribute("data-rendered", "1");
})();
