// The portal's menu (templates/portal/base.html). Each group is a <details>, which opens
// and closes by mouse, touch and keyboard (Enter or Space on its summary) without this
// script. The script makes it behave as a menu is expected to: one group open at a time,
// a click elsewhere or moving the focus out of a group closes it, and Escape closes it
// and gives the focus back to its summary.
"use strict";
(() => {
  const groups = Array.from(document.querySelectorAll(".menus details.menu"));
  if (!groups.length) return;

  const close = (group, refocus) => {
    if (!group.open) return;
    group.open = false;
    if (refocus) group.querySelector("summary").focus();
  };

  groups.forEach((group) => {
    group.addEventListener("toggle", () => {
      if (group.open) groups.forEach((other) => { if (other !== group) close(other, false); });
    });
    group.addEventListener("keydown", (event) => {
      if (event.key === "Escape" && group.open) {
        event.preventDefault();
        close(group, true);
      }
    });
    group.addEventListener("focusout", (event) => {
      // the focus went somewhere outside the group (Tab past its last item); a click on
      // the page's background has no target and is handled by the click below
      if (event.relatedTarget && !group.contains(event.relatedTarget)) close(group, false);
    });
  });

  document.addEventListener("click", (event) => {
    groups.forEach((group) => { if (!group.contains(event.target)) close(group, false); });
  });
})();
