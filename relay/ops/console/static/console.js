// relay console: the only script (CSP script-src 'self'). Refreshes the live part of a
// page from its JSON fragment, and ticks "select all" boxes. No other behaviour.
"use strict";
(function () {
  var main = document.getElementById("main");
  var every = main ? parseInt(main.getAttribute("data-refresh") || "0", 10) : 0;
  if (every > 0) {
    var refresh = function () {
      var live = document.getElementById("live");
      if (!live) { return; }
      fetch(live.getAttribute("data-src"), { credentials: "same-origin", cache: "no-store" })
        .then(function (r) { return r.ok ? r.json() : null; })
        .then(function (doc) {
          if (doc && typeof doc.html === "string") {
            live.innerHTML = doc.html;  // server-escaped HTML, no scripts (CSP)
            live.setAttribute("data-updated", doc.updated || "");
          }
        })
        .catch(function () { /* the next tick tries again */ });
    };
    setInterval(refresh, every * 1000);
  }
  var all = document.getElementById("select-all");
  if (all) {
    all.addEventListener("change", function () {
      var boxes = document.querySelectorAll("input[name=id]");
      for (var i = 0; i < boxes.length; i++) { boxes[i].checked = all.checked; }
    });
  }
})();
