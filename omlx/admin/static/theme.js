/* The dashboard's theme: auto (follows the system), light or dark, kept in localStorage; the
   topbar's button cycles through them. app.css reads `data-theme` on <html>. */
"use strict";

const Theme = (function () {
  const KEY = "omlx.theme";
  const MODES = ["auto", "light", "dark"];
  const media = window.matchMedia("(prefers-color-scheme: dark)");

  function mode() {
    const m = localStorage.getItem(KEY);
    return MODES.includes(m) ? m : "auto";
  }

  function apply() {
    const m = mode();
    const root = document.documentElement;
    root.dataset.theme = m === "dark" || (m === "auto" && media.matches) ? "dark" : "light";
    root.dataset.themeMode = m;
    const btn = document.getElementById("theme");
    if (btn) btn.textContent = T(`theme.${m}`);
  }

  function set(m) {
    localStorage.setItem(KEY, m);
    apply();
  }

  media.addEventListener("change", apply);
  const btn = document.getElementById("theme");
  if (btn) btn.addEventListener("click", () => set(MODES[(MODES.indexOf(mode()) + 1) % MODES.length]));
  apply();
  return { mode, set };
})();
