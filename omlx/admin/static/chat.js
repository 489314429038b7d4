/* Chat: stream answers from any chat model through /v1/chat/completions (SSE). */
"use strict";

const ChatState = { model: "", system: "", temperature: 0.7, top_p: 1, max_tokens: 1024, messages: [] };

App.page("chat", {
  title: "Chat",
  async render(view, ctx, actions) {
    const models = (await App.models()).filter((m) => m.type === "llm");
    const modelSelect = h("select", { name: "model" },
      models.map((m) => h("option", { value: m.id, selected: m.id === ChatState.model },
        `${m.id}${m.state === "unloaded" ? "" : " (loaded)"}`)));
    if (!ChatState.model || !models.some((m) => m.id === ChatState.model)) {
      const loaded = models.find((m) => m.state !== "unloaded");
      ChatState.model = (loaded || models[0] || {}).id || "";
      modelSelect.value = ChatState.model;
    }
    modelSelect.addEventListener("change", () => { ChatState.model = modelSelect.value; });

    const system = h("textarea", { name: "system", rows: 5, placeholder: "You are a helpful assistant." }, ChatState.system);
    system.addEventListener("input", () => { ChatState.system = system.value; });
    const numInput = (name, step, min, max) => {
      const el = h("input", { type: "number", name, step, min, max, value: ChatState[name] });
      el.addEventListener("change", () => { ChatState[name] = Number(el.value); });
      return el;
    };

    const messages = h("div.messages", { "aria-live": "polite" });
    const input = h("textarea", { name: "prompt", rows: 2, placeholder: "Send a message (Enter to send, Shift+Enter for a new line)" });
    const send = button("Send", () => submit(), "btn-primary", { "data-action": "send" });
    const stop = button("Stop", () => controller && controller.abort(), "btn-danger hidden", { "data-action": "stop" });
    let controller = null;

    append(actions, [button("New chat", () => {
      if (controller) controller.abort();
      ChatState.messages = [];
      redraw();
    }, "", { "data-action": "new-chat" })]);

    append(view, [h("div.chat",
      h("div.panel.chat-main", messages, h("div.composer", h("div.grow", input), send, stop)),
      h("div.panel", h("div.panel-head", h("h2", "Settings")), h("div.panel-body.stack",
        field("Model", modelSelect, models.length ? null : "No chat models found."),
        field("System prompt", system),
        h("div.fields",
          field("Temperature", numInput("temperature", "0.1", "0", "2")),
          field("Top p", numInput("top_p", "0.05", "0", "1"))),
        field("Max tokens", numInput("max_tokens", "1", "1", "131072")))))]);

    input.addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); submit(); }
    });
    ctx.onLeave(() => { if (controller) controller.abort(); });

    function messageEl(msg) {
      if (msg.role === "user") return h("div.msg.user", h("div.bubble", msg.content));
      const bubble = h("div.bubble.md");
      const meta = h("div.meta");
      const el = h("div.msg.assistant", bubble, meta);
      paint(el, msg);
      return el;
    }

    function paint(el, msg) {
      const [bubble, meta] = el.children;
      bubble.classList.toggle("error", !!msg.error);
      bubble.classList.toggle("cursor", !!msg.streaming);
      if (msg.error) {
        bubble.textContent = msg.error;
      } else {
        bubble.innerHTML = (msg.reasoning ? `<div class="thinking">${Markdown.escape(msg.reasoning)}</div>` : "") +
          Markdown.render(msg.content || "");
      }
      meta.textContent = msg.stats || (msg.streaming ? (msg.content ? "" : "waiting for the first token…") : "");
    }

    function redraw() {
      replace(messages, ChatState.messages.length ? ChatState.messages.map(messageEl)
        : h("div.chat-empty", h("div", { style: { fontSize: "28px" } }, "✎"), h("div", "Ask something to start."),
            h("div.small", ChatState.model ? `Model: ${ChatState.model}` : "")));
      messages.scrollTop = messages.scrollHeight;
    }

    async function submit() {
      const text = input.value.trim();
      if (!text || controller) return;
      if (!ChatState.model) { toast("Choose a model first", "err"); return; }
      input.value = "";
      ChatState.messages.push({ role: "user", content: text });
      const answer = { role: "assistant", content: "", reasoning: "", streaming: true };
      ChatState.messages.push(answer);
      redraw();
      const el = messages.lastElementChild;
      const history = ChatState.messages.filter((m) => m !== answer && !m.error)
        .map((m) => ({ role: m.role, content: m.content }));
      if (ChatState.system.trim()) history.unshift({ role: "system", content: ChatState.system });

      controller = new AbortController();
      send.classList.add("hidden");
      stop.classList.remove("hidden");
      const started = performance.now();
      let first = null;
      let usage = null;
      try {
        const resp = await fetch("/v1/chat/completions", {
          method: "POST",
          credentials: "same-origin",
          headers: { "Content-Type": "application/json", "X-OMLX-Admin": "1" },
          signal: controller.signal,
          body: JSON.stringify({
            model: ChatState.model, messages: history, stream: true, stream_options: { include_usage: true },
            temperature: ChatState.temperature, top_p: ChatState.top_p, max_tokens: ChatState.max_tokens,
          }),
        });
        if (!resp.ok) {
          let msg = `${resp.status} ${resp.statusText}`;
          try { msg = (await resp.json()).error.message || msg; } catch (_) { /* keep the status */ }
          if (resp.status === 401) App.showLogin();
          throw new Error(msg);
        }
        const reader = resp.body.getReader();
        const decoder = new TextDecoder();
        let buf = "";
        let lastPaint = 0;
        for (;;) {
          const { value, done } = await reader.read();
          if (done) break;
          buf += decoder.decode(value, { stream: true });
          let idx;
          while ((idx = buf.indexOf("\n\n")) >= 0) {
            const event = buf.slice(0, idx);
            buf = buf.slice(idx + 2);
            for (const line of event.split("\n")) {
              if (!line.startsWith("data:")) continue;
              const data = line.slice(5).trim();
              if (data === "[DONE]") continue;
              const chunk = JSON.parse(data);
              if (chunk.error) throw new Error(chunk.error.message || "generation failed");
              if (chunk.usage) usage = chunk.usage;
              const delta = (chunk.choices && chunk.choices[0] && chunk.choices[0].delta) || {};
              if (delta.content || delta.reasoning_content) {
                if (first === null) first = performance.now();
                answer.content += delta.content || "";
                answer.reasoning += delta.reasoning_content || "";
              }
            }
          }
          const now = performance.now();
          if (now - lastPaint > 50) {
            lastPaint = now;
            paint(el, answer);
            messages.scrollTop = messages.scrollHeight;
          }
        }
        answer.stats = stats(usage, started, first, performance.now());
      } catch (err) {
        if (err.name === "AbortError") {
          answer.stats = "stopped";
        } else {
          answer.error = err.message;
        }
      } finally {
        answer.streaming = false;
        controller = null;
        paint(el, answer);
        messages.scrollTop = messages.scrollHeight;
        send.classList.remove("hidden");
        stop.classList.add("hidden");
        input.focus();
      }
    }

    function stats(u, start, first, end) {
      if (!u) return "";
      const decodeS = first ? (end - first) / 1000 : 0;
      const tps = decodeS > 0 && u.completion_tokens > 1 ? (u.completion_tokens - 1) / decodeS : null;
      const cached = (u.prompt_tokens_details && u.prompt_tokens_details.cached_tokens) || 0;
      return [
        `${u.completion_tokens} tokens`,
        tps ? `${tps.toFixed(1)} tok/s` : null,
        first ? `TTFT ${fmt.secs((first - start) / 1000)}` : null,
        `${cached} of ${u.prompt_tokens} prompt tokens cached`,
      ].filter(Boolean).join(" · ");
    }

    redraw();
    input.focus();
  },
});
