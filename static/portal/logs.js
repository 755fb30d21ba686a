/* The live log panel of the task and training group pages (templates/portal/_log_panel.html,
   apps/portal/pages/logs.py; docs/portal.md#the-live-log-panel). It reads the live log API
   with the page's session (docs/api.md#live-logs): first the last `tail` lines (a page),
   then, while the task (every member of the group) runs, an EventSource that follows on
   after them; the browser reconnects by itself with Last-Event-ID, and a follow the server
   refused is opened again after RETRY_MS from the last line shown. After the end, the
   stored lines, "Load earlier lines" for older ones, and the final log tail when no line
   was stored.

   The page keeps at most `bound` lines (the oldest leave first, and a note says how many
   left; Download still has them). Auto-scroll follows the newest line until the reader
   scrolls up, and again once they are back at the bottom. Pause holds new lines back
   (shown on resume). Search hides the lines that do not contain the text and marks it in
   the others. Download reads the whole log page by page and saves it as text. A group's
   lines carry a "[rank N]" prefix when every rank is shown. */
(function () {
  "use strict";
  var root = document.querySelector("[data-log-panel]");
  var holder = document.getElementById("log-panel-data");
  if (!root || !holder || !window.fetch || !window.EventSource) return;
  var cfg = JSON.parse(holder.textContent);
  var group = cfg.kind === "group";
  var RETRY_MS = 5000;

  function part(name) { return root.querySelector("[data-log-" + name + "]"); }
  var view = part("view"), statusLine = part("status"), controls = part("controls"), search = part("search");
  var matches = part("matches"), pauseButton = part("pause"), downloadButton = part("download");
  var earlierButton = part("earlier"), trimmedNote = part("trimmed"), scrollNote = part("scroll");
  var latestButton = part("latest"), heldNote = part("held"), tailBox = part("tail"), rankSelect = part("rank");
  var info = part("info");

  var state = null; // what one reading of the log has (a rank switch starts another)
  var paused = false, autoScroll = true, query = "", searchTimer = null;

  function fresh() {
    return {
      generation: state ? state.generation + 1 : 1,
      source: null, // the follow's EventSource
      retry: null, // a timer: the follow (or the first read) tried again
      after: group ? "" : 0, // the follow's cursor: the last seq (a group's rank:seq,…)
      last: {}, // per rank ("" for a task): the last seq taken
      earliest: {}, // per rank: the oldest seq read; absent: none read
      start: {}, // per rank: nothing older to read
      first: 1, // a task's first line kept (older ones were trimmed at the bound)
      held: [], // lines that came while paused
      trimmed: 0, // lines that left the page (the bound)
      lines: 0, // lines taken in all
      ended: false,
    };
  }

  function rank() { return rankSelect ? rankSelect.value : ""; }
  function key(line) { return group ? String(line.rank) : ""; }
  function number(n) { return n.toLocaleString("en-GB"); }

  function url(params) {
    var query = [];
    Object.keys(params).forEach(function (name) {
      var value = params[name];
      if (value !== undefined && value !== null && value !== "") query.push(name + "=" + encodeURIComponent(value));
    });
    if (group && rank() !== "") query.push("rank=" + encodeURIComponent(rank()));
    return cfg.url + (query.length ? "?" + query.join("&") : "");
  }

  function getJSON(address) {
    return fetch(address, { credentials: "same-origin", headers: { Accept: "application/json" } }).then(function (r) {
      if (!r.ok) throw new Error("HTTP " + r.status);
      return r.json();
    });
  }

  function setStatus(name, text) {
    root.dataset.state = name;
    statusLine.className = "log-status log-" + name; // not "live": the monitor's readings grid
    statusLine.textContent = text;
  }

  function say(text) { info.textContent = text; }

  // --- lines in the page ---------------------------------------------------------------------

  function element(line) {
    var el = document.createElement("div");
    el.className = "log-line " + line.stream;
    el.dataset.seq = line.seq;
    el.dataset.stream = line.stream;
    if (line.stream !== "stdout") el.title = line.stream;
    if (group) {
      el.dataset.rank = line.rank;
      if (rank() === "") {
        var prefix = document.createElement("span");
        prefix.className = "log-rank";
        prefix.textContent = "[rank " + line.rank + "] ";
        el.appendChild(prefix);
      }
    }
    var text = document.createElement("span");
    text.className = "log-text";
    text.textContent = line.text;
    el.appendChild(text);
    el.logText = line.text;
    if (query) paint(el);
    return el;
  }

  function atBottom() { return view.scrollHeight - view.scrollTop - view.clientHeight < 8; }
  function toBottom() { view.scrollTop = view.scrollHeight; }

  function setAutoScroll(on) {
    autoScroll = on;
    root.dataset.autoscroll = on ? "on" : "off";
    scrollNote.hidden = on;
  }

  function reveal() {
    var any = state.lines > 0;
    view.hidden = !any;
    tailBox.hidden = any;
  }

  function show(lines) {
    if (!lines.length) return;
    var batch = document.createDocumentFragment();
    lines.forEach(function (line) { batch.appendChild(element(line)); });
    view.appendChild(batch);
    trim();
    reveal();
    countMatches();
    if (autoScroll) toBottom();
  }

  // the bound: the oldest lines leave the page (the view keeps still when scrolled up)
  function trim() {
    var over = view.childElementCount - cfg.bound;
    if (over <= 0) return;
    var cut = view.children[over];
    var shift = cut.offsetTop - view.firstElementChild.offsetTop;
    var range = document.createRange();
    range.setStartBefore(view.firstElementChild);
    range.setEndBefore(cut);
    range.deleteContents();
    if (!autoScroll) view.scrollTop = Math.max(0, view.scrollTop - shift);
    state.trimmed += over;
    noteTrimmed();
  }

  function noteTrimmed() {
    root.dataset.trimmed = state.trimmed;
    trimmedNote.hidden = !state.trimmed;
    trimmedNote.textContent = "The oldest " + number(state.trimmed) + " line" + (state.trimmed === 1 ? " is" : "s are") +
      " no longer shown: the page keeps the latest " + number(cfg.bound) + ". Download has the whole log.";
    offerEarlier();
  }

  function noteHeld() {
    heldNote.hidden = !paused;
    heldNote.textContent = "Paused: " + number(state.held.length) + " new line" + (state.held.length === 1 ? "" : "s") +
      " held back, shown when you resume.";
    root.dataset.held = state.held.length;
  }

  // lines from the API (a page or a follow's event): each taken once, in order
  function take(lines) {
    var taken = lines.filter(function (line) {
      var k = key(line);
      if (line.seq <= (state.last[k] || 0)) return false;
      state.last[k] = line.seq;
      if (!(k in state.earliest)) state.earliest[k] = line.seq;
      return true;
    });
    if (!taken.length) return;
    state.lines += taken.length;
    if (paused) {
      Array.prototype.push.apply(state.held, taken);
      // held lines past the bound would leave the page the moment they are shown
      var over = state.held.length - cfg.bound;
      if (over > 0) {
        state.held.splice(0, over);
        state.trimmed += over;
        noteTrimmed();
      }
      reveal();
      noteHeld();
    } else {
      show(taken);
    }
  }

  // --- reading and following -----------------------------------------------------------------

  function stop() {
    if (!state) return;
    if (state.source) state.source.close();
    clearTimeout(state.retry);
    state.source = null;
  }

  function load() {
    stop();
    state = fresh();
    var generation = state.generation;
    view.textContent = "";
    trimmedNote.hidden = true;
    earlierButton.hidden = true;
    root.dataset.trimmed = 0;
    showTails(null);
    noteHeld();
    reveal();
    setStatus("loading", "Loading…");
    getJSON(url({ tail: cfg.tail })).then(function (page) {
      if (generation !== state.generation) return;
      state.after = page.next;
      if (!group) state.first = page.first || 1;
      take(page.lines || []);
      offerEarlier();
      var ended = group ? cfg.ended : cfg.terminal.indexOf(page.status) >= 0;
      if (ended) {
        end(group ? { status: cfg.status, exit_codes: cfg.exit_codes } : { status: page.status, exit_code: page.exit_code },
          group ? null : page.log_tail);
      } else {
        follow();
      }
    }).catch(function (error) {
      if (generation !== state.generation) return;
      setStatus("reconnecting", "The log could not be read (" + error.message + "); trying again…");
      state.retry = setTimeout(load, RETRY_MS);
    });
  }

  function follow() {
    var generation = state.generation;
    var source = new EventSource(url({ follow: "true", after: state.after }));
    state.source = source;
    source.addEventListener("open", function () {
      if (generation === state.generation) setStatus("live", "Live");
    });
    source.addEventListener("lines", function (event) {
      if (generation !== state.generation) return;
      if (event.lastEventId) state.after = group ? event.lastEventId : Number(event.lastEventId);
      take(JSON.parse(event.data).lines || []);
      if (root.dataset.state !== "live") setStatus("live", "Live");
    });
    source.addEventListener("end", function (event) {
      if (generation !== state.generation) return;
      source.close();
      state.source = null;
      end(JSON.parse(event.data), null);
    });
    source.addEventListener("error", function () {
      if (generation !== state.generation || state.ended) return;
      setStatus("reconnecting", "Reconnecting…");
      if (source.readyState === EventSource.CLOSED) { // refused, not an event stream: the browser gave up
        state.source = null;
        state.retry = setTimeout(function () { if (generation === state.generation) follow(); }, RETRY_MS);
      }
    });
  }

  function end(data, logTail) {
    state.ended = true;
    var text = "Ended: " + data.status;
    if (!group && data.exit_code !== null && data.exit_code !== undefined) text += ", exit code " + data.exit_code;
    if (group && data.exit_codes) {
      var codes = Object.keys(data.exit_codes).filter(function (r) { return rank() === "" || r === rank(); })
        .map(function (r) { return "rank " + r + ": " + (data.exit_codes[r] === null ? "—" : data.exit_codes[r]); });
      if (codes.length) text += " (exit code" + (codes.length > 1 ? "s " : " ") + codes.join(", ") + ")";
    }
    setStatus("ended", text);
    var badge = document.querySelector(group ? "[data-group-status]" : "[data-task-status]");
    if (badge && data.status) {
      badge.textContent = data.status;
      badge.className = "badge " + data.status;
    }
    if (!state.lines) finalTails(logTail);
  }

  // --- the final tail: what shows when no line was stored ------------------------------------

  function showTails(tails) {
    if (tails) {
      tailBox.textContent = "";
      Object.keys(tails).forEach(function (r) {
        if (!tails[r]) return;
        var box = document.createElement("div");
        box.dataset.logTailRank = r;
        if (r !== "") {
          var heading = document.createElement("h3");
          heading.textContent = "Rank " + r + ": last lines";
          box.appendChild(heading);
        }
        var pre = document.createElement("pre");
        pre.dataset.log = "";
        pre.textContent = tails[r];
        box.appendChild(pre);
        tailBox.appendChild(box);
      });
    }
    Array.prototype.forEach.call(tailBox.querySelectorAll("[data-log-tail-rank]"), function (box) {
      box.hidden = rank() !== "" && box.dataset.logTailRank !== rank();
    });
  }

  function finalTails(logTail) {
    var generation = state.generation;
    if (!group) {
      var have = logTail !== null ? Promise.resolve(logTail) : getJSON(url({ tail: 1 })).then(function (p) { return p.log_tail; });
      have.then(function (tail) {
        if (generation !== state.generation) return;
        if (tail) showTails({ "": tail });
        else if (!tailBox.querySelector("pre")) noOutput();
      }).catch(function () {});
      return;
    }
    var ranks = Object.keys(cfg.members).filter(function (r) { return rank() === "" || r === rank(); });
    Promise.all(ranks.map(function (r) {
      return getJSON(cfg.members[r] + "?tail=1").then(function (p) { return p.log_tail; }, function () { return cfg.tails[r] || ""; });
    })).then(function (tails) {
      if (generation !== state.generation) return;
      var byRank = {};
      ranks.forEach(function (r, i) { byRank[r] = tails[i]; });
      if (tails.some(function (t) { return t; })) showTails(byRank);
      else if (!tailBox.querySelector("pre")) noOutput();
    });
  }

  function noOutput() {
    tailBox.textContent = "";
    var note = document.createElement("p");
    note.className = "muted";
    note.textContent = "No output was kept.";
    tailBox.appendChild(note);
  }

  // --- load earlier lines ----------------------------------------------------------------------

  function offerEarlier() {
    var keys = Object.keys(state.earliest).filter(function (k) {
      return !state.start[k] && state.earliest[k] > (group ? 1 : state.first);
    });
    earlierButton.hidden = !keys.length || state.trimmed > 0 || view.childElementCount >= cfg.bound;
  }

  function loadEarlier() {
    var room = Math.min(cfg.earlier, cfg.bound - view.childElementCount);
    if (room <= 0) return;
    var generation = state.generation, params;
    if (group) {
      params = {
        after: Object.keys(state.earliest).map(function (k) {
          var wanted = !state.start[k] && state.earliest[k] > 1;
          return k + ":" + (wanted ? Math.max(0, state.earliest[k] - 1 - room) : state.last[k]);
        }).join(","),
        limit: room,
      };
    } else {
      var after = Math.max(state.first - 1, state.earliest[""] - 1 - room);
      params = { after: after, limit: state.earliest[""] - 1 - after };
    }
    earlierButton.disabled = true;
    getJSON(url(params)).then(function (page) {
      if (generation !== state.generation) return;
      var older = (page.lines || []).filter(function (line) {
        var k = key(line);
        return k in state.earliest && line.seq < state.earliest[k];
      });
      older = older.slice(Math.max(0, older.length - room));
      var found = {};
      older.forEach(function (line) {
        var k = key(line);
        found[k] = Math.min(found[k] || line.seq, line.seq);
      });
      Object.keys(state.earliest).forEach(function (k) {
        if (k in found) state.earliest[k] = found[k];
        else state.start[k] = true;
      });
      if (!group && page.first) state.first = page.first;
      prepend(older);
      offerEarlier();
    }).catch(function (error) {
      say("Earlier lines could not be read (" + error.message + ").");
    }).then(function () { earlierButton.disabled = false; });
  }

  function prepend(lines) {
    if (!lines.length) return;
    var before = view.scrollHeight;
    var batch = document.createDocumentFragment();
    lines.forEach(function (line) { batch.appendChild(element(line)); });
    view.insertBefore(batch, view.firstChild);
    state.lines += lines.length;
    view.scrollTop += view.scrollHeight - before;
    countMatches();
  }

  // --- search ------------------------------------------------------------------------------------

  function paint(el) {
    var text = el.logText, span = el.lastChild;
    var lower = text.toLowerCase();
    var at = query ? lower.indexOf(query) : -1;
    if (el.marked) {
      span.textContent = text;
      el.marked = false;
    }
    el.classList.toggle("log-miss", !!query && at < 0);
    if (at < 0) return;
    el.marked = true;
    if (lower.length !== text.length) { // a case mapping that changes the length: mark the line whole
      el.classList.add("log-hit");
      return;
    }
    span.textContent = "";
    var from = 0;
    while (at >= 0) {
      if (at > from) span.appendChild(document.createTextNode(text.slice(from, at)));
      var mark = document.createElement("mark");
      mark.textContent = text.slice(at, at + query.length);
      span.appendChild(mark);
      from = at + query.length;
      at = lower.indexOf(query, from);
    }
    if (from < text.length) span.appendChild(document.createTextNode(text.slice(from)));
  }

  function applySearch() {
    query = search.value.toLowerCase();
    root.dataset.query = query;
    for (var el = view.firstElementChild; el; el = el.nextElementSibling) {
      el.classList.remove("log-hit");
      paint(el);
    }
    countMatches();
    if (autoScroll) toBottom();
  }

  function countMatches() {
    if (!query) {
      matches.textContent = "";
      return;
    }
    var shown = view.childElementCount - view.querySelectorAll(".log-miss").length;
    matches.textContent = number(shown) + " of " + number(view.childElementCount) + " lines match";
  }

  // --- download ------------------------------------------------------------------------------------

  function download() {
    var generation = state.generation, prefix = group && rank() === "";
    var parts = [], count = 0;
    downloadButton.disabled = true;
    say("Downloading…");
    function next(after) {
      return getJSON(url({ after: after, limit: cfg.page })).then(function (page) {
        var lines = page.lines || [];
        lines.forEach(function (line) { parts.push((prefix ? "[rank " + line.rank + "] " : "") + line.text); });
        count += lines.length;
        say("Downloading… " + number(count) + " lines");
        if (!lines.length || (!group && lines.length < cfg.page)) return page;
        return next(page.next);
      });
    }
    next(group ? "" : 0).then(function (page) {
      var body = parts.length ? parts.join("\n") + "\n" : "";
      if (!count) { // no stored line: the final tail, where there is one
        var tails = Array.prototype.map.call(tailBox.querySelectorAll("[data-log-tail-rank]"), function (box) {
          if (box.hidden) return "";
          var r = box.dataset.logTailRank, text = box.querySelector("pre").textContent;
          return r === "" ? text : text.split("\n").map(function (l) { return l ? "[rank " + r + "] " + l : l; }).join("\n");
        }).filter(function (t) { return t; });
        if (!tails.length && !group && page.log_tail) tails = [page.log_tail];
        body = tails.join("\n");
      }
      if (!body) {
        say("Nothing to download yet.");
        return;
      }
      save(body, cfg.name + (group && rank() !== "" ? "-rank-" + rank() : "") + ".log");
      say("Downloaded " + (count ? number(count) + " line" + (count === 1 ? "" : "s") : "the final tail") + ".");
    }).catch(function (error) {
      if (generation === state.generation) say("The download failed (" + error.message + ").");
    }).then(function () { downloadButton.disabled = false; });
  }

  function save(text, name) {
    var href = URL.createObjectURL(new Blob([text], { type: "text/plain;charset=utf-8" }));
    var link = document.createElement("a");
    link.href = href;
    link.download = name;
    link.hidden = true;
    document.body.appendChild(link);
    link.click();
    link.remove();
    setTimeout(function () { URL.revokeObjectURL(href); }, 60000);
  }

  // --- the controls --------------------------------------------------------------------------------

  view.addEventListener("scroll", function () {
    var bottom = atBottom();
    if (bottom !== autoScroll) setAutoScroll(bottom);
  });
  latestButton.addEventListener("click", function () {
    toBottom();
    setAutoScroll(true);
  });
  pauseButton.addEventListener("click", function () {
    paused = !paused;
    pauseButton.textContent = paused ? "Resume" : "Pause";
    pauseButton.setAttribute("aria-pressed", String(paused));
    root.dataset.paused = String(paused);
    if (!paused && state.held.length) {
      var held = state.held;
      state.held = [];
      show(held);
    }
    noteHeld();
  });
  search.addEventListener("input", function () {
    clearTimeout(searchTimer);
    searchTimer = setTimeout(applySearch, 120);
  });
  search.addEventListener("keydown", function (event) { // Enter searches at once (and sends no form)
    if (event.key === "Enter") {
      event.preventDefault();
      clearTimeout(searchTimer);
      applySearch();
    }
  });
  earlierButton.addEventListener("click", loadEarlier);
  downloadButton.addEventListener("click", download);
  if (rankSelect) rankSelect.addEventListener("change", load);
  window.addEventListener("pagehide", stop);
  window.addEventListener("pageshow", function (event) { if (event.persisted) load(); }); // back from the cache

  controls.hidden = false;
  root.dataset.paused = "false";
  setAutoScroll(true);
  load();
})();
