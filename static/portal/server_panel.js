// The dashboard's server monitoring panel (platform operators; apps/portal/pages/server.py).
// The page renders the first state: each host's newest stored sample, the health check,
// and the range's history (embedded as JSON). This script
//  - draws the history charts with static/portal/charts.js, one line per host, on a full
//    grid of the range's buckets, so a bucket without samples is a gap, never 0 and
//    never a line drawn across it;
//  - switches the range (1 h / 6 h / 24 h / 7 d) by reading
//    GET /api/v1/server/metrics/history?hours=N and redrawing (the links work without it);
//  - every 5 s, while the tab is visible and auto-refresh is on, reads each host's newest
//    sample (/portal/server/hosts/), the live reading of the host that answers
//    (GET /api/v1/server/metrics) and the health check (GET /api/v1/server/health-check),
//    all with the session. A read that fails leaves what is shown and marks it stale
//    ("stale since" the first poll that failed, which reads failed); the next poll that
//    reads everything clears the mark.
// The cards' colours follow the limits the page gives (data.thresholds, spec 003).
(function () {
  "use strict";
  var root = document.getElementById("server-panel");
  var source = document.getElementById("server-panel-data");
  if (!root || !source) return;
  var data = JSON.parse(source.textContent);
  var charts = window.HeteroflowCharts;
  var DASH = "—";
  var COLORS = ["#2563eb", "#16a34a", "#ea580c", "#7c3aed", "#dc2626", "#0891b2", "#ca8a04", "#db2777"];
  var UNITS = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
  var FETCH = { credentials: "same-origin", headers: { Accept: "application/json" } };

  // --- formatting: as the template filters in apps/portal/templatetags/portal.py ----------

  function none(v) { return v === null || v === undefined; }
  function pct(v) { return none(v) ? DASH : v.toFixed(0) + "%"; }
  function bytes(v) {
    if (none(v)) return DASH;
    var unit = 0;
    while (Math.abs(v) >= 1024 && unit < UNITS.length - 1) { v /= 1024; unit += 1; }
    return unit === 0 ? v.toFixed(0) + " B" : v.toFixed(1) + " " + UNITS[unit];
  }
  function rate(v) { return none(v) ? DASH : bytes(v) + "/s"; }
  function duration(seconds) {
    if (none(seconds)) return DASH;
    seconds = Math.floor(seconds);
    if (seconds < 60) return seconds + " s";
    var parts = [[Math.floor(seconds / 86400), "d"], [Math.floor(seconds % 86400 / 3600), "h"], [Math.floor(seconds % 3600 / 60), "min"]];
    while (parts.length && parts[0][0] === 0) parts.shift();
    return parts.map(function (p) { return p[0] + " " + p[1]; }).join(" ");
  }
  function every(step) { return step % 3600 === 0 ? step / 3600 + " h" : step % 60 === 0 ? step / 60 + " min" : step + " s"; }
  function fixed(v, digits) { return none(v) ? DASH : v.toFixed(digits); }
  // as the template's `level` filter: "60,80" amber above 60 and red above 80, "80" red above 80
  function level(v, reading) {
    if (none(v)) return "none";
    var limits = data.thresholds[reading].split(",").map(Number);
    var high = limits[limits.length - 1], warn = limits.length > 1 ? limits[0] : null;
    return v > high ? "high" : warn !== null && v > warn ? "warn" : "ok";
  }
  function clock(date) { return date.toLocaleTimeString(); }

  // --- the cards ---------------------------------------------------------------------------

  var hostsBox = document.getElementById("server-hosts");

  function cardFor(host) {
    var cards = hostsBox.querySelectorAll(".host-card");
    for (var i = 0; i < cards.length; i++) if (cards[i].dataset.host === host) return cards[i];
    return null;
  }

  function newCard(host) {
    var card = document.getElementById("server-host-template").content.firstElementChild.cloneNode(true);
    card.dataset.host = host;
    card.querySelector('[data-field="host"]').textContent = host;
    var after = null;
    hostsBox.querySelectorAll(".host-card").forEach(function (other) { if (!after && other.dataset.host > host) after = other; });
    hostsBox.insertBefore(card, after);
    return card;
  }

  function put(card, selector, text, levelClass) {
    var el = card.querySelector(selector);
    if (!el) return;
    el.textContent = text;
    if (levelClass !== undefined) {
      el.classList.remove("ok", "warn", "high", "none");
      el.classList.add(levelClass);
    }
  }

  function fill(card, r) {
    put(card, '[data-reading="cpu"]', pct(r.cpu_percent), level(r.cpu_percent, "cpu_percent"));
    put(card, '[data-reading="memory"]', pct(r.memory_percent), level(r.memory_percent, "memory_percent"));
    put(card, '[data-detail="memory"]', bytes(r.memory_used_bytes) + " / " + bytes(r.memory_total_bytes));
    put(card, '[data-reading="disk"]', pct(r.disk_percent), level(r.disk_percent, "disk_percent"));
    put(card, '[data-detail="disk"]', bytes(r.disk_used_bytes) + " / " + bytes(r.disk_total_bytes));
    put(card, '[data-reading="net-in"]', "↓ " + rate(r.net_recv_bytes_per_second));
    put(card, '[data-reading="net-out"]', "↑ " + rate(r.net_sent_bytes_per_second));
    var t = r.cpu_temperature_celsius;
    put(card, '[data-reading="temperature"]', none(t) ? "no sensor" : t.toFixed(0) + " °C", level(t, "cpu_temperature_celsius"));
    put(card, '[data-reading="load"]', fixed(r.load_1, 2));
    put(card, '[data-detail="load"]', "5 min " + fixed(r.load_5, 2) + " · 15 min " + fixed(r.load_15, 2));
    put(card, '[data-reading="uptime"]', duration(r.uptime_seconds));
  }

  function stamp(card, text, stale, at) {
    var el = card.querySelector('[data-field="stamp"]');
    el.textContent = text;
    el.classList.toggle("stale", !!stale);
    if (at) el.title = at;
    card.classList.toggle("stale", !!stale);
  }

  // each host's newest stored sample; hosts silent for over an hour are gone from the answer
  function applyHosts(body) {
    var listed = {};
    body.hosts.forEach(function (sample) {
      listed[sample.host] = true;
      var card = cardFor(sample.host) || newCard(sample.host);
      fill(card, sample);
      card.dataset.source = "sample";
      stamp(card, sample.stale ? "no sample for " + duration(sample.age_seconds) : "sampled " + duration(sample.age_seconds) + " ago",
            sample.stale, sample.at);
    });
    hostsBox.querySelectorAll(".host-card").forEach(function (card) {
      if (!listed[card.dataset.host] && card.dataset.host !== body.this_host) card.remove();
    });
  }

  // the host that answered, measured now: fresher than its stored sample
  function applyLive(body) {
    var card = cardFor(body.host) || newCard(body.host);
    fill(card, body);
    card.dataset.source = "live";
    stamp(card, "live", false, body.at);
    put(card, '[data-field="platform"]', body.os + " · " + body.arch + " · answered the refresh");
  }

  // --- the health check --------------------------------------------------------------------

  function cell(row, text, className) {
    var td = document.createElement("td");
    if (className) {
      var badge = document.createElement("span");
      badge.className = "badge " + className;
      badge.textContent = text;
      td.appendChild(badge);
    } else {
      td.textContent = text;
    }
    row.appendChild(td);
  }

  function applyHealth(body) {
    var verdict = root.querySelector("[data-verdict]");
    verdict.textContent = body.status;
    verdict.className = "badge verdict " + body.status;
    verdict.dataset.verdict = body.status;
    var checked = root.querySelector("[data-health-checked]");
    checked.setAttribute("datetime", body.checked_at);
    checked.textContent = clock(new Date(body.checked_at));
    var rows = document.getElementById("server-checks");
    rows.textContent = "";
    body.checks.forEach(function (check) {
      var row = document.createElement("tr");
      row.dataset.check = check.name;
      row.dataset.checkStatus = check.status;
      cell(row, check.status, check.status);
      cell(row, data.check_labels[check.name] || check.name);
      cell(row, check.message);
      cell(row, check.suggestion || DASH);
      rows.appendChild(row);
    });
  }

  // --- refresh -----------------------------------------------------------------------------

  function getJSON(url) {
    return fetch(url, FETCH).then(function (r) {
      var json = (r.headers.get("Content-Type") || "").indexOf("application/json") === 0;
      if (!r.ok || !json) throw new Error(r.ok ? "not signed in" : "HTTP " + r.status);
      return r.json();
    });
  }

  var lastRefresh = Date.now();
  var lastGood = new Date();  // the page's own figures count as the first good read
  var staleSince = null;
  var staleBadge = document.getElementById("server-stale");
  var healthTable = document.getElementById("server-checks").closest("table");

  // what a failed poll leaves: the last data, marked stale in the parts it failed to read
  function markStale(failedParts, failures) {
    if (!failures.length) {
      staleSince = null;
      lastGood = new Date();
    } else {
      staleSince = staleSince || new Date();
    }
    staleBadge.hidden = !staleSince;
    staleBadge.textContent = staleSince ? "stale since " + clock(staleSince) : "";
    staleBadge.title = staleSince ? "Could not read: " + failures.join(", ") + ". Showing the data of " + clock(lastGood) + "." : "";
    if (staleSince) staleBadge.dataset.staleSince = staleSince.toISOString(); else delete staleBadge.dataset.staleSince;
    [["cards", hostsBox], ["health", healthTable]].forEach(function (part) {
      var stale = failedParts.indexOf(part[0]) >= 0;
      part[1].classList.toggle("stale-data", stale);
      if (stale) part[1].dataset.stale = "true"; else delete part[1].dataset.stale;
    });
  }

  var polling = null;  // the poll in flight: a tick that comes meanwhile does not start another

  function refresh() {
    if (polling) return polling;
    lastRefresh = Date.now();
    var reads = [
      ["stored samples", "cards", data.urls.hosts, applyHosts],
      ["live reading", "cards", data.urls.live, applyLive],  // after the samples: it replaces its host's
      ["health check", "health", data.urls.health, applyHealth],
    ];
    polling = Promise.allSettled(reads.map(function (read) { return getJSON(read[2]); })).then(function (results) {
      var failed = [], parts = [];
      results.forEach(function (result, i) {
        if (result.status === "fulfilled") reads[i][3](result.value);
        else {
          failed.push(reads[i][0] + " (" + result.reason.message + ")");
          parts.push(reads[i][1]);
        }
      });
      markStale(parts, failed);
      var updated = document.getElementById("server-updated");
      updated.textContent = failed.length
        ? "Could not read: " + failed.join(", ") + " at " + clock(new Date()) + "; showing what was read at " +
          clock(lastGood) + ". Trying again every " + data.refresh_seconds + " s."
        : "Cards and health check updated " + clock(lastGood) + ".";
      updated.classList.toggle("error", failed.length > 0);
      return failed;
    }).finally(function () { polling = null; });
    return polling;
  }

  // --- history -----------------------------------------------------------------------------

  var colours = {};
  function colour(host) {
    if (!(host in colours)) colours[host] = COLORS[Object.keys(colours).length % COLORS.length];
    return colours[host];
  }

  function seconds(iso) { return Math.round(Date.parse(iso) / 1000); }

  // every bucket start of the range, as the API aligns them (epoch multiples of the bucket)
  function grid(history) {
    var step = history.bucket_seconds, xs = [];
    var last = Math.floor(seconds(history.until) / step) * step;
    for (var t = Math.floor(seconds(history.since) / step) * step; t <= last; t += step) xs.push(t);
    return xs;
  }

  var temperature = function (v) { return v.toFixed(0) + " °C"; };
  var percent = function (v) { return v.toFixed(0) + "%"; };
  var SPECS = [
    { id: "server-cpu", lines: [["cpu_percent", ""]], range: [0, 100], format: percent },
    { id: "server-memory", lines: [["memory_percent", ""]], range: [0, 100], format: percent },
    { id: "server-disk", lines: [["disk_percent", ""]], range: [0, 100], format: percent },
    { id: "server-network", lines: [["net_recv_bytes_per_second", "↓ "], ["net_sent_bytes_per_second", "↑ ", [6, 4]]], format: rate },
    { id: "server-load", lines: [["load_1", ""]], format: function (v) { return v.toFixed(2); } },
    { id: "server-temperature", lines: [["cpu_temperature_celsius", ""]], format: temperature,
      empty: "— no CPU temperature in this range (the hosts have no sensor)" },
  ];

  function drawHistory(history) {
    var xs = grid(history);
    var hosts = history.hosts.slice().sort(function (a, b) { return a.host < b.host ? -1 : a.host > b.host ? 1 : 0; });
    var byTime = hosts.map(function (series) {
      var points = {};
      series.points.forEach(function (p) { points[seconds(p.at)] = p; });
      return points;
    });
    SPECS.forEach(function (spec) {
      var lines = [];
      hosts.forEach(function (series, i) {
        spec.lines.forEach(function (line) {
          lines.push({
            label: line[1] + series.host, color: colour(series.host), dash: line[2],
            values: xs.map(function (t) { var p = byTime[i][t]; return p ? p[line[0]] : null; }),
          });
        });
      });
      charts.draw(document.getElementById(spec.id), xs, lines, { range: spec.range, format: spec.format, empty: spec.empty });
    });
    var box = document.getElementById("server-charts");
    box.dataset.hours = String(history.hours);
    var label = data.ranges[String(history.hours)] || history.hours + " h";
    root.querySelector("[data-server-range-label]").textContent = "(" + label + ", one line per host)";
    document.getElementById("server-history-note").textContent = label + " in " + every(history.bucket_seconds) +
      " buckets, " + xs.length + " per host; " + hosts.length + (hosts.length === 1 ? " host" : " hosts") +
      " with samples. A bucket without samples is a gap.";
  }

  function showRange(hours) {
    root.querySelectorAll("[data-server-range]").forEach(function (link) {
      if (link.dataset.serverRange === hours) link.setAttribute("aria-current", "true");
      else link.removeAttribute("aria-current");
    });
  }

  function switchRange(hours) {
    var box = document.getElementById("server-charts");
    box.dataset.loading = hours;
    return getJSON(data.urls.history + "?hours=" + encodeURIComponent(hours)).then(function (history) {
      drawHistory(history);
      data.hours = history.hours;
      showRange(hours);
      var url = new URL(window.location.href);
      url.searchParams.set("hours", hours);
      window.history.replaceState(null, "", url.pathname + url.search + url.hash);
    }).catch(function (error) {
      document.getElementById("server-history-note").textContent =
        "Could not read the " + (data.ranges[hours] || hours) + " history (" + error.message + "); showing the previous range.";
    }).finally(function () { delete box.dataset.loading; });
  }

  root.querySelectorAll("[data-server-range]").forEach(function (link) {
    link.addEventListener("click", function (event) {
      event.preventDefault();
      switchRange(link.dataset.serverRange);
    });
  });

  // --- start -------------------------------------------------------------------------------

  document.getElementById("server-charts").hidden = false;
  drawHistory(data.history);

  var toggle = document.getElementById("server-auto-refresh");
  var period = data.refresh_seconds * 1000;
  setInterval(function () {
    if (toggle.checked && !document.hidden) refresh();
  }, period);
  document.addEventListener("visibilitychange", function () {
    // a hidden tab skips its ticks; coming back after one was skipped refreshes at once
    if (!document.hidden && toggle.checked && Date.now() - lastRefresh >= period) refresh();
  });
  // a host that serves the page but has no stored sample: read it live now, not in 30 s
  var unsampled = cardFor(data.this_host);
  if (unsampled && unsampled.dataset.source === "none") refresh();

  window.heteroflowServerPanel = {
    refresh: refresh,
    // the poll in flight, or nothing: resolves once what it read is shown (for tests)
    settled: function () { return polling || Promise.resolve(); },
    switchRange: switchRange,
    // what a chart holds, for tests: [xs, line 1, line 2, ...] with null for gaps
    chartData: function (id) { var box = document.getElementById(id); return box && box._uplot ? box._uplot.data : null; },
  };
})();
