// keyq console: refresh the overview in place, and ask before actions that cannot be undone.
// Everything drawn comes from the server already escaped; this file inserts no text of its own.
"use strict";

function refresh(box) {
  const every = Number(box.dataset.every || 2000);
  const tick = async () => {
    if (document.hidden) {
      setTimeout(tick, every); // a tab nobody looks at asks nothing
      return;
    }
    try {
      const answer = await fetch(box.dataset.refresh, { credentials: "same-origin" });
      if (answer.ok) {
        box.innerHTML = await answer.text();
        box.classList.remove("stale");
      } else {
        box.classList.add("stale");
      }
    } catch (error) {
      box.classList.add("stale");
    }
    setTimeout(tick, every);
  };
  setTimeout(tick, every);
}

document.addEventListener("DOMContentLoaded", () => {
  document.querySelectorAll("[data-refresh]").forEach(refresh);
  document.querySelectorAll("form[data-confirm]").forEach((form) => {
    form.addEventListener("submit", (event) => {
      if (!window.confirm(form.dataset.confirm)) event.preventDefault();
    });
  });
});
