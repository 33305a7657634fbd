/* Gyre run dashboard: the live page (polls api/state) and the static report.html (window.GYRE_DATA) share this file.
 * Charts are Chart.js (vendored). Exposed for tests and the curious: window.gyreCharts (Chart instances by name),
 * window.gyreState (the last state drawn) and window.gyreDetail (the execution on view). */
(function () {
  "use strict";
  const STATIC = window.GYRE_DATA || null;
  const body = document.body;
  const refreshMs = 1000 * parseFloat(body.dataset.refreshS || "1");
  const charts = {};
  window.gyreCharts = charts;
  window.gyreState = null;
  window.gyreDetail = null;
  const ROLE_COLORS = { rollout: "#16a34a", training: "#2563eb", to_training: "#f59e0b", to_rollout: "#a855f7", lost: "#dc2626" };
  // Every abbreviation and short label the page shows, explained once (the Legend section; hover text in the header).
  const GLOSSARY = [
    ["policy", "how cells switch between rollout and training: elastic (cells join training as the rollout drains), async (a fixed split), colocate (all cells switch together)"],
    ["K", "elastic cells: GPU groups that each serve rollout or train; cell 0 is the core"],
    ["core", "cell 0: holds the authoritative weights and the optimizer, publishes each new policy version"],
    ["C_e", "executions one cell serves at once while in rollout"],
    ["C_s", "executions the standalone rollout pool serves at once (0: no pool)"],
    ["N", "valid rewards per group: the executions of one query that count for its advantage"],
    ["B", "groups per optimizer step"],
    ["phi", "extra dispatch, in units of B groups, beyond the current burst's (more overlap, more staleness: mean d = phi + (mu - 1) / 2)"],
    ["mu", "optimizer steps per burst: the steps between two weight publications to the rollout engines"],
    ["dispatched", "d(t): executions put in the rollout queue so far (counter)"],
    ["launched", "p(t): executions started so far (counter)"],
    ["terminated", "f(t): launched executions that ended (completed, failed, timed out or cancelled)"],
    ["withdrawn", "x(t): queued executions cancelled before launch (surplus or dropped groups)"],
    ["running", "executions in flight now: p - f"],
    ["queued", "executions waiting for a rollout slot now: d - p - x"],
    ["w(t)", "waterlevel: outstanding executions (queued + running), d - x - f; the next cell may join training only while w(t) fits the rollout capacity left without it"],
    ["C(t)", "rollout capacity: (K - k(t)) C_e + C_s, with k(t) cells away from rollout (training or switching)"],
    ["rollout", "cell role: serves model calls of running executions (R in the run's progress line)"],
    ["training", "cell role: trains on ready groups (T in the progress line)"],
    ["to_training", "cell role: switching from rollout to training (~ in the progress line)"],
    ["to_rollout", "cell role: switching from training back to rollout (~ in the progress line)"],
    ["lost", "cell role: its worker died; it serves and trains no more unless restarted (L in the progress line)"],
    ["open at end", "an execution still running or queued when the run finished: the run ended it, with no reward"],
    ["time share", "fraction of all cells' time spent in each role"],
    ["d", "staleness: policy versions between an execution's dispatch and the step that trains on it (d = 0: on-policy)"],
    ["v", "policy (weight) version: v0 is the model before training, each optimizer step adds one"],
    ["A", "advantage of an execution: its reward against its group's mean (A > 0: better than the group)"],
    ["clip fraction", "executions whose sequence ratio left the clip range, so they gave no gradient"],
    ["w", "token importance weight: trainer probability over the engine's (behaviour) probability"],
    ["capped fraction", "target tokens whose importance weight was capped"],
    ["l - b", "per target token, trainer log-probability l minus the engine's log-probability b (d = 0: engine mismatch only)"],
    ["lr", "learning rate of the optimizer step (after warm-up)"],
    ["grad norm", "global gradient norm before clipping"],
    ["std", "standard deviation of the step's rewards"],
    ["target tokens", "output tokens training learns from (the selected trajectories' targets)"],
    ["response length", "output tokens an execution generated, over all its model calls"],
    ["turns", "model calls of one execution"],
    ["tok", "tokens"],
    ["input sources", "where a call's input tokens came from: policy (sampled by the engine earlier in the execution) or external (prompts, tool results, text the harness added)"],
    ["finish", "why the engine stopped the call's output: stop (end of the turn), tool_use (a tool call), length (the token limit), abort, ..."],
    ["p50", "median (50th percentile) of the model calls' latency, request to last token"],
    ["p99", "99th percentile of the model calls' latency: 1 call in 100 took longer"],
    ["role class", "what a model call was for: main/task, main/summary, sub/task (a subagent), sub/summary"],
    ["t", "time since the run started"],
    ["micro-steps", "micro-batches of a step; each is claimed and trained by one cell"],
    ["s, min, h", "seconds, minutes, hours"],
  ];
  const GLOSS = Object.fromEntries(GLOSSARY);
  const abbr = (term, label) => (GLOSS[term]
    ? `<abbr title="${esc(GLOSS[term])}" data-term="${esc(term)}">${esc(label == null ? term : label)}</abbr>`
    : esc(label == null ? term : label));
  const PALETTE = ["#2563eb", "#dc2626", "#16a34a", "#f59e0b", "#7c3aed", "#0891b2", "#db2777", "#65a30d"];
  const $ = (id) => document.getElementById(id);
  const esc = (s) => String(s == null ? "" : s).replace(/[&<>"']/g, (c) => (
    { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
  const num = (v) => (v == null || Number.isNaN(v) ? null : Number(v));
  const fmt = (v, d = 4) => (num(v) == null ? "n/a" : Number(v).toFixed(d));
  let selected = null;
  let finished = false;
  let selectedRow = "";
  let unitName = "s";
  let unitScale = 1;

  Chart.defaults.animation = false;
  Chart.defaults.maintainAspectRatio = false;
  Chart.defaults.font.size = 11;
  Chart.defaults.plugins.legend.position = "top"; // a legend has its own box above the plot: it never covers a label
  Chart.defaults.plugins.legend.labels.boxWidth = 12;

  const timeAxis = () => ({ type: "linear", min: 0, title: { display: true, text: `time (${unitName})` } });
  const stepAxis = () => ({ type: "linear", ticks: { precision: 0, stepSize: 1 }, title: { display: true, text: "step" } });
  const yAxis = (text, extra) => Object.assign({ title: { display: true, text } }, extra || {});
  const line = (label, color, extra) => Object.assign(
    { label, data: [], borderColor: color, backgroundColor: color, borderWidth: 1.5, pointRadius: 2 }, extra || {});

  function make(name, config) {
    charts[name] = new Chart($("chart-" + name), config);
    return charts[name];
  }

  function buildCharts() {
    make("roles", {
      type: "bar",
      data: { labels: [], datasets: Object.keys(ROLE_COLORS).map((r) => ({
        label: r, data: [], backgroundColor: ROLE_COLORS[r], grouped: false, barPercentage: 0.7, categoryPercentage: 1 })) },
      options: { indexAxis: "y", scales: { x: timeAxis(), y: yAxis("cell") } },
    });
    make("waterlevel", {
      type: "line",
      data: { datasets: [
        line("waterlevel w(t)", PALETTE[0], { stepped: "after", pointRadius: 0 }),
        line("capacity C(t)", PALETTE[1], { stepped: "after", pointRadius: 0, borderDash: [6, 3] }),
        line("running", PALETTE[2], { stepped: "after", pointRadius: 0, borderWidth: 1 }),
      ] },
      options: { scales: { x: timeAxis(), y: yAxis("executions", { beginAtZero: true }) } },
    });
    make("reward", {
      type: "line",
      data: { datasets: [
        line("mean reward", PALETTE[0], { pointRadius: 3 }),
        line("mean + std", "rgba(37,99,235,0.35)", { pointRadius: 0, borderDash: [4, 3], borderWidth: 1 }),
        line("mean - std", "rgba(37,99,235,0.35)", { pointRadius: 0, borderDash: [4, 3], borderWidth: 1, fill: "-1",
          backgroundColor: "rgba(37,99,235,0.10)" }),
      ] },
      options: { scales: { x: stepAxis(), y: yAxis("reward") } },
    });
    make("lr", {
      type: "line",
      data: { datasets: [line("lr", PALETTE[4], { pointRadius: 3 })] },
      options: { scales: { x: stepAxis(), y: yAxis("learning rate", { beginAtZero: true,
        ticks: { callback: (v) => (v === 0 ? "0" : Number(v).toExponential(1)) } }) } },
    });
    make("gradnorm", {
      type: "line",
      data: { datasets: [line("grad norm", PALETTE[1], { pointRadius: 3 })] },
      options: { scales: { x: stepAxis(), y: yAxis("norm before clipping", { beginAtZero: true }) } },
    });
    make("length", {
      type: "line",
      data: { datasets: [line("mean", PALETTE[2], { pointRadius: 3 }), line("max", PALETTE[3], { borderDash: [4, 3] })] },
      options: { scales: { x: stepAxis(), y: yAxis("output tokens per execution", { beginAtZero: true }) } },
    });
    make("turns", {
      type: "line",
      data: { datasets: [line("mean", PALETTE[0], { pointRadius: 3 }), line("max", PALETTE[5], { borderDash: [4, 3] })] },
      options: { scales: { x: stepAxis(), y: yAxis("model calls per execution", { beginAtZero: true, ticks: { precision: 0 } }) } },
    });
    make("loss", {
      type: "line",
      data: { datasets: [line("loss", PALETTE[1], { pointRadius: 3 }), line("surrogate", PALETTE[4])] },
      options: { scales: { x: stepAxis(), y: yAxis("value") } },
    });
    make("staleness", {
      type: "bar",
      data: { labels: [], datasets: [{ label: "groups", data: [], backgroundColor: PALETTE[0] }] },
      options: { scales: { x: yAxis("staleness d (versions)"), y: yAxis("groups", { beginAtZero: true, ticks: { precision: 0 } }) } },
    });
    make("clip", {
      type: "line",
      data: { datasets: [] },
      options: { scales: { x: stepAxis(), y: yAxis("fraction of executions", { min: 0, suggestedMax: 1 }) } },
    });
    make("weights", {
      type: "line",
      data: { datasets: [
        line("w mean", PALETTE[0]), line("w max", PALETTE[1]),
        line("capped fraction", PALETTE[3], { yAxisID: "y1" }),
        line("mean(l - b), d = 0", PALETTE[2], { yAxisID: "y1", borderDash: [4, 3] }),
        line("mean(l - b), d > 0", PALETTE[4], { yAxisID: "y1", borderDash: [4, 3] }),
      ] },
      options: { scales: { x: stepAxis(), y: yAxis("weight"), y1: yAxis("fraction, log-ratio", { position: "right", grid: { drawOnChartArea: false } }) } },
    });
    make("throughput", {
      type: "line",
      data: { datasets: [line("output tokens/s", PALETTE[2], { pointRadius: 0, fill: "origin", backgroundColor: "rgba(22,163,74,0.15)" })] },
      options: { scales: { x: timeAxis(), y: yAxis("tokens/s", { beginAtZero: true }) } },
    });
    make("latency", {
      type: "line",
      data: { datasets: [line("p50", PALETTE[0], { pointRadius: 1 }), line("p99", PALETTE[1], { pointRadius: 1 })] },
      options: { spanGaps: true, scales: { x: timeAxis(), y: yAxis("seconds", { beginAtZero: true }) } },
    });
    make("switches", {
      type: "scatter",
      data: { datasets: [
        { label: "to training", data: [], backgroundColor: ROLE_COLORS.to_training, pointRadius: 4 },
        { label: "to rollout", data: [], backgroundColor: ROLE_COLORS.to_rollout, pointRadius: 4 },
        { label: "publication", data: [], backgroundColor: PALETTE[1], pointStyle: "triangle", pointRadius: 5 },
      ] },
      options: { scales: { x: timeAxis(), y: yAxis("seconds", { beginAtZero: true }) } },
    });
  }

  function setTimeUnit(series) {
    unitName = series.time_unit || "s";
    unitScale = series.time_scale || 1;
    for (const name of ["roles", "waterlevel", "throughput", "latency", "switches"]) {
      const x = charts[name].options.scales.x;
      x.title.text = `time (${unitName})`;
      x.min = 0;
      x.max = series.length_s > 0 ? T(series.length_s) : undefined; // every time axis spans the whole run
    }
  }
  const T = (t) => (t == null ? null : t / unitScale);

  // The executions a step trained on (its groups' members that were launched): response length and turns per step.
  function stepMembers(steps, executions) {
    const byGroup = {};
    for (const e of executions) if (e.launch_t != null) (byGroup[e.group] = byGroup[e.group] || []).push(e);
    return steps.map((s) => (s.group_ids || []).flatMap((g) => byGroup[g] || []));
  }
  const stat = (rows, key) => {
    const v = rows.map((e) => num(e[key])).filter((x) => x != null);
    return v.length ? { mean: v.reduce((a, b) => a + b, 0) / v.length, max: v.reduce((a, b) => Math.max(a, b)) }
      : { mean: null, max: null };
  };
  // The range of the run's rewards: the mean +- std band never leaves it (0/1 rewards: the band stays within [0, 1]).
  function rewardRange(executions) {
    const v = executions.map((e) => num(e.reward)).filter((x) => x != null);
    // reduce, not Math.min(...v): a long run has more rewards than a call takes arguments
    return v.length ? [v.reduce((a, b) => Math.min(a, b)), v.reduce((a, b) => Math.max(a, b))] : null;
  }

  function drawCharts(series, executions) {
    setTimeUnit(series);
    const roles = series.roles || [];
    const labels = roles.map((_, i) => (i === 0 ? "cell 0 (core)" : `cell ${i}`));
    const rc = charts.roles;
    rc.data.labels = labels;
    for (const ds of rc.data.datasets) {
      ds.data = [];
      roles.forEach((spans, i) => {
        for (const [a, b, role] of spans) if (role === ds.label && b > a) ds.data.push({ x: [T(a), T(b)], y: labels[i] });
      });
    }
    rc.update();

    const wl = series.waterlevel || [];
    const w = charts.waterlevel.data.datasets;
    w[0].data = wl.map((p) => ({ x: T(p[0]), y: p[1] }));
    w[1].data = wl.map((p) => ({ x: T(p[0]), y: p[2] }));
    w[2].data = wl.map((p) => ({ x: T(p[0]), y: p[3] }));
    charts.waterlevel.update();

    const steps = series.steps || [];
    const r = charts.reward.data.datasets;
    r[0].data = steps.map((s) => ({ x: s.step, y: num(s.mean_reward) }));
    const range = rewardRange(executions);
    const clip = (y) => (range ? Math.min(range[1], Math.max(range[0], y)) : y);
    const band = (sign) => steps.map((s) => ({ x: s.step,
      y: num(s.mean_reward) == null || num(s.reward_std) == null ? null : clip(s.mean_reward + sign * s.reward_std) }));
    r[1].data = band(1);
    r[2].data = band(-1);
    charts.reward.options.scales.y.suggestedMin = range ? range[0] : undefined;
    charts.reward.options.scales.y.suggestedMax = range ? range[1] : undefined;
    charts.reward.update();

    charts.lr.data.datasets[0].data = steps.map((s) => ({ x: s.step, y: num((s.metrics || {}).lr) }));
    charts.lr.update();
    charts.gradnorm.data.datasets[0].data = steps.map((s) => ({ x: s.step, y: num(s.grad_norm) }));
    charts.gradnorm.update();
    const members = stepMembers(steps, executions);
    for (const [name, key] of [["length", "output_tokens"], ["turns", "calls"]]) {
      const st = members.map((rows) => stat(rows, key));
      charts[name].data.datasets[0].data = steps.map((s, i) => ({ x: s.step, y: st[i].mean }));
      charts[name].data.datasets[1].data = steps.map((s, i) => ({ x: s.step, y: st[i].max }));
      charts[name].update();
    }

    const l = charts.loss.data.datasets;
    l[0].data = steps.map((s) => ({ x: s.step, y: num(s.loss) }));
    l[1].data = steps.map((s) => ({ x: s.step, y: num(s.surrogate) }));
    charts.loss.update();

    const hist = series.staleness_hist || [];
    charts.staleness.data.labels = hist.map(([d]) => `d=${d}`);
    charts.staleness.data.datasets[0].data = hist.map(([, n]) => n);
    charts.staleness.update();

    const clipKeys = [];
    for (const s of steps) for (const k of Object.keys(s.metrics || {})) if (k.startsWith("clip_frac_") && !clipKeys.includes(k)) clipKeys.push(k);
    clipKeys.sort((a, b) => order(a) - order(b) || a.localeCompare(b, undefined, { numeric: true }));
    charts.clip.data.datasets = clipKeys.map((k, i) => line(clipLabel(k), PALETTE[i % PALETTE.length], {
      data: steps.map((s) => ({ x: s.step, y: num((s.metrics || {})[k]) })), borderDash: k.startsWith("clip_frac_d") ? [4, 3] : undefined }));
    charts.clip.update();

    const wd = charts.weights.data.datasets;
    const m = (k) => steps.map((s) => ({ x: s.step, y: num((s.metrics || {})[k]) }));
    wd[0].data = m("weight_mean"); wd[1].data = m("weight_max"); wd[2].data = m("capped_frac");
    wd[3].data = m("mean_log_ratio_d0"); wd[4].data = m("mean_log_ratio_dpos");
    charts.weights.update();

    const tp = series.throughput || [];
    charts.throughput.data.datasets[0].data = tp.map((b) => ({ x: T(b.t), y: b.tokens_per_s }));
    charts.throughput.update();
    charts.latency.data.datasets[0].data = tp.map((b) => ({ x: T(b.t), y: num(b.latency_p50_s) }));
    charts.latency.data.datasets[1].data = tp.map((b) => ({ x: T(b.t), y: num(b.latency_p99_s) }));
    charts.latency.update();

    const sw = series.switches || [];
    const sd = charts.switches.data.datasets;
    sd[0].data = sw.filter((s) => s.to === "training" && s.t != null).map((s) => ({ x: T(s.t), y: s.total_s }));
    sd[1].data = sw.filter((s) => s.to === "rollout" && s.t != null).map((s) => ({ x: T(s.t), y: s.total_s }));
    sd[2].data = (series.publishes || []).filter((p) => p.t != null).map((p) => ({ x: T(p.t), y: p.total_s }));
    charts.switches.update();
  }
  const order = (k) => (k === "clip_frac_all" ? 0 : k === "clip_frac_pos" ? 1 : k === "clip_frac_neg" ? 2 : 3);
  const clipLabel = (k) => ({ clip_frac_all: "all", clip_frac_pos: "A > 0", clip_frac_neg: "A < 0" }[k]
    || k.replace("clip_frac_d", "d = "));

  function drawHeader(summary) {
    finished = !!summary.finished;
    $("run-name").textContent = summary.name || "";
    document.title = `Gyre run ${summary.name || ""}`;
    const h = summary.header || {};
    const c = summary.counters || {};
    const share = Object.entries(summary.role_share || {}).map(([k, v]) => `${k} ${(100 * v).toFixed(0)}%`).join(", ");
    const planned = summary.steps_planned == null ? "?" : summary.steps_planned;
    const facts = [
      ["policy", summary.policy], ["K", h.K], ["C_e", h.C_e], ["C_s", h.C_s], ["N", h.N], ["B", h.B], ["phi", h.phi],
      ["mu", h.mu], ["steps", `${summary.steps_done}/${planned}`],
      ["dispatched", c.d], ["launched", c.p], ["terminated", c.f], ["withdrawn", c.x],
      // a finished run has nothing in flight: what its trace left open is not "running" (the run ended them)
      ...(summary.finished ? [] : [["running", summary.running], ["queued", summary.queued]]),
      ["length", `${fmt(T(summary.length_s), 1)} ${unitName}`], ["time share", share],
      ["last reward", fmt(summary.last_reward)],
    ];
    $("run-facts").innerHTML = facts.filter(([, v]) => v != null)
      .map(([k, v]) => `<span>${abbr(k)} <b>${esc(v)}</b></span>`).join("");
    const st = $("run-status");
    const steps = `${summary.steps_done} of ${planned} steps`;
    const state = summary.finished ? `finished, ${summary.steps_done} steps`
      : STATIC ? `run did not finish (interrupted or still running): ${steps}` : `live: ${steps}`;
    st.textContent = (STATIC ? "report: " : "") + state;
    st.className = "status " + (summary.finished ? "finished" : STATIC ? "stale" : "live");
  }

  function drawLegend() {
    for (const a of document.querySelectorAll("abbr[data-term]")) a.title = GLOSS[a.dataset.term] || "";
    $("legend-terms").innerHTML = GLOSSARY.map(([term, text]) =>
      `<dt data-term="${esc(term)}">${esc(term)}</dt><dd>${esc(text)}</dd>`).join("");
  }

  // A finished run ended what was still in flight: those are not "running" any more.
  const shownStatus = (e) => (finished && (e.status === "running" || e.status === "queued") ? "open at end" : e.status);

  function drawExecutions(rows) {
    $("executions-count").textContent = `(${rows.length})`;
    const details = STATIC ? STATIC.details || {} : null; // the report embeds the details of a sample only
    $("executions-note").textContent = details && Object.keys(details).length < rows.length
      ? `This report holds the details of ${Object.keys(details).length} of ${rows.length} executions, sampled across the whole run; the others are greyed.` : "";
    $("executions").tBodies[0].innerHTML = rows.map((e) => `<tr data-execution="${esc(e.execution)}"${e.execution === selected ? ' class="selected"' : ""}${
      details && !Object.hasOwn(details, e.execution) ? ' data-detail="none"' : ""}>
      <td><code>${esc(e.execution)}</code></td><td>${esc(e.group)}</td><td><span class="badge ${esc(shownStatus(e) === e.status ? e.status : "cancelled")}">${abbr(shownStatus(e))}</span></td>
      <td>${esc(e.engine || "")}</td><td>${e.calls}</td><td>${e.output_tokens}</td><td>${e.input_tokens}</td>
      <td>${fmt(e.reward)}</td><td>${e.assessment ? `<span class="badge ${esc(e.assessment)}">${esc(e.assessment)}</span>` : ""}</td></tr>`).join("");
  }

  function drawSteps(steps) {
    $("steps").tBodies[0].innerHTML = steps.map((s) => `<tr><td>${s.step}</td><td>${fmt(T(s.t), 2)} ${unitName}</td>
      <td>${fmt(s.mean_reward)}</td><td>${fmt(s.reward_std)}</td><td>${fmt(s.loss, 6)}</td><td>${fmt(s.grad_norm)}</td>
      <td>${s.target_tokens}</td><td>${s.training_cells}</td>
      <td>${esc(Object.entries(s.microsteps_by_cell || {}).map(([c, n]) => `${c}: ${n}`).join(", "))}</td>
      <td>${esc((s.staleness || []).join(", "))}</td></tr>`).join("");
  }

  function drawSamples(samples) {
    $("samples").innerHTML = samples.length ? samples.map((s) => `<div class="sample"><h3>Step ${s.step}</h3>${
      s.answers.length ? s.answers.map((a) => `<div><span class="muted"><code>${esc(a.execution)}</code> reward ${fmt(a.reward)}</span>
      <pre>${esc(a.answer == null ? "(no answer file)" : a.answer)}</pre></div>`).join("") : '<p class="muted">no scored answer</p>'}</div>`).join("")
      : '<p class="muted">no step yet</p>';
  }

  function render(state) {
    window.gyreState = state;
    setTimeUnit(state.series);
    drawHeader(state.summary);
    drawCharts(state.series, state.executions || []);
    drawExecutions(state.executions);
    drawSteps(state.series.steps || []);
    drawSamples(state.series.samples || []);
    $("updated").textContent = STATIC ? "" : `updated ${new Date().toLocaleTimeString()}`;
    if (selected) {
      const row = state.executions.find((e) => e.execution === selected);
      const key = JSON.stringify(row || null);
      if (key !== selectedRow) { selectedRow = key; showExecution(selected); }
    }
  }

  // ---- one execution -------------------------------------------------------------------------------------------
  const roleClass = (rc) => "role role-" + String(rc).replace("/", "-");
  function nodeHtml(n) {
    const prov = (n.input_provenance || []).map(([src, len]) => `${src} ${len}`).join(", ");
    const segs = (n.segments || []).map((s) => `<span class="segment" title="output tokens [${s.start}, ${s.end})">${esc(s.engine_id)} @ v${esc(s.weight_version)}: ${s.end - s.start} tok</span>`).join("");
    const pieces = (n.pieces || []).map((p) => {
      const text = p.text == null ? `[${p.tokens} tokens]` : p.text;
      return p.target
        ? `<span class="tok target" data-n="${p.tokens}" data-start="${p.start}" data-end="${p.end}" data-trajectory="${p.trajectory}" title="target tokens [${p.start}, ${p.end}) of trajectory #${p.trajectory}">${esc(text)}</span>`
        : `<span class="tok nontarget" data-n="${p.tokens}" title="output tokens [${p.start}, ${p.end}), not a target">${esc(text)}</span>`;
    }).join("");
    const tail = n.input_tail == null ? `[${n.input_tail_tokens} tokens]` : n.input_tail;
    return `<div class="node" data-call="${esc(n.call_id)}">
      <div class="node-head"><b>call ${n.seq}</b><span class="${roleClass(n.role_class)}">${esc(n.role_class)}</span>
        <span>${esc(n.call_kind)} · agent ${esc(n.agent_id)}</span><span>in ${n.input_tokens} ${abbr("tok")} (${abbr("input sources", prov)})</span>
        <span>out ${n.output_tokens} ${abbr("tok")}, <b>${n.target_tokens}</b> ${abbr("target tokens", "target")}</span><span>${abbr("finish")} ${esc(n.finish_reason)}</span>
        <span>${fmt(n.latency_s, 2)} s</span></div>
      <div class="segments">${segs}</div>
      <div class="text"><span class="input-tail">…${esc(tail)}</span>${pieces}</div></div>`;
  }
  function treeHtml(nodes) {
    const kids = {};
    for (const n of nodes) (kids[n.parent || ""] = kids[n.parent || ""] || []).push(n);
    const walk = (id, root) => (kids[id] || []).length
      ? `<ul class="tree${root ? " root" : ""}">${kids[id].map((n) => `<li>${nodeHtml(n)}${walk(n.call_id, false)}</li>`).join("")}</ul>` : "";
    return walk("", true) || '<p class="muted">no model call recorded</p>';
  }
  function drawExecution(d, id) {
    window.gyreDetail = d;
    const view = $("execution-view");
    view.hidden = false;
    if (!d) {
      $("ev-id").textContent = id || "";
      for (const id of ["ev-facts", "ev-assessments", "ev-answer"]) $(id).textContent = "";
      $("ev-trajectories").tBodies[0].innerHTML = "";
      const n = Object.keys((STATIC && STATIC.details) || {}).length;
      $("ev-tree").innerHTML = STATIC ? `<p class="muted">not embedded in this report: it holds the details of ${n} of
        ${STATIC.executions.length} executions, sampled across the whole run (the live dashboard shows every one)</p>`
        : '<p class="muted">not available</p>';
      return;
    }
    const e = d.execution;
    $("ev-id").textContent = e.execution;
    const facts = [["group", e.group], ["status", shownStatus(e)], ["engine", e.engine], [`dispatched at ${abbr("v")}`, e.v_d],
      [abbr("turns", "calls"), e.calls], [abbr("response length", "output tokens"), e.output_tokens], ["reward", fmt(e.reward)],
      ["assessment", e.assessment]];
    $("ev-facts").innerHTML = facts.map(([k, v]) => `<span>${k} <b>${esc(v)}</b></span>`).join("")
      + (d.tokenizer_error ? `<span class="muted">no text: ${esc(d.tokenizer_error)}</span>` : "");
    $("ev-tree").innerHTML = treeHtml(d.nodes || []);
    $("ev-trajectories").tBodies[0].innerHTML = (d.trajectories || []).map((t) => `<tr data-trajectory="${t.index}">
      <td>${t.index}</td><td><code>${esc(t.leaf_call_id || "placeholder")}</code></td><td><span class="${roleClass(t.role_class)}">${esc(t.role_class)}</span></td>
      <td>${esc(t.agent_id || "")}</td><td>${t.tokens}</td><td>${t.targets}</td>
      <td>${esc(t.weight_versions.map((w) => `${w.engine_id} @ v${w.weight_version}: ${w.end - w.start}`).join("; "))}</td></tr>`).join("")
      || '<tr><td colspan="7" class="muted">none selected yet</td></tr>';
    $("ev-assessments").innerHTML = (d.assessments || []).map((a) => {
      const p = a.provenance || {};
      const hist = (a.history || []).map((h) => `<tr><td>${h.number}</td><td>${new Date(h.started_at * 1000).toLocaleTimeString()}</td>
        <td>${fmt(h.finished_at - h.started_at, 2)} s</td><td>${h.ok ? "ok" : "failed"}</td><td>${fmt(h.score)}</td><td>${esc(h.error || "")}</td></tr>`).join("");
      return `<div class="assessment"><b>${esc(a.evaluator)}</b> <span class="badge ${esc(a.status)}">${esc(a.status)}</span>
        score <b>${fmt(a.score)}</b> · ${a.attempts} attempt(s) · ${a.final ? "final" : "pending"}${a.designated ? " · designated (the reward)" : ""}
        ${p.critique ? `<div>critique: ${esc(p.critique)}</div>` : ""}${p.last_error ? `<div>last error: ${esc(p.last_error)}</div>` : ""}
        <table class="history"><thead><tr><th>attempt</th><th>started</th><th>took</th><th>result</th><th>score</th><th>error</th></tr></thead>
        <tbody>${hist || '<tr><td colspan="6" class="muted">no attempt yet</td></tr>'}</tbody></table></div>`;
    }).join("") || '<p class="muted">not assessed yet</p>';
    $("ev-answer").textContent = d.answer == null ? "(no answer file)" : d.answer;
  }
  async function showExecution(id) {
    if (STATIC) {
      const details = STATIC.details || {};
      drawExecution(Object.hasOwn(details, id) ? details[id] : null, id);
      return;
    }
    try {
      const r = await fetch("api/execution/" + encodeURIComponent(id), { cache: "no-store" });
      drawExecution(r.ok ? await r.json() : null, id);
    } catch (err) { /* the next poll retries */ }
  }
  function select(id) {
    selected = id;
    selectedRow = "";
    for (const tr of $("executions").tBodies[0].rows) tr.classList.toggle("selected", tr.dataset.execution === id);
    if (location.hash !== "#execution=" + id) history.replaceState(null, "", "#execution=" + encodeURIComponent(id));
    const row = window.gyreState && window.gyreState.executions.find((e) => e.execution === id);
    selectedRow = JSON.stringify(row || null);
    showExecution(id);
  }
  $("executions").addEventListener("click", (ev) => {
    const tr = ev.target.closest("tr[data-execution]");
    if (tr) select(tr.dataset.execution);
  });

  // ---- start ---------------------------------------------------------------------------------------------------
  buildCharts();
  drawLegend();
  const fromHash = () => (location.hash.startsWith("#execution=") ? decodeURIComponent(location.hash.slice(11)) : null);
  if (STATIC) {
    render(STATIC);
    if (fromHash()) select(fromHash());
  } else {
    let first = true;
    const poll = async () => {
      try {
        const r = await fetch("api/state", { cache: "no-store" });
        if (r.ok) {
          render(await r.json());
          if (first && fromHash()) select(fromHash());
          first = false;
        }
      } catch (err) {
        $("run-status").textContent = "disconnected: the run has ended or the server is unreachable";
        $("run-status").className = "status stale";
      } finally {
        setTimeout(poll, refreshMs);
      }
    };
    poll();
  }
})();
