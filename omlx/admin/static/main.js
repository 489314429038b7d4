/* oMLX dashboard: login, hash router and page lifecycle. */
"use strict";

(function () {
  const view = document.getElementById("view");
  const title = document.getElementById("page-title");
  const actions = document.getElementById("page-actions");
  let current = null;

  function makeCtx() {
    const timers = [];
    const cleanups = [];
    return {
      alive: true,
      every(ms, fn) {
        if (!this.alive) return;  // the user left while the page was still loading
        const tick = async () => {
          try { await fn(); } catch (err) { if (err.status !== 401) console.warn(err); }
        };
        timers.push(setInterval(tick, ms));
        tick();
      },
      onLeave(fn) { cleanups.push(fn); },
      leave() {
        this.alive = false;
        timers.forEach(clearInterval);
        cleanups.forEach((fn) => fn());
      },
    };
  }

  async function route() {
    const name = (location.hash.replace(/^#\/?/, "").split("?")[0]) || "overview";
    const page = App.pages[name] || App.pages.overview;
    const key = App.pages[name] ? name : "overview";
    if (current) current.leave();
    current = makeCtx();
    document.querySelectorAll(".nav a").forEach((a) => a.classList.toggle("active", a.dataset.page === key));
    title.textContent = page.title;
    document.title = `${page.title} · oMLX`;
    // Each visit renders into its own containers, so a page still loading when the user
    // moves on cannot draw into the next one.
    const body = h("div.contents");
    const buttons = h("div.contents");
    replace(actions, buttons);
    replace(view, body);
    view.dataset.page = key;
    const ctx = current;
    try {
      await page.render(body, ctx, buttons);
    } catch (err) {
      if (err.status !== 401 && ctx.alive) append(body, [h("div.notice.warn", `Could not load this page: ${err.message}`)]);
    }
  }

  App.showLogin = function () {
    if (current) { current.leave(); current = null; }
    document.getElementById("shell").classList.add("hidden");
    document.getElementById("login").classList.remove("hidden");
    document.getElementById("login-key").focus();
  };

  async function showShell() {
    document.getElementById("login").classList.add("hidden");
    document.getElementById("shell").classList.remove("hidden");
    document.getElementById("logout").classList.toggle("hidden", !App.session.auth_required);
    try {
      const sys = await api("GET", "/api/system");
      App.system = sys;
      document.getElementById("server-line").textContent = `v${sys.version} · ${sys.host}:${sys.port}`;
    } catch (_) { /* shown by the pages */ }
    await route();
  }

  document.getElementById("login-form").addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const input = document.getElementById("login-key");
    const err = document.getElementById("login-error");
    const btn = document.getElementById("login-submit");
    err.textContent = "";
    btn.disabled = true;
    try {
      App.session = await api("POST", "/api/auth/login", { api_key: input.value }, { noLoginRedirect: true });
      input.value = "";
      await showShell();
    } catch (e) {
      err.textContent = e.status === 401 ? "That key is not right." : e.message;
    } finally {
      btn.disabled = false;
    }
  });

  document.getElementById("logout").addEventListener("click", async () => {
    await api("POST", "/api/auth/logout", {});
    App.session = { auth_required: true, authenticated: false };
    App.showLogin();
  });

  window.addEventListener("hashchange", () => {
    if (!document.getElementById("shell").classList.contains("hidden")) route();
  });

  (async function start() {
    try {
      App.session = await api("GET", "/api/auth/session", undefined, { noLoginRedirect: true });
    } catch (e) {
      App.session = { auth_required: false, authenticated: true };
    }
    if (App.session.authenticated) await showShell();
    else App.showLogin();
  })();
})();
