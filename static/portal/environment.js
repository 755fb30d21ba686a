/* The environment page's image part (docs/images.md): for every live node on the page,
   one check of its watched images through the image channel (POST
   /api/v1/nodes/{id}/images/check), followed every poll_ms until the agent answers:
   "n/m present" and each image's versions. A deploy button starts a pull (POST
   .../images/pull) and follows its progress every poll_ms. Offline nodes were rendered as
   "cannot check" and are never asked. */
(function () {
  "use strict";
  var holder = document.getElementById("environment-images");
  if (!holder) return;
  var data = JSON.parse(holder.textContent);
  var tokenInput = document.querySelector("input[name=csrfmiddlewaretoken]");
  var token = tokenInput ? tokenInput.value : "";
  var FINISHED = { completed: true, failed: true };

  function api(method, url, body) {
    var opts = { method: method, credentials: "same-origin", headers: { Accept: "application/json" } };
    if (body !== undefined) {
      opts.headers["Content-Type"] = "application/json";
      opts.headers["X-CSRFToken"] = token;
      opts.body = JSON.stringify(body);
    }
    return fetch(url, opts).then(function (r) {
      return r.json().then(function (answer) {
        if (!r.ok) {
          var error = new Error((answer.error && answer.error.message) || String(r.status));
          error.code = answer.error && answer.error.code;
          throw error;
        }
        return answer;
      });
    });
  }

  /* Follow one request every poll_ms until it ends; onUpdate sees every state. With
     pendingMs, stop following a request still unclaimed after that long (resolve it as
     it is: the node's agent may predate the image channel and never take it). */
  function follow(row, onUpdate, pendingMs) {
    var since = Date.now();
    return new Promise(function (resolve, reject) {
      function seen(latest) {
        current = latest;
        onUpdate(current);
        if (FINISHED[current.status]) resolve(current);
        else if (pendingMs && current.status === "pending" && Date.now() - since > pendingMs) resolve(current);
        else setTimeout(tick, data.poll_ms);
      }
      function tick() { api("GET", data.request_url + current.id).then(seen, reject); }
      var current = row;
      seen(row);
    });
  }

  function size(bytes) {
    if (bytes === null || bytes === undefined) return "";
    var units = ["B", "KiB", "MiB", "GiB", "TiB"], i = 0, v = bytes;
    while (v >= 1024 && i < units.length - 1) { v /= 1024; i++; }
    return (i ? v.toFixed(1) : String(v)) + " " + units[i];
  }

  function versions(item) {
    if (!item.present) return "absent";
    if (item.match === "repository") {
      return item.tags.map(function (t) {
        var name = t.tag.slice(t.tag.lastIndexOf(":") + 1);
        return name + (t.size_bytes !== null ? " (" + size(t.size_bytes) + ")" : "");
      }).join(", ") || "present";
    }
    return "present" + (item.size_bytes !== null ? " (" + size(item.size_bytes) + ")" : "") +
      (item.image_id ? " " + item.image_id.slice(0, 19) : "");
  }

  function rowOf(cell, reference) {
    var rows = cell.querySelectorAll("tr[data-image]");
    for (var i = 0; i < rows.length; i++) if (rows[i].getAttribute("data-image") === reference) return rows[i];
    return null;
  }

  function showCheck(cell, row, final) {
    var summary = cell.querySelector("[data-images-summary]");
    if (final && row.status === "pending") {
      cell.setAttribute("data-state", "no-answer");
      summary.textContent = "no answer from the node's agent (does it have the image channel?)";
      return;
    }
    if (!FINISHED[row.status]) {
      cell.setAttribute("data-state", "checking");
      summary.textContent = "checking " + row.references.length + " images… (" + row.status + ")";
      return;
    }
    if (row.status === "failed") {
      cell.setAttribute("data-state", "failed");
      summary.textContent = "check failed: " + row.error;
      return;
    }
    var items = row.result.images || [], present = 0;
    items.forEach(function (item) {
      if (item.present) present++;
      var line = rowOf(cell, item.reference);
      if (line) {
        var state = line.querySelector("[data-image-state]");
        state.textContent = versions(item);
        line.setAttribute("data-present", item.present ? "yes" : "no");
      }
    });
    cell.setAttribute("data-state", "checked");
    summary.textContent = present + "/" + row.references.length + " present";
  }

  function check(cell, spec) {
    var references = spec.watched.map(function (w) { return w.reference; });
    if (!references.length) return Promise.resolve(null);
    return api("POST", spec.check_url, { references: references })
      .then(function (row) { return follow(row, function (r) { showCheck(cell, r); }, data.check_wait_ms); })
      .then(function (row) { showCheck(cell, row, true); return row; })
      .catch(function (error) {
        cell.setAttribute("data-state", error.code === "node_offline" ? "cannot-check" : "failed");
        cell.querySelector("[data-images-summary]").textContent =
          error.code === "node_offline" ? "cannot check (offline)" : "check failed: " + error.message;
      });
  }

  function progressText(row) {
    if (row.status === "failed") return "failed: " + row.error;
    if (row.status === "completed") return "deployed";
    var p = row.progress || {}, parts = [row.status];
    if (p.layers_total) parts.push(p.layers_done + "/" + p.layers_total + " layers");
    if (p.bytes_total) parts.push(size(p.bytes_done) + " / " + size(p.bytes_total));
    if (p.message) parts.push(p.message);
    return parts.join(" · ");
  }

  function deploy(cell, spec, button) {
    var reference = button.getAttribute("data-deploy");
    var shown = button.parentNode.querySelector("[data-deploy-progress]");
    button.disabled = true;
    shown.textContent = "asking…";
    return api("POST", spec.pull_url, { reference: reference })
      .then(function (row) {
        return follow(row, function (r) {
          shown.textContent = progressText(r);
          shown.setAttribute("data-status", r.status);
        });
      })
      .then(function (row) { if (row.status === "completed") return check(cell, spec); })
      .catch(function (error) { shown.textContent = error.message; shown.setAttribute("data-status", "refused"); })
      .then(function () { button.disabled = false; });
  }

  var started = [];
  Object.keys(data.nodes).forEach(function (nodeId) {
    var spec = data.nodes[nodeId];
    if (!spec.checkable) return; // offline: marked "cannot check", never asked
    var cell = document.querySelector('td[data-images="' + CSS.escape(nodeId) + '"]');
    if (!cell) return;
    cell.addEventListener("click", function (event) {
      var button = event.target.closest("button[data-deploy]");
      if (button) deploy(cell, spec, button);
    });
    started.push(check(cell, spec));
  });
  window.heteroflowEnvironment = { checks: Promise.all(started), data: data };
})();
