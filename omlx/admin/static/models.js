/* Models: discovered models, load/unload/pin, per-model settings and profiles, delete files. */
"use strict";

const GEN_FIELDS = [
  ["temperature", "float", "0 – 2"],
  ["top_p", "float", "0 – 1"],
  ["top_k", "int", "0 = off"],
  ["min_p", "float", "0 – 1"],
  ["repetition_penalty", "float", "> 0"],
  ["presence_penalty", "float", "-2 – 2"],
  ["frequency_penalty", "float", "-2 – 2"],
  ["max_tokens", "int", "default completion limit"],
  ["context_length", "int", "cap on the window"],
];

function enc(id) {
  return id.split("/").map(encodeURIComponent).join("/");
}

App.page("models", {
  title: "Models",
  async render(view, ctx, actions) {
    append(actions, [button("Rescan model dir", busy(async () => {
      const r = await api("POST", "/api/models/refresh");
      toast(`${r.models.length} models found`, "ok");
      await refresh();
    }))]);
    const body = h("div.panel-body.flush");
    const problems = h("div");
    append(view, [panel("Discovered models", body), problems]);

    async function refresh() {
      const models = await App.models();
      if (!ctx.alive) return;
      replace(body, models.length ? table(models) : h("div.empty", "No models in the model dir yet. Download one from the Downloads page."));
    }

    function table(models) {
      return h("table",
        h("thead", h("tr", h("th", "Model"), h("th", "Type"), h("th", "State"), h("th.num", "Context"), h("th.num", "Memory"),
          h("th", "Pinned"), h("th.right", "Actions"))),
        h("tbody", models.map((m) => h("tr", { "data-model": m.id },
          h("td", h("span.mono", m.id)),
          h("td", badge(m.type, "plain")),
          h("td", stateBadge(m.state)),
          h("td.num", m.context_length ? fmt.int(m.context_length) : "—"),
          h("td.num", m.memory_bytes ? fmt.bytes(m.memory_bytes) : "—"),
          h("td", switchInput(m.pinned, async (e) => {
            try {
              await api("PUT", `/api/models/${enc(m.id)}/settings`, { pinned: e.target.checked });
              toast(`${m.id} ${e.target.checked ? "pinned" : "unpinned"}`, "ok");
            } catch (err) { e.target.checked = !e.target.checked; toast(err.message, "err"); }
          }, { "aria-label": `Pin ${m.id}` })),
          h("td.right", h("div.btn-group",
            m.state === "unloaded"
              ? button("Load", busy(async () => {
                  await api("POST", `/v1/models/${enc(m.id)}/load`);
                  toast(`${m.id} loaded`, "ok");
                  await refresh();
                }), "btn-small btn-primary", { "data-action": "load" })
              : button("Unload", busy(async () => {
                  await api("POST", `/v1/models/${enc(m.id)}/unload`);
                  toast(`${m.id} unloaded`, "ok");
                  await refresh();
                }), "btn-small", { "data-action": "unload", disabled: m.state === "loading" }),
            button("Settings", () => editSettings(m, refresh), "btn-small", { "data-action": "settings" }),
            button("Delete", busy(async () => {
              if (!(await confirmBox(`Delete the files of ${m.id} from the model dir? This cannot be undone.`))) return;
              await api("DELETE", `/api/models/${enc(m.id)}/files`);
              toast(`${m.id} deleted`, "ok");
              await refresh();
            }), "btn-small btn-danger", { "data-action": "delete" })))))));
    }

    ctx.every(4000, refresh);
  },
});

function numOrNull(input, kind) {
  const v = input.value.trim();
  if (v === "") return null;
  const n = Number(v);
  if (Number.isNaN(n) || (kind === "int" && !Number.isInteger(n))) throw new Error(`${input.name}: expected ${kind === "int" ? "an integer" : "a number"}`);
  return n;
}

function genInputs(values) {
  const inputs = {};
  const grid = h("div.fields", GEN_FIELDS.map(([name, kind, hint]) => {
    inputs[name] = h("input", { type: "number", name, step: kind === "int" ? "1" : "any", value: values[name] ?? "", placeholder: "default" });
    return field(name, inputs[name], hint);
  }));
  const kwargs = h("textarea", { name: "chat_template_kwargs", rows: 2, placeholder: '{"enable_thinking": false}' },
    values.chat_template_kwargs ? JSON.stringify(values.chat_template_kwargs) : "");
  const system = h("textarea", { name: "system_prompt", rows: 3, placeholder: "none" }, values.system_prompt || "");
  return {
    el: h("div.stack", grid, field("chat_template_kwargs (JSON)", kwargs),
      field("system_prompt", system, "The system message of a request that sends none; in the chat, a profile is a prompt preset.")),
    read() {
      const out = { system_prompt: system.value.trim() ? system.value : null };
      for (const [name, kind] of GEN_FIELDS) out[name] = numOrNull(inputs[name], kind);
      const k = kwargs.value.trim();
      try { out.chat_template_kwargs = k ? JSON.parse(k) : null; } catch (_) { throw new Error("chat_template_kwargs: not valid JSON"); }
      return out;
    },
  };
}

async function editSettings(model, refresh) {
  const data = await api("GET", `/api/models/${enc(model.id)}/settings`);
  const s = data.settings;
  const gen = genInputs(s);
  const aliases = h("input", { type: "text", name: "aliases", value: (s.aliases || []).join(", "), placeholder: "claude-*, my-model" });
  const ttl = h("input", { type: "number", name: "ttl", step: "1", min: "0", value: s.ttl ?? "", placeholder: "global idle timeout" });
  const type = h("select", { name: "type" },
    ["", "llm", "embedding", "reranker"].map((t) => h("option", { value: t, selected: (s.type || "") === t }, t || "auto (from config)")));
  const error = h("div.form-error");
  const profiles = h("div.stack");

  function renderProfiles(current) {
    const names = Object.keys(current || {});
    replace(profiles,
      names.length ? h("table",
        h("thead", h("tr", h("th", "Profile"), h("th", "Values"), h("th.right", ""))),
        h("tbody", names.map((name) => h("tr",
          h("td", h("span.mono", `${model.id}:${name}`)),
          h("td.small.mono", JSON.stringify(Object.fromEntries(Object.entries(current[name]).filter(([, v]) => v !== null)))),
          h("td.right", h("div.btn-group",
            button("Edit", () => profileEditor(model, name, current[name], renderProfiles), "btn-small"),
            button("Delete", busy(async () => {
              await api("DELETE", `/api/models/${enc(model.id)}/profiles/${encodeURIComponent(name)}`);
              const fresh = await api("GET", `/api/models/${enc(model.id)}/settings`);
              renderProfiles(fresh.settings.profiles);
            }), "btn-small btn-danger")))))))
        : h("div.muted.small", "No profiles. A profile presets generation values and a system prompt under a name; request it as model:name (the chat lists them as prompt presets)."),
      h("div", button("Add profile", () => profileEditor(model, null, {}, renderProfiles), "btn-small")));
  }
  renderProfiles(s.profiles);

  modal(`Settings · ${model.id}`, [
    h("div.section-title", "Generation defaults"),
    gen.el,
    h("div.section-title", "Serving"),
    h("div.fields", field("ttl (idle seconds)", ttl), field("type", type)),
    field("aliases", aliases, "Other names for this model, comma separated; globs allowed."),
    error,
    h("div.section-title", "Profiles"),
    profiles,
  ], (close) => [
    button("Cancel", close),
    button("Save", busy(async () => {
      error.textContent = "";
      try {
        const patch = gen.read();
        patch.ttl = numOrNull(ttl, "int");
        patch.type = type.value || null;
        patch.aliases = aliases.value.split(",").map((a) => a.trim()).filter(Boolean);
        await api("PUT", `/api/models/${enc(model.id)}/settings`, patch);
        toast("Settings saved", "ok");
        close();
        refresh();
      } catch (err) { error.textContent = err.message; }
    }), "btn-primary", { "data-action": "save-model-settings" }),
  ]);
}

function profileEditor(model, name, values, onSaved) {
  const nameInput = h("input", { type: "text", name: "profile", value: name || "", placeholder: "e.g. precise", disabled: !!name });
  const gen = genInputs(values);
  const error = h("div.form-error");
  modal(name ? `Profile ${name}` : "New profile", [
    field("Name", nameInput, "Letters, digits, '-' or '_'; requested as model:name."),
    gen.el, error,
  ], (close) => [
    button("Cancel", close),
    button("Save profile", busy(async () => {
      error.textContent = "";
      try {
        const profile = name || nameInput.value.trim();
        const body = Object.fromEntries(Object.entries(gen.read()).filter(([, v]) => v !== null));
        await api(name ? "PUT" : "POST", `/api/models/${enc(model.id)}/profiles/${encodeURIComponent(profile)}`, body);
        const fresh = await api("GET", `/api/models/${enc(model.id)}/settings`);
        onSaved(fresh.settings.profiles);
        close();
      } catch (err) { error.textContent = err.message; }
    }), "btn-primary"),
  ], { narrow: false });
}
