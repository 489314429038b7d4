/* Downloads: search the Hugging Face hub (or the configured mirror), inspect, download, cancel, retry. */
"use strict";

App.page("downloads", {
  title: "Downloads",
  async render(view, ctx) {
    const query = h("input", { type: "search", name: "q", placeholder: "Search models, e.g. Qwen3 4bit" });
    const mlxOnly = h("input", { type: "checkbox", checked: true, name: "mlx" });
    const results = h("div.panel-body.flush", h("div.empty", "Search the hub for a model, or enter a repository id below."));
    const repoInput = h("input", { type: "text", name: "repo_id", placeholder: "org/name, e.g. mlx-community/SmolLM2-135M-Instruct" });
    const endpointLine = h("span.muted.small");
    const jobsBody = h("div.panel-body.flush");

    const search = busy(async () => {
      replace(results, h("div.empty", "Searching…"));
      const q = encodeURIComponent(query.value.trim());
      try {
        const r = await api("GET", `/api/hub/search?q=${q}&limit=30&mlx=${mlxOnly.checked}`);
        replace(results, r.results.length ? resultsTable(r.results) : h("div.empty", "No models match."));
      } catch (err) {
        replace(results, h("div.empty", err.message));
      }
    });
    query.addEventListener("keydown", (e) => { if (e.key === "Enter") search(e); });

    const startDownload = async (repoId) => {
      await api("POST", "/api/downloads", { repo_id: repoId });
      toast(`Downloading ${repoId}`, "ok");
      await refreshJobs();
    };

    function resultsTable(items) {
      return h("table",
        h("thead", h("tr", h("th", "Repository"), h("th.num", "Downloads"), h("th.num", "Likes"), h("th", "Updated"), h("th.right", ""))),
        h("tbody", items.map((m) => h("tr", { "data-repo": m.id },
          h("td", h("span.mono", m.id), m.pipeline_tag ? h("div.small.muted", m.pipeline_tag) : null),
          h("td.num", fmt.int(m.downloads)),
          h("td.num", fmt.int(m.likes)),
          h("td.muted.small", m.last_modified ? m.last_modified.slice(0, 10) : "—"),
          h("td.right", h("div.btn-group",
            button("Details", busy(() => showInfo(m.id, startDownload)), "btn-small"),
            m.local ? badge("downloaded", "ok")
              : button("Download", busy(() => startDownload(m.id)), "btn-small btn-primary", { "data-action": "download" })))))));
    }

    async function refreshJobs() {
      const r = await api("GET", "/api/downloads");
      if (!ctx.alive) return;
      endpointLine.textContent = `Hub: ${r.endpoint} · into ${r.model_dir}`;
      replace(jobsBody, r.downloads.length ? jobsTable(r.downloads) : h("div.empty", "No downloads yet."));
    }

    function jobsTable(jobs) {
      return h("table",
        h("thead", h("tr", h("th", "Repository"), h("th", "State"), h("th", { style: { width: "34%" } }, "Progress"), h("th.right", ""))),
        h("tbody", jobs.map((j) => h("tr", { "data-job": j.id, "data-state": j.state },
          h("td", h("span.mono", j.repo_id), h("div.small.muted", j.state === "completed" ? j.target : (j.commit ? `commit ${j.commit.slice(0, 10)}` : ""))),
          h("td", stateBadge(j.state)),
          h("td",
            h("div.bar-label",
              h("span", `${fmt.bytes(j.downloaded_bytes)} / ${j.total_bytes ? fmt.bytes(j.total_bytes) : "?"}`),
              h("span", j.state === "downloading" && j.bytes_per_s ? `${fmt.bytes(j.bytes_per_s)}/s` : fmt.pct(j.progress, 0))),
            bar(j.progress, j.state === "completed" ? "ok" : (j.state === "failed" ? "warn" : "")),
            j.error ? h("div.small", { style: { color: "var(--err)", marginTop: "4px" } }, j.error) : null),
          h("td.right", h("div.btn-group",
            ["queued", "preparing", "downloading"].includes(j.state)
              ? button("Cancel", busy(async () => { await api("POST", `/api/downloads/${j.id}/cancel`); await refreshJobs(); }), "btn-small", { "data-action": "cancel" })
              : null,
            ["failed", "cancelled"].includes(j.state)
              ? button("Retry", busy(async () => { await api("POST", `/api/downloads/${j.id}/retry`); await refreshJobs(); }), "btn-small", { "data-action": "retry" })
              : null,
            j.state === "completed" ? h("a.btn.btn-small", { href: "#/models" }, "Models") : null,
            !["queued", "preparing", "downloading"].includes(j.state)
              ? button("Remove", busy(async () => { await api("DELETE", `/api/downloads/${j.id}`); await refreshJobs(); }), "btn-small btn-ghost", { "data-action": "remove" })
              : null))))));
    }

    append(view, [
      panel("Find a model", h("div.panel-body.stack",
        h("div.row", h("div.grow", query), h("label.check", mlxOnly, "MLX models only"), button("Search", search, "btn-primary", { "data-action": "search" })),
        h("div.row", h("div.grow", repoInput),
          button("Details", busy(() => showInfo(repoInput.value.trim(), startDownload)), ""),
          button("Download", busy(() => startDownload(repoInput.value.trim())), "btn-primary", { "data-action": "download-repo" })),
        endpointLine)),
      panel("Results", results),
      panel("Downloads", jobsBody),
    ]);
    ctx.every(1000, refreshJobs);
  },
});

async function showInfo(repoId, startDownload) {
  const info = await api("GET", `/api/hub/models/${repoId.split("/").map(encodeURIComponent).join("/")}`);
  const files = h("table",
    h("thead", h("tr", h("th", "File"), h("th.num", "Size"), h("th", ""))),
    h("tbody", info.files.map((f) => h("tr",
      h("td.mono", f.name), h("td.num", fmt.bytes(f.size)), h("td", f.download ? "" : badge("skipped", "plain"))))));
  modal(info.id, [
    h("dl.kv",
      h("dt", "Commit"), h("dd.mono", (info.sha || "").slice(0, 12)),
      h("dt", "Task"), h("dd", info.pipeline_tag || "—"),
      h("dt", "Library"), h("dd", info.library_name || "—"),
      h("dt", "Download size"), h("dd", `${fmt.bytes(info.download_bytes)} of ${fmt.bytes(info.total_bytes)}`),
      h("dt", "Saved to"), h("dd.mono", info.target)),
    info.problem ? h("div.notice.warn", info.problem) : null,
    info.local ? h("div.notice.info", "This model is already in the model dir.") : null,
    h("div.panel", files),
  ], (close) => [
    button("Close", close),
    button("Download", busy(async () => { await startDownload(info.id); close(); }), "btn-primary",
      { disabled: !info.loadable || info.local }),
  ]);
}
