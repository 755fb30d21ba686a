/* The portal's terminal: xterm.js on the exec WebSocket (docs/tunnel.md#protocol).
   Before each connection a ticket is asked for under the page's session (a browser
   cannot give a WebSocket an Authorization header); the socket then carries frames: a
   type byte and its payload (0 stdin, 1 stdout, 2 stderr, 3 resize [cols, rows],
   5 exit {"status"}). */
(function () {
  "use strict";
  var box = document.getElementById("terminal");
  if (!box) return;
  var STDIN = 0, STDOUT = 1, STDERR = 2, RESIZE = 3, EXIT = 5;
  var statusLine = document.getElementById("terminal-status");
  var again = document.getElementById("terminal-again");
  var csrf = document.querySelector("input[name=csrfmiddlewaretoken]").value;
  var encoder = new TextEncoder();
  var decoder = new TextDecoder();
  var term = new Terminal({ cursorBlink: true, fontSize: 14, scrollback: 5000, convertEol: false });
  var fit = new FitAddon.FitAddon();
  term.loadAddon(fit);
  term.open(box);
  fit.fit();
  var socket = null;
  var ended = false;

  function say(text, kind) {
    statusLine.textContent = text;
    statusLine.className = "terminal-status" + (kind ? " " + kind : "");
    box.setAttribute("data-state", kind || "connecting");
  }

  function frame(type, payload) {
    var out = new Uint8Array(1 + payload.length);
    out[0] = type;
    out.set(payload, 1);
    return out;
  }

  function send(type, payload) {
    if (socket && socket.readyState === WebSocket.OPEN) socket.send(frame(type, payload));
  }

  function offerAgain(text) {
    say(text, "error");
    again.hidden = false;
  }

  function connect() {
    again.hidden = true;
    ended = false;
    say("Connecting…");
    fetch(box.getAttribute("data-ticket-url"), {
      method: "POST",
      headers: { "X-CSRFToken": csrf, Accept: "application/json" },
      credentials: "same-origin",
    })
      .then(function (answer) {
        return answer.json().then(function (body) {
          if (!answer.ok) throw new Error((body.error && body.error.message) || "Refused (" + answer.status + ").");
          return body.ticket;
        });
      })
      .then(open, function (error) {
        offerAgain(error.message || "The control plane could not be reached.");
      });
  }

  function open(ticket) {
    var url = new URL(box.getAttribute("data-exec-url"), window.location.href);
    url.protocol = window.location.protocol === "https:" ? "wss:" : "ws:";
    url.searchParams.set("ticket", ticket);
    url.searchParams.set("tty", "1");
    url.searchParams.set("term", "xterm-256color");
    url.searchParams.set("cols", String(term.cols));
    url.searchParams.set("rows", String(term.rows));
    socket = new WebSocket(url.toString());
    socket.binaryType = "arraybuffer";
    socket.onopen = function () {
      say("Connected", "open");
      term.focus();
    };
    socket.onmessage = function (event) {
      var data = new Uint8Array(event.data);
      if (!data.length) return;
      if (data[0] === STDOUT || data[0] === STDERR) {
        term.write(data.subarray(1));
      } else if (data[0] === EXIT) {
        ended = true;
        var status = JSON.parse(decoder.decode(data.subarray(1))).status;
        offerAgain("The shell ended (exit status " + status + ").");
      }
    };
    socket.onclose = function (event) {
      if (ended) return;
      offerAgain(event.reason || "The connection closed (the task ended, or its node is away).");
    };
  }

  term.onData(function (text) {
    send(STDIN, encoder.encode(text));
  });
  term.onResize(function (size) {
    send(RESIZE, encoder.encode(JSON.stringify([size.cols, size.rows])));
  });
  window.addEventListener("resize", function () {
    fit.fit();
  });
  again.addEventListener("click", connect);
  connect();
})();
