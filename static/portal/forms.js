// The portal's form behaviours, without inline event handlers (the Content-Security-Policy
// allows no inline script): a form with data-confirm asks before it is sent; a select with
// data-autosubmit sends its form when it changes.
"use strict";
document.addEventListener("submit", (event) => {
  const message = event.target.dataset ? event.target.dataset.confirm : undefined;
  if (message && !window.confirm(message)) event.preventDefault();
});
document.addEventListener("change", (event) => {
  const field = event.target;
  if (field.matches && field.matches("select[data-autosubmit]") && field.form) field.form.requestSubmit();
});
