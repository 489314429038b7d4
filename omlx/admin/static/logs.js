/* Logs: a live tail of the server's in-memory log (the last 2000 lines). */
"use strict";

App.page("logs", {
  title: "Logs",
  async render(view, ctx) {
    const LEVELS = { DEBUG: 10, INFO: 20, WARNING: 30, ERROR: 40, CRITICAL: 50 };
    const level = h("select", { name: "level" },
      [["DEBUG", "All levels"], ["INFO", "Info and above"], ["WARNING", "Warnings and errors"], ["ERROR", "Errors"]]
        .map(([v, label]) => h("option", { value: v }, label)));
    const filter = h("input", { type: "search", name: "filter", placeholder: "Filter text" });
    const follow = h("input", { type: "checkbox", checked: true, name: "follow" });
    const paused = h("input", { type: "checkbox", name: "paused" });
    const box = h("div.logbox", { "data-logs": "1" });
    const count = h("span.muted.small");
    let lines = [];
    let after = 0;

    const visible = (l) => LEVELS[l.level] >= LEVELS[level.value] &&
      (!filter.value || `${l.logger} ${l.message}`.toLowerCase().includes(filter.value.toLowerCase()));
    const lineEl = (l) => h("div.logline",
      h("span.t", fmt.time(l.time)), h("span.lv", { class: `lv-${l.level}` }, l.level),
      h("span.lg", l.logger), l.message);

    function redraw() {
      const shown = lines.filter(visible);
      replace(box, shown.length ? shown.map(lineEl) : h("div.logline.muted", "No log lines match."));
      count.textContent = `${shown.length} of ${lines.length} lines`;
      if (follow.checked) box.scrollTop = box.scrollHeight;
    }
    level.addEventListener("change", redraw);
    filter.addEventListener("input", redraw);

    append(view, [h("div.panel",
      h("div.panel-head",
        h("div.row", h("div", level), h("div", filter), h("label.check", follow, "Follow"), h("label.check", paused, "Pause")),
        h("div.row", count, button("Clear view", () => { lines = []; redraw(); }, "btn-small"))),
      box)]);

    ctx.every(1500, async () => {
      if (paused.checked) return;
      const r = await api("GET", `/api/logs?after=${after}&limit=2000`);
      if (!ctx.alive || !r.lines.length) { if (!lines.length) redraw(); return; }
      after = r.last;
      lines = lines.concat(r.lines).slice(-2000);
      const atBottom = box.scrollHeight - box.scrollTop - box.clientHeight < 40;
      redraw();
      if (atBottom || follow.checked) box.scrollTop = box.scrollHeight;
    });
  },
});
