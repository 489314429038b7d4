/* Charts over time on the overview, drawn with uPlot (vendored) from the server's own history
   (GET /api/history: a point every 10 s, kept 24 h and across restarts; the last point is live).

   `window.omlxHistory` holds the history the charts last drew, and each chart's header its
   latest values (`[data-latest=<series>]`), so what is shown can be checked. */
"use strict";

const HistoryCharts = (function () {
  const COLORS = ["#4f46e5", "#12805c", "#b54708", "#c4320a", "#0e7490"];
  const rate = (p, key) => (p.dt > 0 ? p[key] / p.dt : null);
  const hitRate = (p, tier) => {
    const looked = p.hits[tier] + p.misses[tier];
    return looked ? p.hits[tier] / looked : null;
  };

  // title, series [label, key, value(point), format], value axis format
  const CHARTS = [
    ["Requests per second", [["requests/s", "requests", (p) => rate(p, "requests"), (v) => fmt.num(v, 2)]], (v) => fmt.num(v, 2)],
    ["Tokens per second", [
      ["generated", "generation_tokens", (p) => rate(p, "generation_tokens"), (v) => fmt.num(v)],
      ["prompt", "prompt_tokens", (p) => rate(p, "prompt_tokens"), (v) => fmt.num(v)],
    ], (v) => fmt.num(v, 0)],
    ["Time to first token", [
      ["p50", "ttft_p50", (p) => p.ttft_p50, fmt.secs],
      ["p95", "ttft_p95", (p) => p.ttft_p95, fmt.secs],
    ], fmt.secs],
    ["Cache hit rate (blocks)", [
      ["hot", "hit_hot", (p) => hitRate(p, "hot"), (v) => fmt.pct(v)],
      ["RAM", "hit_ram", (p) => hitRate(p, "ram"), (v) => fmt.pct(v)],
      ["SSD", "hit_ssd", (p) => hitRate(p, "ssd"), (v) => fmt.pct(v)],
    ], (v) => fmt.pct(v, 0)],
    ["Memory", [
      ["process", "mem_process", (p) => p.bytes.process, fmt.bytes],
      ["models", "mem_models", (p) => p.bytes.models, fmt.bytes],
      ["hot tier", "mem_hot", (p) => p.bytes.hot, fmt.bytes],
      ["RAM tier", "mem_ram", (p) => p.bytes.ram, fmt.bytes],
      ["SSD tier", "mem_ssd", (p) => p.bytes.ssd, fmt.bytes],
    ], fmt.bytes],
  ];

  function latest(points, value) {
    for (let i = points.length - 1; i >= 0; i--) {
      const v = value(points[i]);
      if (v !== null && v !== undefined) return v;
    }
    return null;
  }

  function create(container) {
    const charts = CHARTS.map(([title, series, axisFmt]) => {
      const head = h("div.chart-head", h("span.chart-title", title),
        h("span.chart-latest", series.map(([label, key], i) => h("span.chart-value",
          h("span.chart-swatch", { style: { background: COLORS[i] } }), `${label} `,
          h("strong", { "data-latest": key }, "—")))));
      const box = h("div.chart-box");
      append(container, [h("div.chart", head, box)]);
      const plot = new uPlot({
        width: 400, height: 150, legend: { show: false }, cursor: { drag: { x: false, y: false } },
        scales: { x: { time: true } },
        axes: [{ stroke: "#667085", grid: { stroke: "#eef0f4" } },
          { stroke: "#667085", grid: { stroke: "#eef0f4" }, size: 64, values: (u, vals) => vals.map(axisFmt) }],
        series: [{}, ...series.map(([label], i) => ({ label, stroke: COLORS[i], width: 1.5, spanGaps: false }))],
      }, [[], ...series.map(() => [])], box);
      return { head, box, plot, series };
    });

    function resize() {
      for (const c of charts) {
        const w = c.box.clientWidth;
        if (w > 0) c.plot.setSize({ width: w, height: 150 });
      }
    }
    window.addEventListener("resize", resize);

    async function refresh() {
      const history = await api("GET", "/api/history");
      window.omlxHistory = history;
      const pts = history.points;
      const xs = pts.map((p) => p.t);
      for (const c of charts) {
        c.plot.setData([xs, ...c.series.map(([, , value]) => pts.map(value))]);
        for (const [, key, value, format] of c.series) {
          const v = latest(pts, value);
          c.head.querySelector(`[data-latest=${key}]`).textContent = v === null ? "—" : format(v);
        }
      }
      resize();
      return history;
    }

    return { refresh, destroy: () => { window.removeEventListener("resize", resize); charts.forEach((c) => c.plot.destroy()); } };
  }

  return { create };
})();
