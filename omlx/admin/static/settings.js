/* Settings: global settings saved to $OMLX_HOME/settings.json, and inference-only sub-keys. */
"use strict";

const SETTING_GROUPS = [
  ["Server", ["host", "port", "api_key", "log_level"]],
  ["Models", ["model_dir", "model", "compute_dtype", "max_model_memory", "idle_timeout", "hf_endpoint"]],
  ["Requests", ["max_concurrent_requests", "max_waiting_requests", "prefill_step_size", "default_max_tokens", "keepalive_interval"]],
  ["Prefix cache", ["cache_dir", "cache_block_size", "stateful_block_size", "hot_cache_max_size", "ssd_cache_max_size", "hot_cache_only", "no_cache"]],
];

App.page("settings", {
  title: "Settings",
  async render(view, ctx, actions) {
    const pending = {};
    const saveBtn = button("Save changes", busy(save), "btn-primary", { "data-action": "save-settings", disabled: true });
    const discard = button("Discard", () => { for (const k of Object.keys(pending)) delete pending[k]; draw(data); }, "", { disabled: true });
    append(actions, [discard, saveBtn]);
    const top = h("div.stack");
    const groups = h("div.stack");
    const keys = h("div");
    append(view, [top, groups, keys]);
    let data = await api("GET", "/api/settings");

    function markDirty() {
      const dirty = Object.keys(pending).length > 0;
      saveBtn.disabled = !dirty;
      discard.disabled = !dirty;
    }

    async function save() {
      data = await api("PUT", "/api/settings", pending);
      const names = Object.keys(pending);
      for (const k of names) delete pending[k];
      toast(`Saved ${names.join(", ")}`, "ok");
      draw(data);
    }

    function inputFor(s) {
      const current = s.file_value !== null && s.file_value !== undefined ? s.file_value : s.value;
      const set = (v) => {
        const inFile = s.file_value !== null && s.file_value !== undefined;
        if (v === "" || v === undefined) v = null;
        if (v === null ? !inFile : v === current) delete pending[s.name];
        else pending[s.name] = v;
        row.classList.toggle("changed", s.name in pending);
        markDirty();
      };
      let input;
      if (!s.editable) {
        input = h("input", { type: "text", name: s.name, value: s.value ? "set (hidden)" : "not set", disabled: true });
      } else if (s.choices) {
        input = h("select", { name: s.name, onchange: () => set(input.value) },
          s.choices.map((c) => h("option", { value: c, selected: c === current }, c)));
      } else if (s.type === "bool") {
        input = switchInput(!!current, (e) => set(e.target.checked), { name: s.name });
      } else {
        const numeric = s.type === "int" || s.type === "float";
        input = h("input", {
          type: numeric ? "number" : "text", name: s.name, step: s.type === "float" ? "any" : "1",
          value: current ?? "", placeholder: s.default !== null && s.default !== undefined ? `default: ${s.default}` : "",
        });
        input.addEventListener("input", () => {
          const raw = input.value.trim();
          set(raw === "" ? null : (numeric ? Number(raw) : raw));
        });
      }
      const reset = s.editable && s.file_value !== null && s.file_value !== undefined
        ? button("Default", () => { set(null); if (input.value !== undefined) input.value = ""; }, "btn-small btn-ghost", { title: "Remove from settings.json" })
        : null;
      const row = h("div.setting", { "data-setting": s.name },
        h("div",
          h("div.setting-name", s.name),
          h("div.setting-help", s.help),
          h("div.setting-tags",
            badge(s.source, s.source === "default" ? "plain" : (s.source === "file" ? "accent" : "info")),
            s.live ? badge("applies now", "ok") : badge("needs restart", "plain"),
            ["cli", "env"].includes(s.source) ? h("span.small.muted", `overridden by ${s.source === "cli" ? s.flag : s.env}`) : null,
            data.restart_required.includes(s.name) ? badge("restart pending", "warn") : null)),
        h("div.setting-input", input, reset));
      if (s.name in pending) row.classList.add("changed");
      return row;
    }

    function draw(d) {
      replace(top,
        d.restart_required.length
          ? h("div.notice.warn", `Saved, applies after a restart: ${d.restart_required.join(", ")}.`)
          : null,
        d.file_error ? h("div.notice.warn", d.file_error) : null,
        h("div.notice.info", `Saved to ${d.file}. Command-line flags and OMLX_* environment variables take precedence over this file.`));
      const byName = Object.fromEntries(d.settings.map((s) => [s.name, s]));
      const seen = new Set();
      const blocks = SETTING_GROUPS.map(([title, names]) => {
        const items = names.filter((n) => byName[n]).map((n) => { seen.add(n); return inputFor(byName[n]); });
        return items.length ? panel(title, h("div.panel-body.flush", items)) : null;
      });
      const rest = d.settings.filter((s) => !seen.has(s.name));
      if (rest.length) blocks.push(panel("Other", h("div.panel-body.flush", rest.map(inputFor))));
      replace(groups, blocks);
      markDirty();
    }

    async function drawKeys() {
      const r = await api("GET", "/api/keys");
      const name = h("input", { type: "text", name: "key_name", placeholder: "e.g. laptop, ci, claude-code" });
      const create = button("Create key", busy(async () => {
        const k = await api("POST", "/api/keys", { name: name.value });
        modal("New API key", [
          h("p", `Key "${k.name}" was created. Copy it now: it is stored hashed and cannot be shown again.`),
          h("div.keybox", { "data-new-key": "1" }, k.key),
          h("p.small.muted", "It works on the /v1 inference routes only, not on the admin API or this dashboard."),
        ]);
        await drawKeys();
      }), "btn-primary", { "data-action": "create-key" });
      replace(keys, panel("API sub-keys", h("div.stack",
        h("div.panel-body", h("div.row", h("div.grow", name), create),
          h("div.small.muted", { style: { marginTop: "6px" } },
            App.session.auth_required ? "Named, revocable keys for clients: accepted on /v1, refused on /api."
              : "No main API key is set, so the server does not check keys yet; sub-keys take effect once one is set.")),
        r.keys.length ? h("table",
          h("thead", h("tr", h("th", "Name"), h("th", "Key"), h("th", "Created"), h("th", "Last used"), h("th.right", ""))),
          h("tbody", r.keys.map((k) => h("tr",
            h("td", k.name), h("td.mono", `${k.prefix}…`), h("td.muted", fmt.ago(k.created)), h("td.muted", k.last_used ? fmt.ago(k.last_used) : "never"),
            h("td.right", button("Revoke", busy(async () => {
              if (!(await confirmBox(`Revoke the key "${k.name}"? Clients using it stop working.`, "Revoke"))) return;
              await api("DELETE", `/api/keys/${k.id}`);
              await drawKeys();
            }), "btn-small btn-danger"))))))
          : h("div.empty", "No sub-keys."))));
    }

    draw(data);
    await drawKeys();
  },
});
