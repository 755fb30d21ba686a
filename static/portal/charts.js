// The portal's chart helper over uPlot (served from static/vendor: no CDN), shared by the
// node monitor (monitor.js) and the dashboard's server panel (server_panel.js).
//
// HeteroflowCharts.draw(box, xs, lines, options) draws one chart in `box`:
//   xs      x values in Unix seconds;
//   lines   [{label, values, color, dash}], `values` one per x, null where there is no
//           data: a gap in the line, never 0;
//   options {range: [min, max] for the y axis, format: value -> text for the axis and
//           legend, empty: the text when no line has a value, height}.
// A chart is updated in place while its lines stay the same, and drawn again when they
// change (another host appears, say). The box says what it shows for scripts and tests:
// data-state (drawn / empty / unsupported), data-points (the most values any line has)
// and data-series (how many lines).
(function () {
  "use strict";

  function forget(box) {
    if (box._uplot) { box._uplot.destroy(); box._uplot = null; box._uplotKey = null; }
  }

  function note(box, text, state) {
    forget(box);
    var old = box.querySelector(".uplot, .empty");
    if (old) old.remove();
    var p = document.createElement("p");
    p.className = "empty";
    p.textContent = text;
    box.appendChild(p);
    box.dataset.points = "0";
    box.dataset.series = "0";
    box.dataset.state = state || "empty";
  }

  function filled(values) {
    return values.filter(function (v) { return v !== null && v !== undefined; }).length;
  }

  function draw(box, xs, lines, options) {
    options = options || {};
    var most = lines.reduce(function (m, line) { return Math.max(m, filled(line.values)); }, 0);
    if (!most) { note(box, options.empty || "— no data in this range", "empty"); return 0; }
    var empty = box.querySelector(".empty");
    if (empty) empty.remove();
    var payload = [xs].concat(lines.map(function (line) {
      return line.values.map(function (v) { return v === undefined ? null : v; });
    }));
    var key = lines.map(function (line) { return line.label; }).join("\u0001");
    if (box._uplot && box._uplotKey === key) {
      box._uplot.setData(payload);
    } else {
      forget(box);
      var format = options.format;
      var series = [{}].concat(lines.map(function (line) {
        var s = { label: line.label, stroke: line.color, width: 2, spanGaps: false };
        if (line.dash) s.dash = line.dash;
        if (format) s.value = function (u, v) { return v === null || v === undefined ? "—" : format(v); };
        return s;
      }));
      var opts = { width: Math.max(300, box.clientWidth - 20), height: options.height || 200, series: series,
                   scales: options.range ? { y: { range: options.range } } : {}, legend: { show: true } };
      if (format) {
        opts.axes = [{}, { size: 84, values: function (u, splits) { return splits.map(format); } }];
      }
      box._uplot = new uPlot(opts, payload, box);
      box._uplotKey = key;
    }
    box.dataset.points = String(most);
    box.dataset.series = String(lines.length);
    box.dataset.state = "drawn";
    return most;
  }

  window.HeteroflowCharts = { draw: draw, note: note };
})();
