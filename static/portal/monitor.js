// The node monitor's charts (drawn with static/portal/charts.js over uPlot). The page renders
// the first data; with auto-refresh on, every 90 s it reads the same API the page used
// (GET /api/v1/nodes/metrics/<id>, /api/v1/nodes/<id>/energy, /api/v1/nodes/<id>) with
// the session, and redraws. A reading no card reports is "not supported"; a range
// without data is "—", never 0. The energy section's charts (power per card, measured;
// the CPU estimate, apart) come from the energy answer's series.
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

  // the energy section (docs/energy.md): power per card (measured) and the CPU estimate,
  // from the energy answer's series; the estimate is its own chart, labelled as such
  var CARD_COLORS = ["#2563eb", "#dc2626", "#16a34a", "#7c3aed", "#ea580c", "#0891b2", "#ca8a04", "#db2777"];

  function drawEnergy(series) {
    var points = (series && series.points) || [];
    var xs = points.map(function (p) { return Date.parse(p.at) / 1000; });
    var cards = document.getElementById("chart-power-cards");
    if (cards) {
      if (!data.supported.power_w) {
        charts.note(cards, "not supported", "unsupported");
      } else {
        var indices = [];
        points.forEach(function (p) {
          (p.gpus || []).forEach(function (g) { if (indices.indexOf(g.index) < 0) indices.push(g.index); });
        });
        indices.sort(function (a, b) { return a - b; });
        charts.draw(cards, xs, indices.map(function (index, i) {
          return { label: "GPU " + index, color: CARD_COLORS[i % CARD_COLORS.length], values: points.map(function (p) {
            var card = (p.gpus || []).filter(function (g) { return g.index === index; })[0];
            return card ? card.power_w : null;
          }) };
        }), {});
      }
    }
    var node = document.getElementById("chart-power-node");
    if (node) {
      if (!data.supported.power_w) {
        charts.note(node, "not supported", "unsupported");
      } else {
        charts.draw(node, xs, [{ label: "all cards", color: "#111827",
          values: points.map(function (p) { return p.gpu_power_w; }) }], {});
      }
    }
    var cpu = document.getElementById("chart-cpu-estimate");
    if (cpu) {
      charts.draw(cpu, xs, [{ label: "CPU (estimate)", color: "#6b7280", dash: [6, 3],
        values: points.map(function (p) { return p.cpu_power_w_estimate; }) }],
        { empty: "— no estimate in this range (no CPU readings, or no TDP known)" });
    }
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
      show('[data-energy="lifetime"]', fixed(energy.lifetime.gpu_energy_kwh, 3, " kWh"));
      show('[data-energy="cpu-lifetime"]', fixed(energy.lifetime.cpu_estimate.energy_kwh, 3, " kWh"));
      if (energy.carbon.basis === "factor") {
        var g = energy.carbon.lifetime_gpu_g;
        show('[data-carbon="lifetime"]', g >= 1e6 ? (g / 1e6).toFixed(2) + " t CO₂e" :
          g >= 1e3 ? (g / 1e3).toFixed(1) + " kg CO₂e" : g.toFixed(0) + " g CO₂e");
      } else {
        show('[data-carbon="lifetime"]', "—");
      }
      drawEnergy(energy.series);
      var node = answers[2];
      show('[data-live="cpu"]', fixed(node.cpu_used, 0, "%"));
      show('[data-live="host-memory"]', fixed(node.memory_used, 0, "%"));
    }).catch(function () { /* keep what is shown; the next tick tries again */ });
  }

  draw(data.history);
  drawEnergy(data.energy_series);
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
