/* Chat: several conversations kept in the browser (chat-store.js), streamed from
   /v1/chat/completions (chat-stream.js), drawn with Preact + htm (chat-view.js, chat-side.js). */
"use strict";

(function () {
  const { html } = ChatView;
  const { useState, useEffect, useRef, useReducer } = preactHooks;
  const PAINT_MS = 50;
  const POLL_MS = 400;

  function ChatApp({ ctx }) {
    const data = useRef(null);
    if (!data.current) data.current = ChatStore.load();
    const store = data.current;
    const [, redraw] = useReducer((x) => x + 1, 0);
    const [models, setModels] = useState(null);
    const [tools, setTools] = useState(null);  // the server's MCP tools
    const [busy, setBusy] = useState(false);
    const [editing, setEditing] = useState(null);  // {index} of the turn whose user message is edited
    const [pane, setPane] = useState("");  // phone width: "list" or "settings" shown over the chat
    const controller = useRef(null);
    const messagesEl = useRef(null);
    const stick = useRef(true);  // follow the answer unless the user scrolled up
    const autoTop = useRef(0);  // where the last scroll to the bottom left it

    useEffect(() => {
      App.models().then((all) => setModels(all.filter((m) => m.type === "llm"))).catch((err) => toast(err.message, "err"));
      api("GET", "/v1/mcp/tools").then((r) => setTools(r.data)).catch(() => setTools([]));
      ctx.onLeave(() => { if (controller.current) controller.current.abort(); });
    }, []);

    let chat = store.chats.find((c) => c.id === store.current);
    if (!chat) {
      chat = store.chats[0];
      if (!chat) { chat = ChatStore.blank(""); store.chats.unshift(chat); }
      store.current = chat.id;
    }
    if (models && models.length && !models.some((m) => m.id === chat.model)) {
      const loaded = models.find((m) => m.state !== "unloaded");
      chat.model = (loaded || models[0]).id;
      chat.preset = "";
    }

    useEffect(() => {
      const el = messagesEl.current;
      if (el && stick.current) { el.scrollTop = el.scrollHeight; autoTop.current = el.scrollTop; }
    });

    function persist(touch = true) {
      if (touch) chat.updated = Date.now();
      const err = ChatStore.save(store);
      if (err) toast(T("chats.storage_full"), "err");
      redraw();
    }

    const actions = {
      select(id) {
        if (busy) return;
        store.current = id;
        setEditing(null);
        setPane("");
        stick.current = true;
        persist(false);
      },
      create() {
        if (busy) return;
        const fresh = ChatStore.blank(chat.model);
        Object.assign(fresh, { preset: chat.preset, system: chat.system, settings: { ...chat.settings },
          thinking: { ...chat.thinking }, tools: { ...chat.tools } });
        store.chats.unshift(fresh);
        store.current = fresh.id;
        setEditing(null);
        setPane("");
        persist(false);
      },
      rename(c, title) { c.title = title; persist(false); },
      remove(c) {
        store.chats = store.chats.filter((x) => x !== c);
        if (store.current === c.id) store.current = store.chats[0] ? store.chats[0].id : null;
        persist(false);
      },
      change() { persist(); },
    };

    async function generate(index, variant) {
      const answer = variant.answer;
      const payload = ChatStream.body(chat, ChatStore.messages(chat, index), tools);
      const ctl = new AbortController();
      controller.current = ctl;
      setBusy(true);
      stick.current = true;
      persist();
      const t = { sent: performance.now() };
      let usage = null;
      let rid = null;
      let lastPaint = 0;
      let poll = null;
      const paint = () => {
        const now = performance.now();
        if (now - lastPaint > PAINT_MS) { lastPaint = now; redraw(); }
      };
      const pollPrefill = async () => {
        if (t.first || ctl.signal.aborted) return;
        try {
          const r = await ChatStream.requestStatus(chat.model, rid);
          if (r && !t.first) { answer.prefill = { done: r.prefilled_tokens, total: r.prompt_tokens }; redraw(); }
        } catch (_) { /* the figures are a nicety */ }
        if (!t.first && !ctl.signal.aborted) poll = setTimeout(pollPrefill, POLL_MS);
      };
      try {
        await ChatStream.run(payload, ctl.signal, (chunk) => {
          const now = performance.now();
          if (!rid && chunk.id) { rid = chunk.id; poll = setTimeout(pollPrefill, 0); }
          if (chunk.usage) usage = chunk.usage;
          if (chunk.mcp) {  // a tool round the server ran: its text so far belongs to that round
            answer.mcp.push(...chunk.mcp.messages);
            answer.final_from = answer.content.length;
          }
          const delta = (chunk.choices && chunk.choices[0] && chunk.choices[0].delta) || {};
          if (delta.reasoning_content) {
            if (!t.reasoning) { t.reasoning = now; answer.t_reasoning = now; }
            answer.reasoning += delta.reasoning_content;
          }
          if (delta.content) {
            if (!t.content) {
              t.content = now;
              if (t.reasoning) answer.thinking_s = (now - t.reasoning) / 1000;
            }
            answer.content += delta.content;
          }
          if ((delta.reasoning_content || delta.content) && !t.first) { t.first = now; answer.prefill = null; }
          paint();
        });
        t.end = performance.now();
        answer.stats = ChatStream.figures(usage, t);
      } catch (err) {
        if (err.name === "AbortError") answer.stopped = true;
        else answer.error = err.message;
      } finally {
        clearTimeout(poll);
        if (t.reasoning && answer.thinking_s === undefined) answer.thinking_s = ((t.content || performance.now()) - t.reasoning) / 1000;
        answer.streaming = false;
        answer.prefill = null;
        controller.current = null;
        setBusy(false);
        persist();
      }
    }

    function send(user) {
      if (!chat.model) { toast(T("errors.choose_model"), "err"); return false; }
      if (editing) {
        const { turn } = ChatStore.path(chat)[editing.index];
        const variant = ChatStore.addVariant(turn, user);
        const index = editing.index;
        setEditing(null);
        generate(index, variant);
      } else {
        const variant = ChatStore.addTurn(chat, user);
        generate(ChatStore.path(chat).length - 1, variant);
      }
      return true;
    }

    const shown = ChatStore.path(chat);
    const now = performance.now();
    const model = (models || []).find((m) => m.id === chat.model);
    return html`<div class=${"chat2" + (pane ? ` show-${pane}` : "")}>
      <${ChatSide.ChatList} store=${store} chat=${chat} busy=${busy} actions=${actions} />
      <section class="panel chat-main">
        <div class="chat-bar">
          <button type="button" class="btn btn-small" data-action="show-list" onClick=${() => setPane(pane === "list" ? "" : "list")}>${T("chats.show_list")}</button>
          <span class="chat-bar-title">${chat.title || T("chats.untitled")}</span>
          <button type="button" class="btn btn-small" data-action="show-settings" onClick=${() => setPane(pane === "settings" ? "" : "settings")}>${T("chats.show_settings")}</button>
        </div>
        <div class="messages" aria-live="polite" ref=${messagesEl}
          onScroll=${(e) => {  // our own scrolls land at autoTop; only moving up from there unsticks
            const el = e.currentTarget;
            if (el.scrollTop < autoTop.current - 4) stick.current = el.scrollHeight - el.scrollTop - el.clientHeight < 40;
            else stick.current = true;
          }}>
          ${shown.length ? shown.map(({ turn, variant }, i) => html`<${ChatView.Turn} key=${i} turn=${turn} variant=${variant}
              index=${i} now=${now} busy=${busy}
              onEdit=${() => setEditing({ index: i, user: variant.user })}
              onRegenerate=${() => generate(i, ChatStore.addVariant(turn))}
              onPick=${(v) => { turn.active = v; persist(); }} />`)
            : html`<div class="chat-empty"><div class="chat-empty-mark">✎</div><div>${T("empty.prompt")}</div>
                <div class="small">${chat.model ? T("empty.model", { model: chat.model }) : ""}</div></div>`}
        </div>
        <${ChatSide.Composer} key=${chat.id + (editing ? `-edit-${editing.index}` : "")} editing=${editing} busy=${busy}
          model=${model} onSend=${send} onStop=${() => controller.current && controller.current.abort()}
          onCancelEdit=${() => setEditing(null)} />
      </section>
      <${ChatSide.Settings} chat=${chat} models=${models} tools=${tools} busy=${busy} onChange=${actions.change} />
    </div>`;
  }

  App.page("chat", {
    title: T("chat.title"),
    async render(view, ctx) {
      const root = h("div.chat-root");
      append(view, [root]);
      preact.render(html`<${ChatApp} ctx=${ctx} />`, root);
      ctx.onLeave(() => preact.render(null, root));
    },
  });
})();
