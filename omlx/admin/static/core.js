/* oMLX dashboard core: API calls, DOM helpers, formatting, toasts, modals, the page registry. */
"use strict";

const App = {
  pages: {},
  session: { auth_required: false, authenticated: true },
};

class ApiError extends Error {
  constructor(message, status, body) {
    super(message);
    this.status = status;
    this.body = body;
  }
}

/* Every call carries the X-OMLX-Admin header: the server requires it on state changes made
   with the session cookie (a cross-site page cannot send it). */
async function api(method, path, body, opts = {}) {
  const init = { method, credentials: "same-origin", headers: { "X-OMLX-Admin": "1" }, signal: opts.signal };
  if (body !== undefined) {
    init.headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  const resp = await fetch(path, init);
  let data = null;
  const text = await resp.text();
  if (text) {
    try { data = JSON.parse(text); } catch (_) { data = { raw: text }; }
  }
  if (resp.status === 401 && App.session.auth_required && !opts.noLoginRedirect) {
    App.showLogin();
  }
  if (!resp.ok) {
    const msg = (data && data.error && (data.error.message || data.error)) || `${resp.status} ${resp.statusText}`;
    throw new ApiError(String(msg), resp.status, data);
  }
  return data;
}

/* h("div.cls#id", {attr}, children...) — builds elements without innerHTML. */
function h(spec, attrs, ...children) {
  const m = /^([a-z0-9]+)?((?:[.#][\w-]+)*)$/i.exec(spec) || [];
  const el = document.createElement(m[1] || "div");
  for (const part of (m[2] || "").match(/[.#][\w-]+/g) || []) {
    if (part[0] === ".") el.classList.add(part.slice(1));
    else el.id = part.slice(1);
  }
  if (attrs !== null && attrs !== undefined && (typeof attrs !== "object" || attrs instanceof Node || Array.isArray(attrs))) {
    children.unshift(attrs);
    attrs = null;
  }
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k.startsWith("on") && typeof v === "function") el.addEventListener(k.slice(2), v);
    else if (k === "class") el.className += (el.className ? " " : "") + v;
    else if (k === "style" && typeof v === "object") Object.assign(el.style, v);
    else if (k in el && typeof v !== "string") el[k] = v;
    else el.setAttribute(k, v === true ? "" : v);
  }
  append(el, children);
  return el;
}

function append(el, children) {
  for (const c of children.flat(Infinity)) {
    if (c === null || c === undefined || c === false) continue;
    el.appendChild(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return el;
}

function clear(el) {
  while (el.firstChild) el.removeChild(el.firstChild);
  return el;
}

function replace(el, ...children) {
  return append(clear(el), children);
}

/* ----- formatting ---------------------------------------------------------------- */
const fmt = {
  bytes(n) {
    if (n === null || n === undefined || isNaN(n)) return "—";
    const units = ["B", "KB", "MB", "GB", "TB"];
    let i = 0;
    let v = Number(n);
    while (v >= 1024 && i < units.length - 1) { v /= 1024; i++; }
    return `${v >= 100 || i === 0 ? v.toFixed(0) : v.toFixed(1)} ${units[i]}`;
  },
  int(n) {
    if (n === null || n === undefined) return "—";
    return Number(n).toLocaleString("en-US");
  },
  num(n, digits = 1) {
    if (n === null || n === undefined || isNaN(n)) return "—";
    return Number(n).toFixed(digits);
  },
  pct(x, digits = 1) {
    if (x === null || x === undefined || isNaN(x)) return "—";
    return `${(x * 100).toFixed(digits)}%`;
  },
  secs(s) {
    if (s === null || s === undefined) return "—";
    if (s < 1) return `${Math.round(s * 1000)} ms`;
    return `${s.toFixed(2)} s`;
  },
  duration(s) {
    s = Math.floor(s || 0);
    const d = Math.floor(s / 86400), hh = Math.floor((s % 86400) / 3600), mm = Math.floor((s % 3600) / 60);
    if (d) return `${d}d ${hh}h ${mm}m`;
    if (hh) return `${hh}h ${mm}m`;
    if (mm) return `${mm}m ${s % 60}s`;
    return `${s}s`;
  },
  ago(ts) {
    if (!ts) return "—";
    return `${fmt.duration(Date.now() / 1000 - ts)} ago`;
  },
  time(ts) {
    const d = new Date(ts * 1000);
    return d.toTimeString().slice(0, 8);
  },
};

function badge(text, kind = "") {
  return h("span.badge", { class: kind }, text);
}

const STATE_KIND = {
  loaded: "ok", serving: "info", loading: "warn", unloaded: "",
  completed: "ok", downloading: "info", preparing: "warn", queued: "", failed: "err", cancelled: "",
  running: "info", idle: "",
};

function stateBadge(state) {
  return badge(state || "—", STATE_KIND[state] || "");
}

function bar(fraction, kind = "") {
  const fill = h("span");
  fill.style.width = `${Math.max(0, Math.min(1, fraction || 0)) * 100}%`;
  return h("div.bar", { class: kind }, fill);
}

function panel(title, body, actions) {
  return h("div.panel",
    h("div.panel-head", h("h2", title), actions ? h("div.btn-group", actions) : null),
    body);
}

function button(label, onclick, kind = "", attrs = {}) {
  return h("button.btn", { type: "button", class: kind, onclick, ...attrs }, label);
}

/* Disable a button while its async action runs; errors become toasts. */
function busy(fn) {
  return async (ev) => {
    const btn = ev && ev.currentTarget;
    if (btn) btn.disabled = true;
    try {
      await fn(ev);
    } catch (err) {
      toast(err.message || String(err), "err");
    } finally {
      if (btn) btn.disabled = false;
    }
  };
}

function toast(message, kind = "") {
  const el = h("div.toast", { class: kind, role: "status" }, message);
  document.getElementById("toasts").appendChild(el);
  setTimeout(() => el.remove(), kind === "err" ? 6000 : 3000);
}

function modal(title, body, footButtons, opts = {}) {
  const close = () => back.remove();
  const foot = h("div.modal-foot", footButtons ? footButtons(close) : button("Close", close));
  const box = h("div.modal", { class: opts.narrow ? "narrow" : "", role: "dialog", "aria-label": title },
    h("div.modal-head", h("h3", title), button("✕", close, "btn-ghost btn-small", { "aria-label": "Close" })),
    h("div.modal-body", body),
    foot);
  const back = h("div.modal-back", { onclick: (e) => { if (e.target === back) close(); } }, box);
  document.body.appendChild(back);
  return { close, box };
}

function confirmBox(message, okLabel = "Delete") {
  return new Promise((resolve) => {
    modal("Please confirm", h("p", message), (close) => [
      button("Cancel", () => { close(); resolve(false); }),
      button(okLabel, () => { close(); resolve(true); }, "btn-primary", { "data-confirm": "yes" }),
    ], { narrow: true });
  });
}

function field(label, input, hint) {
  return h("label.field", h("span", label), input, hint ? h("span.hint", hint) : null);
}

function switchInput(checked, onchange, attrs = {}) {
  const input = h("input", { type: "checkbox", checked: !!checked, onchange, ...attrs });
  return h("label.switch", input, h("span"));
}

/* Pages register with App.page(name, {title, render(view, ctx), actions?}). ctx.every()
   timers stop when the user leaves the page. */
App.page = function (name, def) {
  App.pages[name] = def;
};

App.models = async function () {
  const [list, status] = await Promise.all([api("GET", "/v1/models"), api("GET", "/v1/models/status")]);
  const byId = Object.fromEntries(status.data.map((m) => [m.id, m]));
  return list.data.map((m) => ({ ...m, ...(byId[m.id] || {}) }));
};
