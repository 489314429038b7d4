/* The chat's panels around the conversation: the list of chats (new, search, rename, delete),
   the composer (text, attachments, send / stop, edit) and the per-chat settings (model, prompt
   preset, system prompt, thinking, sampling, MCP tools). */
"use strict";

const ChatSide = (function () {
  const { html } = ChatView;
  const { useState, useEffect, useRef } = preactHooks;
  const MAX_IMAGES = 10;
  const MAX_DOCS = 5;
  const MAX_IMAGE_BYTES = 20 * 1024 * 1024;
  const enc = (id) => id.split("/").map(encodeURIComponent).join("/");

  /* ----- chats ------------------------------------------------------------------------ */
  function ChatList({ store, chat, busy, actions }) {
    const [query, setQuery] = useState("");
    const [renaming, setRenaming] = useState(null);
    const list = store.chats.filter((c) => ChatStore.matches(c, query));
    return html`<aside class="panel chat-list">
      <div class="chat-list-head">
        <button type="button" class="btn btn-primary btn-block" data-action="new-chat" disabled=${busy} onClick=${actions.create}>${T("chats.new")}</button>
        <input type="search" name="chat-search" placeholder=${T("chats.search")} value=${query}
          onInput=${(e) => setQuery(e.currentTarget.value)} />
      </div>
      <ul class="chat-items" aria-label=${T("chats.list")}>
        ${list.map((c) => html`<li key=${c.id} class=${c.id === chat.id ? "active" : ""} data-chat=${c.id}>
          ${renaming === c.id
            ? html`<input type="text" name="chat-title" value=${c.title} autofocus
                onKeyDown=${(e) => {
                  if (e.key === "Enter") { actions.rename(c, e.currentTarget.value.trim()); setRenaming(null); }
                  if (e.key === "Escape") setRenaming(null);
                }}
                onBlur=${(e) => { actions.rename(c, e.currentTarget.value.trim()); setRenaming(null); }} />`
            : html`<button type="button" class="chat-item" disabled=${busy && c.id !== chat.id} onClick=${() => actions.select(c.id)}>
                <span class="chat-item-title">${c.title || T("chats.untitled")}</span>
                <span class="chat-item-sub">${c.model}</span>
              </button>`}
          <span class="chat-item-actions">
            <button type="button" class="icon-btn" data-action="rename-chat" title=${T("chats.rename")} aria-label=${T("chats.rename")}
              onClick=${() => setRenaming(c.id)}>✎</button>
            <button type="button" class="icon-btn" data-action="delete-chat" title=${T("chats.delete")} aria-label=${T("chats.delete")}
              disabled=${busy && c.id === chat.id}
              onClick=${async () => { if (await confirmBox(T("chats.delete_confirm", { title: c.title || T("chats.untitled") }))) actions.remove(c); }}>✕</button>
          </span>
        </li>`)}
      </ul>
      ${!list.length && html`<div class="empty small">${store.chats.length ? T("chats.no_match") : T("chats.none")}</div>`}
    </aside>`;
  }

  /* ----- composer --------------------------------------------------------------------- */
  function readAsDataURL(file) {
    return new Promise((resolve, reject) => {
      const r = new FileReader();
      r.onload = () => resolve(r.result);
      r.onerror = () => reject(r.error);
      r.readAsDataURL(file);
    });
  }

  async function convert(file) {
    const resp = await fetch(`/api/chat/convert?name=${encodeURIComponent(file.name)}`, {
      method: "POST", credentials: "same-origin", body: file,
      headers: { "X-OMLX-Admin": "1", "Content-Type": "application/octet-stream" },
    });
    const data = await resp.json().catch(() => ({}));
    if (!resp.ok) throw new Error((data.error && data.error.message) || `${resp.status} ${resp.statusText}`);
    return data;
  }

  function Composer({ editing, busy, model, onSend, onStop, onCancelEdit }) {
    const start = editing ? editing.user : { text: "", images: [], docs: [] };
    const [text, setText] = useState(start.text || "");
    const [images, setImages] = useState(start.images || []);
    const [docs, setDocs] = useState(start.docs || []);
    const [reading, setReading] = useState(0);
    const input = useRef(null);
    const picker = useRef(null);
    useEffect(() => { if (input.current) input.current.focus(); }, []);

    async function add(files) {
      for (const file of files) {
        if (file.type.startsWith("image/")) {
          if (!model || !model.vision) { toast(T("attach.images_unsupported", { model: model ? model.id : "?" }), "err"); continue; }
          if (file.size > MAX_IMAGE_BYTES) { toast(T("attach.image_too_big", { name: file.name, size: fmt.bytes(MAX_IMAGE_BYTES) }), "err"); continue; }
          const url = await readAsDataURL(file);
          setImages((cur) => {
            if (cur.length >= MAX_IMAGES) { toast(T("attach.too_many_images", { n: MAX_IMAGES }), "err"); return cur; }
            return [...cur, { name: file.name, url }];
          });
        } else {
          setReading((n) => n + 1);
          try {
            const doc = await convert(file);
            setDocs((cur) => {
              if (cur.length >= MAX_DOCS) { toast(T("attach.too_many_docs", { n: MAX_DOCS }), "err"); return cur; }
              return [...cur, { name: doc.name, text: doc.text }];
            });
          } catch (err) {
            toast(T("attach.failed", { name: file.name, error: err.message }), "err");
          } finally {
            setReading((n) => n - 1);
          }
        }
      }
    }

    function submit() {
      if (busy || reading) return;
      if (!text.trim() && !images.length && !docs.length) return;
      if (onSend({ text: text.trim(), images, docs })) { setText(""); setImages([]); setDocs([]); }
    }

    const remove = (kind, i) => (kind === "images" ? setImages : setDocs)((cur) => cur.filter((_, j) => j !== i));
    return html`<div class=${"composer" + (editing ? " editing" : "")}
        onDragOver=${(e) => e.preventDefault()}
        onDrop=${(e) => { e.preventDefault(); add([...e.dataTransfer.files]); }}>
      ${editing && html`<div class="notice info small">${T("composer.editing")}</div>`}
      <${ChatView.Attachments} user=${{ images, docs }} onRemove=${remove} />
      ${reading > 0 && html`<div class="muted small">${T("attach.converting", { name: "…" })}</div>`}
      <div class="composer-row">
        <input type="file" multiple class="hidden" ref=${picker} name="attach"
          onChange=${(e) => { add([...e.currentTarget.files]); e.currentTarget.value = ""; }} />
        <button type="button" class="btn" data-action="attach" title=${T("attach.drop")} onClick=${() => picker.current.click()}>${T("composer.attach")}</button>
        <div class="grow"><textarea name="prompt" rows="2" ref=${input} value=${text} placeholder=${T("composer.placeholder")}
          onInput=${(e) => setText(e.currentTarget.value)}
          onPaste=${(e) => { const files = [...(e.clipboardData ? e.clipboardData.files : [])]; if (files.length) { e.preventDefault(); add(files); } }}
          onKeyDown=${(e) => { if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); submit(); } }}></textarea></div>
        ${editing && !busy && html`<button type="button" class="btn" data-action="cancel-edit" onClick=${onCancelEdit}>${T("composer.cancel_edit")}</button>`}
        ${busy
          ? html`<button type="button" class="btn btn-danger" data-action="stop" onClick=${onStop}>${T("composer.stop")}</button>`
          : html`<button type="button" class="btn btn-primary" data-action="send" disabled=${reading > 0} onClick=${submit}>
              ${editing ? T("composer.save_edit") : T("composer.send")}</button>`}
      </div>
    </div>`;
  }

  /* ----- settings --------------------------------------------------------------------- */
  function NumberField({ chat, name, step, onChange }) {
    return html`<label class="field"><span>${T(`settings.${name}`)}</span>
      <input type="number" name=${name} step=${step} value=${chat.settings[name] ?? ""} placeholder=${T("settings.default")}
        onInput=${(e) => { const v = e.currentTarget.value; if (v === "") delete chat.settings[name]; else chat.settings[name] = v; onChange(); }} />
    </label>`;
  }

  function askName(title, value) {
    return new Promise((resolve) => {
      const input = h("input", { type: "text", name: "preset-name", value: value || "", placeholder: T("presets.name_placeholder") });
      modal(title, [field(T("presets.name"), input), h("p.small.muted", T("presets.hint"))], (close) => [
        button(T("presets.cancel"), () => { close(); resolve(null); }),
        button(T("presets.ok"), () => { close(); resolve(input.value.trim() || null); }, "btn-primary", { "data-action": "preset-ok" }),
      ], { narrow: true });
      input.focus();
    });
  }

  function presetBody(chat) {
    const out = { system_prompt: chat.system.trim() ? chat.system : null };
    for (const name of ChatStore.SAMPLING) {
      const v = chat.settings[name];
      if (v !== undefined && v !== "" && !isNaN(Number(v))) out[name] = Number(v);
    }
    return out;
  }

  function Presets({ chat, busy, onChange }) {
    const [profiles, setProfiles] = useState(null);
    const [own, setOwn] = useState(null);  // the model's own settings: its "System default"
    const load = async () => {
      if (!chat.model) return;
      try {
        const s = (await api("GET", `/api/models/${enc(chat.model)}/settings`)).settings;
        setOwn(s);
        setProfiles(s.profiles || {});
        if (chat.preset && !(chat.preset in (s.profiles || {}))) { chat.preset = ""; onChange(); }
      } catch (err) { toast(err.message, "err"); }
    };
    useEffect(() => { setProfiles(null); load(); }, [chat.model]);

    const pick = (name) => {
      chat.preset = name;
      chat.system = (name ? profiles[name].system_prompt : own && own.system_prompt) || "";
      onChange();
    };
    const run = (fn) => async () => { try { await fn(); } catch (err) { toast(err.message, "err"); } };
    const base = `/api/models/${enc(chat.model)}/profiles`;
    const save = run(async () => {
      const name = await askName(T("presets.new_title", { model: chat.model }), "");
      if (!name) return;
      await api("POST", `${base}/${encodeURIComponent(name)}`, presetBody(chat));
      chat.preset = name;
      await load();
      onChange();
      toast(T("presets.saved", { name }), "ok");
    });
    const update = run(async () => {
      await api("PUT", `${base}/${encodeURIComponent(chat.preset)}`, presetBody(chat));
      await load();
      toast(T("presets.saved", { name: chat.preset }), "ok");
    });
    const rename = run(async () => {
      const name = await askName(T("presets.rename_title", { name: chat.preset }), chat.preset);
      if (!name || name === chat.preset) return;
      await api("POST", `${base}/${encodeURIComponent(chat.preset)}/rename`, { to: name });
      chat.preset = name;
      await load();
      onChange();
    });
    const remove = run(async () => {
      const name = chat.preset;
      if (!(await confirmBox(T("presets.delete_confirm", { name, model: chat.model })))) return;
      await api("DELETE", `${base}/${encodeURIComponent(name)}`);
      chat.preset = "";
      await load();
      onChange();
      toast(T("presets.deleted", { name }), "ok");
    });
    return html`<div class="stack presets">
      <label class="field"><span>${T("settings.preset")}</span>
        <select name="preset" disabled=${busy || !profiles} value=${chat.preset} onChange=${(e) => pick(e.currentTarget.value)}>
          <option value="">${T("settings.system_default")}</option>
          ${Object.keys(profiles || {}).map((name) => html`<option value=${name} key=${name}>${name}</option>`)}
        </select>
      </label>
      <div class="btn-group">
        <button type="button" class="btn btn-small" data-action="save-preset" disabled=${busy} onClick=${save}>${T("presets.save")}</button>
        ${chat.preset && html`
          <button type="button" class="btn btn-small" data-action="update-preset" disabled=${busy} onClick=${update}>${T("presets.update")}</button>
          <button type="button" class="btn btn-small" data-action="rename-preset" disabled=${busy} onClick=${rename}>${T("presets.rename")}</button>
          <button type="button" class="btn btn-small btn-danger" data-action="delete-preset" disabled=${busy} onClick=${remove}>${T("presets.delete")}</button>`}
      </div>
    </div>`;
  }

  function Tools({ chat, tools, onChange }) {
    if (!tools) return null;
    if (!tools.length) return html`<div class="muted small">${T("tools.none")}</div>`;
    const set = (key, value) => { chat.tools[key] = value; onChange(); };
    return html`<div class="stack tools">
      <label class="check"><input type="checkbox" name="tools" checked=${chat.tools.on} onChange=${(e) => set("on", e.currentTarget.checked)} />${T("tools.use")}</label>
      <label class="check"><input type="checkbox" name="tools_require" checked=${chat.tools.require} disabled=${!chat.tools.on}
        onChange=${(e) => set("require", e.currentTarget.checked)} />${T("tools.require")}</label>
      <ul class="tool-list">${tools.map((t) => html`<li key=${t.name}><label class="check">
        <input type="checkbox" name=${`tool-${t.name}`} disabled=${!chat.tools.on} checked=${!(chat.tools.off || []).includes(t.name)}
          onChange=${(e) => set("off", e.currentTarget.checked ? (chat.tools.off || []).filter((n) => n !== t.name) : [...(chat.tools.off || []), t.name])} />
        <span class="mono">${t.name}</span></label> <span class="muted small">${t.description || ""}</span></li>`)}</ul>
    </div>`;
  }

  function Settings({ chat, models, tools, busy, onChange }) {
    const setThinking = (key, value) => { chat.thinking[key] = value; onChange(); };
    return html`<aside class="panel chat-settings">
      <div class="panel-head"><h2>${T("settings.title")}</h2></div>
      <div class="panel-body stack">
        <label class="field"><span>${T("settings.model")}</span>
          <select name="model" disabled=${busy} value=${chat.model} onChange=${(e) => { chat.model = e.currentTarget.value; chat.preset = ""; onChange(); }}>
            ${(models || []).map((m) => html`<option value=${m.id} key=${m.id}>${m.id}${m.vision ? T("settings.vision") : ""}${m.state === "unloaded" ? "" : T("settings.loaded")}</option>`)}
          </select>
          ${models && !models.length && html`<span class="hint">${T("settings.no_models")}</span>`}
        </label>
        ${chat.model && html`<${Presets} chat=${chat} busy=${busy} onChange=${onChange} />`}
        <label class="field"><span>${T("settings.system")}</span>
          <textarea name="system" rows="4" value=${chat.system} placeholder=${T("settings.system_placeholder")}
            onInput=${(e) => { chat.system = e.currentTarget.value; onChange(); }}></textarea>
        </label>
        <label class="field"><span>${T("settings.thinking")}</span>
          <select name="thinking" value=${chat.thinking.mode} onChange=${(e) => setThinking("mode", e.currentTarget.value)}>
            ${ChatStream.THINKING_MODES.map((m) => html`<option value=${m} key=${m}>${T(`settings.thinking.${m}`)}</option>`)}
          </select>
        </label>
        ${chat.thinking.mode === "budget" && html`<label class="field"><span>${T("settings.thinking_budget")}</span>
          <input type="number" name="thinking_budget" min="0" step="1" value=${chat.thinking.budget}
            onInput=${(e) => setThinking("budget", e.currentTarget.value)} /></label>`}
        <div class="section-title">${T("settings.sampling")}</div>
        <div class="fields compact">
          <${NumberField} chat=${chat} name="temperature" step="0.1" onChange=${onChange} />
          <${NumberField} chat=${chat} name="top_p" step="0.05" onChange=${onChange} />
          <${NumberField} chat=${chat} name="top_k" step="1" onChange=${onChange} />
          <${NumberField} chat=${chat} name="min_p" step="0.01" onChange=${onChange} />
          <${NumberField} chat=${chat} name="repetition_penalty" step="0.05" onChange=${onChange} />
          <${NumberField} chat=${chat} name="presence_penalty" step="0.1" onChange=${onChange} />
          <${NumberField} chat=${chat} name="frequency_penalty" step="0.1" onChange=${onChange} />
          <${NumberField} chat=${chat} name="max_tokens" step="1" onChange=${onChange} />
        </div>
        <div class="section-title">${T("tools.title")}</div>
        <${Tools} chat=${chat} tools=${tools} onChange=${onChange} />
      </div>
    </aside>`;
  }

  return { ChatList, Composer, Settings, MAX_IMAGES, MAX_DOCS };
})();
