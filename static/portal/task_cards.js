/* The task page's charts of the cards the task holds (templates/portal/_task_cards.html):
   utilisation, memory and power per card over the last 15 minutes, from
   GET /api/v1/tasks/{id}/metrics (the heartbeats' samples of its node), read again every
   5 s while the task runs. A card that sent no reading shows a gap, never 0. */
(function () {
  "use strict";
  var root = document.querySelector("[data-task-cards]");
  var holder = document.getElementById("task-cards-data");
  if (!root || !holder || !window.fetch || !window.HeteroflowCharts) return;
  var cfg = JSON.parse(holder.textContent);
  var COLORS = ["#2563eb", "#dc2626", "#16a34a", "#d97706", "#7c3aed", "#0891b2", "#db2777", "#4b5563"];
  var FORMATS = {
    utilization: function (v) { return v.toFixed(0) + " %"; },
    memory_used_mb: function (v) { return (v / 1024).toFixed(1) + " GiB"; },
    power_w: function (v) { return v.toFixed(0) + " W"; }
  };
  var RANGES = { utilization: [0, 100] };

  function draw(samples) {
    var xs = samples.map(function (s) { return Date.parse(s.at) / 1000; });
    var indices = {};
    samples.forEach(function (s) { s.gpus.forEach(function (g) { indices[g.index] = true; }); });
    var cards = Object.keys(indices).map(Number).sort(function (a, b) { return a - b; });
    root.querySelectorAll("[data-task-chart]").forEach(function (box) {
      var field = box.dataset.taskChart;
      var lines = cards.map(function (index, i) {
        return {
          label: "GPU " + index,
          color: COLORS[i % COLORS.length],
          values: samples.map(function (s) {
            var card = s.gpus.filter(function (g) { return g.index === index; })[0];
            return card ? card[field] : null;
          })
        };
      });
      window.HeteroflowCharts.draw(box, xs, lines, {
        format: FORMATS[field], range: RANGES[field], empty: "— no readings in the last 15 minutes", height: 160
      });
    });
  }

  function read() {
    fetch(cfg.url, { credentials: "same-origin", headers: { Accept: "application/json" } })
      .then(function (r) { return r.ok ? r.json() : Promise.reject(r.status); })
      .then(function (body) {
        draw(body.samples || []);
        root.dataset.status = body.status;
        if (cfg.live && ["completed", "failed", "cancelled", "stopped"].indexOf(body.status) < 0) {
          setTimeout(read, 5000);
        }
      })
      .catch(function () { if (cfg.live) setTimeout(read, 5000); });
  }
  read();
})();
