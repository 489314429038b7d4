/* Benchmark: a server-side throughput run, cold then warm (prefix cache), with live progress. */
"use strict";

App.page("bench", {
  title: "Benchmark",
  async render(view, ctx) {
    const models = (await App.models()).filter((m) => m.type === "llm");
    const model = h("select", { name: "model" }, models.map((m) => h("option", { value: m.id }, m.id)));
    const loaded = models.find((m) => m.state !== "unloaded");
    if (loaded) model.value = loaded.id;
    const num = (name, value, min, max) => h("input", { type: "number", name, value, min, max, step: "1" });
    const promptTokens = num("prompt_tokens", 512, 1, 131072);
    const maxTokens = num("max_tokens", 128, 1, 8192);
    const concurrency = num("concurrency", 1, 1, 64);
    const error = h("div.form-error");
    const run = button("Run benchmark", busy(async () => {
      error.textContent = "";
      try {
        await api("POST", "/api/bench", {
          model: model.value,
          prompt_tokens: Number(promptTokens.value),
          max_tokens: Number(maxTokens.value),
          concurrency: Number(concurrency.value),
        });
        await refresh();
      } catch (err) { error.textContent = err.message; }
    }), "btn-primary", { "data-action": "run" });
    const cancel = button("Cancel", busy(async () => { await api("POST", "/api/bench/cancel"); await refresh(); }),
      "btn-danger hidden", { "data-action": "cancel" });
    const progress = h("div.panel-body.stack");
    const results = h("div.panel-body.flush");

    append(view, [
      panel("Run", h("div.panel-body.stack",
        h("div.fields",
          field("Model", model),
          field("Prompt tokens", promptTokens, "per request"),
          field("Output tokens", maxTokens, "per request (EOS suppressed)"),
          field("Concurrency", concurrency, "requests at once")),
        h("div.muted.small", "Each run sends the requests twice: first with prompts no cache has seen (cold), then the same prompts again (warm), restored from the prefix cache."),
        error,
        h("div.row", run, cancel))),
      panel("Progress", progress),
      panel("Results", results),
    ]);

    async function refresh() {
      const st = await api("GET", "/api/bench");
      if (!ctx.alive) return;
      const running = st.state === "running";
      run.disabled = running;
      cancel.classList.toggle("hidden", !running);
      renderProgress(st);
      renderResults(st);
    }

    function renderProgress(st) {
      if (st.state === "idle") {
        replace(progress, h("div.muted", "No benchmark has run since the server started."));
        return;
      }
      const p = st.params || {};
      const frac = st.total ? st.done / st.total : 0;
      replace(progress,
        h("div.row", stateBadge(st.state), st.phase ? badge(`phase: ${st.phase}`, "plain") : null,
          h("span.muted.small", `${p.model} · ${p.concurrency} × (${p.prompt_tokens} prompt + ${p.max_tokens} output) tokens`)),
        h("div", h("div.bar-label", h("span", `${st.done} of ${st.total} requests`), h("span", `${fmt.int(st.tokens)} tokens generated`)),
          bar(st.state === "completed" ? 1 : frac, st.state === "completed" ? "ok" : "")),
        st.error ? h("div.notice.warn", st.error) : null);
    }

    function renderResults(st) {
      const cold = st.phases && st.phases.cold;
      const warm = st.phases && st.phases.warm;
      if (!cold) {
        replace(results, h("div.empty", "Results appear here when the cold phase finishes."));
        return;
      }
      const rows = [
        ["Time to first token (avg)", "ttft_avg_s", fmt.secs, true],
        ["Time to first token (p50)", "ttft_p50_s", fmt.secs, true],
        ["Time to first token (max)", "ttft_max_s", fmt.secs, true],
        ["Decode speed per request", "decode_tps_avg", (v) => (v ? `${fmt.num(v)} tok/s` : "—"), false],
        ["Total throughput", "throughput_tps", (v) => (v ? `${fmt.num(v)} tok/s` : "—"), false],
        ["Prefill speed", "prefill_tps", (v) => (v ? `${fmt.num(v, 0)} tok/s` : "—"), null],
        ["Cached prompt tokens", "cached_tokens", (v, ph) => `${fmt.int(v)} of ${fmt.int(ph.prompt_tokens)}`, null],
        ["Completion tokens", "completion_tokens", fmt.int, null],
        ["Wall time", "wall_s", fmt.secs, true],
      ];
      const ratio = (key, lowerIsBetter) => {
        if (!warm || lowerIsBetter === null || !cold[key] || !warm[key]) return "—";
        const r = lowerIsBetter ? cold[key] / warm[key] : warm[key] / cold[key];
        return `${r.toFixed(2)}×`;
      };
      replace(results, h("table", { "data-results": "1" },
        h("thead", h("tr", h("th", "Metric"), h("th.num", "Cold"), h("th.num", "Warm (cached)"), h("th.num", "Warm vs cold"))),
        h("tbody", rows.map(([label, key, f, lower]) => h("tr",
          h("td", label),
          h("td.num", f(cold[key], cold)),
          h("td.num", warm ? f(warm[key], warm) : "…"),
          h("td.num", ratio(key, lower)))))));
    }

    ctx.every(1000, refresh);
  },
});
