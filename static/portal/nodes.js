// The nodes page's refresh (apps/portal/pages/nodes.py: node_list, node_cards). Every 30 s
// while the tab is visible it reads the page's parts for the page's own query string
// (search, order, page) and puts them in place, without a reload: a card that changed is
// replaced by the server's rendering of it, new cards are inserted where the order puts
// them, gone ones removed; the summary strip, the agent versions and the pagination
// likewise. Nothing else is touched, so the search box and the keyboard focus stay (a
// replaced card that had the focus gets it back), and the cards in view stay where they
// are in the window when what is above them grows or shrinks. A hidden tab
// skips its ticks and catches up when it is shown again. A read that fails leaves what is
// shown, says since when it is stale, and the next tick tries again.
(function () {
  "use strict";
  var source = document.getElementById("nodes-refresh");
  var box = document.getElementById("node-cards");
  if (!source || !box) return;
  var config = JSON.parse(source.textContent);
  var period = config.seconds * 1000;
  var note = document.getElementById("nodes-updated");
  var regions = {
    strip: document.getElementById("nodes-strip"),
    fleet: document.getElementById("agent-fleet"),
    pagination: document.getElementById("nodes-pagination"),
  };
  var shownAt = new Date(note.dataset.renderedAt);  // when the figures shown were read
  var lastTry = Date.now();
  var staleSince = null;
  var pending = null;

  function clock(date) { return date.toLocaleTimeString(); }
  function squeezed(html) { return html.replace(/\s+/g, " ").trim(); }
  function parsed(html) {
    var template = document.createElement("template");
    template.innerHTML = html.trim();
    return template.content;
  }

  function say(text, stale) {
    note.textContent = text;
    note.classList.toggle("stale", !!stale);
    box.classList.toggle("stale-data", !!stale);
    if (stale) note.dataset.staleSince = staleSince.toISOString();
    else delete note.dataset.staleSince;
  }

  // compared as the browser writes both out (it spells attributes its own way)
  function serialised(fragment) {
    var box = document.createElement("div");
    box.appendChild(fragment.cloneNode(true));
    return squeezed(box.innerHTML);
  }

  function setRegion(region, html) {
    var fresh = parsed(html);
    if (region && squeezed(region.innerHTML) !== serialised(fresh)) region.replaceChildren(fresh);
  }

  function setCards(nodes) {
    var focused = document.activeElement;
    var focusedCard = focused && box.contains(focused) ? focused.closest("[data-node]") : null;
    var existing = {};
    box.querySelectorAll(":scope > [data-node]").forEach(function (card) { existing[card.dataset.node] = card; });
    var wanted = nodes.map(function (node) {
      var card = existing[node.id];
      var fresh = parsed(node.html).firstElementChild;
      if (card && squeezed(card.outerHTML) === squeezed(fresh.outerHTML)) return card;  // unchanged: left as it is
      return fresh;
    });
    var keep = new Set(wanted);
    Array.from(box.children).forEach(function (child) { if (!keep.has(child)) child.remove(); });
    wanted.forEach(function (card, i) {
      if (box.children[i] !== card) box.insertBefore(card, box.children[i] || null);
    });
    document.getElementById("node-cards-empty").hidden = nodes.length > 0;
    if (focusedCard && !focusedCard.isConnected) {
      var again = box.querySelector('[data-node="' + CSS.escape(focusedCard.dataset.node) + '"]');
      if (again) again.focus({ preventScroll: true });
    }
  }

  // where the view is: the first card in the window (else the cards' box) and how far
  // down the window it sits, so the view can be kept on it when what is above changes
  function viewAnchor() {
    var cards = box.querySelectorAll(":scope > [data-node]");
    for (var i = 0; i < cards.length; i++) {
      var rect = cards[i].getBoundingClientRect();
      if (rect.bottom > 0) return { id: cards[i].dataset.node, top: rect.top, boxTop: box.getBoundingClientRect().top };
    }
    return { id: null, boxTop: box.getBoundingClientRect().top };
  }

  function keepView(anchor) {
    if (window.scrollY === 0) return;  // at the top of the page: nothing to keep
    var card = anchor.id ? box.querySelector('[data-node="' + CSS.escape(anchor.id) + '"]') : null;
    var moved = card ? card.getBoundingClientRect().top - anchor.top : box.getBoundingClientRect().top - anchor.boxTop;
    if (moved) window.scrollBy(0, moved);
  }

  function apply(body) {
    var anchor = viewAnchor();
    setCards(body.nodes);
    setRegion(regions.strip, body.html.strip);
    setRegion(regions.fleet, body.html.fleet);
    setRegion(regions.pagination, body.html.pagination);
    keepView(anchor);
    shownAt = new Date(body.at);
    staleSince = null;
    say("Updated " + clock(shownAt) + "; refreshes every " + config.seconds + " s.", false);
  }

  function failed(error) {
    staleSince = staleSince || new Date();
    say("Stale since " + clock(staleSince) + ": could not refresh (" + error.message + "). " +
        "Showing the nodes as of " + clock(shownAt) + "; trying again every " + config.seconds + " s.", true);
  }

  function refresh() {
    if (pending) return pending;
    lastTry = Date.now();
    pending = fetch(config.url + window.location.search, { credentials: "same-origin", headers: { Accept: "application/json" } })
      .then(function (response) {
        var json = (response.headers.get("Content-Type") || "").indexOf("application/json") === 0;
        if (!response.ok || !json) throw new Error(response.ok ? "not signed in" : "HTTP " + response.status);
        return response.json();
      })
      .then(apply, failed)
      .finally(function () { pending = null; });
    return pending;
  }

  say("As of " + clock(shownAt) + "; refreshes every " + config.seconds + " s.", false);
  setInterval(function () { if (!document.hidden) refresh(); }, period);
  document.addEventListener("visibilitychange", function () {
    // a hidden tab skips its ticks; coming back after one was skipped refreshes at once
    if (!document.hidden && Date.now() - lastTry >= period) refresh();
  });

  window.heteroflowNodes = { refresh: refresh };
})();
