// The node monitor's charts (drawn with static/portal/charts.js over uPlot). The page renders
// the first data; with auto-refresh on, every 90 s it reads the same API the page used
// (GET /api/v1/nodes/metrics/<id>, /api/v1/nodes/<id>/energy, /api/v1/nodes/<id>) with
// the session, and redraws. A reading no card reports is "not supported"; a range
// without data is "—", never 0.
(function () {
  "use strict";
  var REFRESH_MS = 90 * 1000;
  var data = JSON.parse(document.getElementById("monitor-data").textContent);
  var charts = window.HeteroflowCharts;  // static/portal/charts.js

  function mean(xs) { return xs.length ? xs.reduce(function (a, b) { return a + b; }, 0) / xs.length : null; }
  function sum(xs) { return xs.length ? xs.reduce(function (a, b) { return a + b; }, 0) : null; }
  function max(xs) { return xs.length ? Math.max.apply(null, xs) : null; }

  // one value per point for a GPU reading: the chosen card, or all cards combined
  function gpuSeries(points, reading, combine) {
    return points.map(function (p) {
      var cards = (p.gpus || []).filter(function (g) { return data.gpu === "all" || String(g.index) === data.gpu; });
      var values = cards.map(function (g) { return g[reading]; }).filter(function (v) { return v !== null && v !== undefined; });
      return combine(values);
    });
  }

  function toGiB(v) { return v === null ? null : v / 1024; }

  var SPECS = [
    { id: "chart-utilization", reading: "utilization", series: function (pts) { return [gpuSeries(pts, "utilization", mean)]; },
      labels: [data.gpu === "all" ? "mean of cards" : "GPU " + data.gpu], colors: ["#2563eb"], range: [0, 100] },
    { id: "chart-memory", reading: "memory_used_mb", series: function (pts) { return [gpuSeries(pts, "memory_used_mb", sum).map(toGiB)]; },
      labels: [data.gpu === "all" ? "all cards" : "GPU " + data.gpu], colors: ["#7c3aed"] },
    { id: "chart-temperature", reading: "temperature", series: function (pts) { return [gpuSeries(pts, "temperature", max)]; },
      labels: [data.gpu === "all" ? "hottest card" : "GPU " + data.gpu], colors: ["#ea580c"] },
    { id: "chart-host", reading: null, series: function (pts) {
        return [pts.map(function (p) { return p.cpu_used; }), pts.map(function (p) { return p.memory_used; })]; },
      labels: ["CPU", "memory"], colors: ["#2563eb", "#16a34a"], range: [0, 100] },
    { id: "chart-power", reading: "power_w", series: function (pts) { return [gpuSeries(pts, "power_w", sum)]; },
      labels: [data.gpu === "all" ? "all cards" : "GPU " + data.gpu], colors: ["#dc2626"] },
  ];

  function draw(history) {
    var points = history.points || [];
    var xs = points.map(function (p) { return Date.parse(p.at) / 1000; });
    SPECS.forEach(function (spec) {
      var box = document.getElementById(spec.id);
      if (!box) return;
      if (spec.reading && !data.supported[spec.reading]) { charts.note(box, "not supported", "unsupported"); return; }
      var ys = spec.series(points);
      charts.draw(box, xs, spec.labels.map(function (label, i) {
        return { label: label, color: spec.colors[i], values: ys[i] };
      }), { range: spec.range });
    });
    var updated = document.getElementById("updated");
    updated.textContent = "Updated " + new Date().toLocaleTimeString() + " · " + points.length + " points, " +
      history.bucket_seconds + " s each";
  }

  function show(selector, text) { var el = document.querySelector(selector); if (el) el.textContent = text; }
  function fixed(v, digits, unit) { return v === null || v === undefined ? "—" : v.toFixed(digits) + unit; }

  function refresh() {
    var q = "?hours=" + data.hours;
    var opts = { credentials: "same-origin", headers: { Accept: "application/json" } };
    Promise.all([
      fetch(data.metrics_url + q, opts).then(function (r) { if (!r.ok) throw r; return r.json(); }),
      fetch(data.energy_url + q, opts).then(function (r) { if (!r.ok) throw r; return r.json(); }),
      fetch(data.node_url, opts).then(function (r) { if (!r.ok) throw r; return r.json(); }),
    ]).then(function (answers) {
      draw(answers[0]);
      var energy = answers[1];
      show('[data-energy="kwh"]', fixed(energy.gpu_energy_kwh, 3, " kWh"));
      show('[data-energy="avg"]', fixed(energy.gpu_power_avg_w, 0, " W"));
      show('[data-energy="max"]', fixed(energy.gpu_power_max_w, 0, " W"));
      show('[data-energy="samples"]', String(energy.samples_with_power));
      var node = answers[2];
      show('[data-live="cpu"]', fixed(node.cpu_used, 0, "%"));
      show('[data-live="host-memory"]', fixed(node.memory_used, 0, "%"));
    }).catch(function () { /* keep what is shown; the next tick tries again */ });
  }

  draw(data.history);
  var timer = null;
  var toggle = document.getElementById("auto-refresh");
  function arm() {
    if (timer) { clearInterval(timer); timer = null; }
    if (toggle.checked) timer = setInterval(refresh, REFRESH_MS);
  }
  toggle.addEventListener("change", arm);
  arm();
  window.heteroflowMonitor = { refresh: refresh };
})();
