/* Overview: server status, device and memory, loaded models, counters, prefix cache, and
   charts over time (charts.js). */
"use strict";

App.page("overview", {
  title: "Overview",
  async render(view, ctx, actions) {
    const live = h("span.badge.ok", "live");
    append(actions, [live]);
    const body = h("div.stack");
    const chartGrid = h("div.chart-grid");
    append(view, [h("div.stack", body, panel("Over time (24 h, kept across restarts)", h("div.panel-body", chartGrid)))]);
    const charts = HistoryCharts.create(chartGrid);
    ctx.onLeave(charts.destroy);
    ctx.every(10000, charts.refresh);

    ctx.every(3000, async () => {
      const [sys, status, models, cache] = await Promise.all([
        api("GET", "/api/system"),
        api("GET", "/api/status"),
        api("GET", "/v1/models/status"),
        api("GET", "/api/cache/stats"),
      ]);
      if (!ctx.alive) return;
      replace(body, cards(sys, status, cache), h("div.grid-2", modelsPanel(models.data), cachePanel(cache)),
        countersPanel(sys.counters));
    });
  },
});

function cards(sys, status, cache) {
  const mem = sys.memory;
  const used = mem.total_bytes - mem.available_bytes;
  const loaded = status.models.filter((m) => m.state !== "unloaded");
  const dev = sys.device || {};
  const devName = dev.device_name || dev.name || dev.device || "—";
  const c = sys.counters;
  return h("div.cards",
    h("div.card", h("div.card-label", "Server"),
      h("div.card-value", h("span.badge.ok", "running")),
      h("div.card-sub", `Up ${fmt.duration(status.uptime_s)} · v${status.version}`),
      h("div.card-sub", `${sys.host}:${sys.port} · ${sys.auth_required ? "API key required" : "no API key"}`)),
    h("div.card", h("div.card-label", "Device"),
      h("div.card-value", (dev.type || "—").toUpperCase()),
      h("div.card-sub", devName)),
    h("div.card", h("div.card-label", "Memory"),
      h("div.card-value", `${fmt.bytes(used)}`, h("span.muted.small", ` / ${fmt.bytes(mem.total_bytes)}`)),
      bar(used / mem.total_bytes, used / mem.total_bytes > 0.9 ? "warn" : ""),
      h("div.card-sub", `Models ${fmt.bytes(mem.models_bytes)}${mem.models_limit_bytes ? ` of ${fmt.bytes(mem.models_limit_bytes)} limit` : ""} · process ${fmt.bytes(mem.process_rss_bytes)}`)),
    h("div.card", h("div.card-label", "Models"),
      h("div.card-value", `${loaded.length}`, h("span.muted.small", ` loaded of ${status.models.length}`)),
      h("div.card-sub", `${status.active_requests} active · ${status.waiting_requests} waiting requests`)),
    h("div.card", h("div.card-label", "Requests"),
      h("div.card-value", fmt.int(c.requests)),
      h("div.card-sub", `avg TTFT ${fmt.secs(c.avg_ttft_s)} · last decode ${c.last_decode_tps ? fmt.num(c.last_decode_tps) + " tok/s" : "—"}`)),
    h("div.card", h("div.card-label", "Cache hit rate"),
      h("div.card-value", cache.enabled ? fmt.pct(cache.hit_rate || 0) : "off"),
      h("div.card-sub", cache.enabled ? `${fmt.int(cache.hit_tokens)} of ${fmt.int(cache.prompt_tokens)} prompt tokens restored` : "Prefix cache disabled")),
  );
}

function modelsPanel(models) {
  const rows = models.filter((m) => m.state !== "unloaded");
  const table = rows.length
    ? h("table",
        h("thead", h("tr", h("th", "Model"), h("th", "State"), h("th.num", "Memory"), h("th.num", "Active"), h("th.nowrap", "Last used"))),
        h("tbody", rows.map((m) => h("tr",
          h("td.nowrap", h("span.mono", m.id), m.pinned ? h("span.badge.accent.plain", { style: { marginLeft: "8px" } }, "pinned") : null),
          h("td", stateBadge(m.state)),
          h("td.num", fmt.bytes(m.memory_bytes)),
          h("td.num", m.waiting_requests ? `${m.active_requests} (+${m.waiting_requests} waiting)` : m.active_requests),
          h("td.muted.nowrap", fmt.ago(m.last_used))))))
    : h("div.empty", "No model is loaded. Models load on their first request, or from the Models page.");
  return panel("Loaded models", h("div.panel-body.flush", table), [h("a.btn.btn-small", { href: "#/models" }, "All models")]);
}

function tier(label, t) {
  if (!t || t.enabled === false) return h("div", h("div.bar-label", h("span", label), h("span", "off")), bar(0));
  const frac = t.max_bytes ? t.bytes / t.max_bytes : 0;
  return h("div",
    h("div.bar-label", h("span", `${label} · ${fmt.int(t.blocks)} blocks`), h("span", `${fmt.bytes(t.bytes)} / ${fmt.bytes(t.max_bytes)}`)),
    bar(frac, "ok"),
    h("div.small.muted", { style: { marginTop: "4px" } },
      `${fmt.int(t.hits)} hits · ${fmt.int(t.misses)} misses · ${fmt.int(t.evictions)} evictions` +
      (t.writes !== undefined ? ` · ${fmt.int(t.writes)} writes · queue ${t.queue_depth}` : "")));
}

function cachePanel(cache) {
  if (!cache.enabled) return panel("Prefix cache", h("div.panel-body", h("div.muted", "The prefix cache is off (--no-cache).")));
  return panel("Prefix cache", h("div.panel-body.stack",
    h("dl.kv",
      h("dt", "Requests"), h("dd", `${fmt.int(cache.requests)} (${fmt.int(cache.hits)} hits, ${fmt.int(cache.misses)} misses)`),
      h("dt", "Hit rate (tokens)"), h("dd", fmt.pct(cache.hit_rate || 0)),
      h("dt", "Block size"), h("dd", `${cache.block_size} tokens`)),
    tier("Hot tier", cache.hot),
    ...(cache.warm && cache.warm.enabled !== false ? [tier("RAM tier", cache.warm)] : []),
    tier("SSD tier", cache.ssd)));
}

function countersPanel(c) {
  const models = Object.entries(c.models || {});
  const row = (name, m) => h("tr",
    h("td", name === "All models" ? h("strong", name) : h("span.mono", name)),
    h("td.num", fmt.int(m.requests)),
    h("td.num", fmt.int(m.prompt_tokens)),
    h("td.num", fmt.int(m.cached_tokens)),
    h("td.num", fmt.int(m.completion_tokens)),
    h("td.num", fmt.secs(m.avg_ttft_s)),
    h("td.num", m.last_decode_tps ? fmt.num(m.last_decode_tps) : "—"));
  return panel("Requests and tokens since start", h("div.panel-body.flush",
    h("table",
      h("thead", h("tr", h("th", "Model"), h("th.num", "Requests"), h("th.num", "Prompt tokens"), h("th.num", "Cached tokens"),
        h("th.num", "Completion tokens"), h("th.num", "Avg TTFT"), h("th.num", "Last tok/s"))),
      h("tbody", models.map(([id, m]) => row(id, m)), row("All models", c)))));
}
