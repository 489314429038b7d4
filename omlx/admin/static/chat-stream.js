/* The chat's requests: the body a chat's settings make, the SSE stream of
   /v1/chat/completions read chunk by chunk, the prefill position polled from the status API,
   and the figures shown after an answer. */
"use strict";

const ChatStream = (function () {
  const THINKING_MODES = ["auto", "off", "on", "budget"];

  /* The request body for `messages` under the chat's model, preset, settings, thinking and
     tools (`tools`: the server's MCP tools, of which the chat may have turned some off). */
  function body(chat, messages, tools) {
    const out = {
      model: chat.preset ? `${chat.model}:${chat.preset}` : chat.model,
      messages, stream: true, stream_options: { include_usage: true },
    };
    for (const name of ChatStore.SAMPLING) {
      const v = chat.settings[name];
      if (v !== undefined && v !== null && v !== "" && !isNaN(Number(v))) out[name] = Number(v);
    }
    const mode = chat.thinking.mode;
    if (mode === "off") {
      out.chat_template_kwargs = { enable_thinking: false };
      out.thinking_budget = 0;  // also for templates without the switch: the end marker at once
    } else if (mode === "on" || mode === "budget") {
      out.chat_template_kwargs = { enable_thinking: true };
      if (mode === "budget") out.thinking_budget = Math.max(0, Math.floor(Number(chat.thinking.budget) || 0));
    }
    if (chat.tools.on) {
      const off = chat.tools.off || [];
      out.mcp = off.length ? { tools: (tools || []).map((t) => t.name).filter((n) => !off.includes(n)) } : true;
      if (chat.tools.require) out.tool_choice = "required";
    }
    return out;
  }

  /* POST `payload`, calling onChunk(chunk) for each SSE data chunk; throws the server's error. */
  async function run(payload, signal, onChunk) {
    const resp = await fetch("/v1/chat/completions", {
      method: "POST", credentials: "same-origin", signal,
      headers: { "Content-Type": "application/json", "X-OMLX-Admin": "1" },
      body: JSON.stringify(payload),
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
          onChunk(chunk);
        }
      }
    }
  }

  /* The status API's entry for request `id` of `model`, or null. */
  async function requestStatus(model, id) {
    const status = await api("GET", "/v1/models/status");
    const entry = status.data.find((m) => m.id === model);
    return ((entry && entry.requests) || []).find((r) => r.id === id) || null;
  }

  /* The figures after an answer, from its usage and the client's clock (ms): sent, first
     token (any), first reasoning and first content tokens, end. */
  function figures(usage, t) {
    if (!usage) return null;
    const cached = (usage.prompt_tokens_details && usage.prompt_tokens_details.cached_tokens) || 0;
    const computed = Math.max(0, usage.prompt_tokens - cached);
    const ttft = t.first ? (t.first - t.sent) / 1000 : null;
    const decodeS = t.first ? (t.end - t.first) / 1000 : 0;
    const thinking = t.reasoning ? ((t.content || t.end) - t.reasoning) / 1000 : null;
    return {
      prompt_tokens: usage.prompt_tokens, cached_tokens: cached, completion_tokens: usage.completion_tokens,
      ttft_s: ttft,
      prefill_tps: ttft && computed ? computed / ttft : null,
      decode_tps: decodeS > 0 && usage.completion_tokens > 1 ? (usage.completion_tokens - 1) / decodeS : null,
      thinking_s: thinking,
    };
  }

  function describe(f) {
    if (!f) return "";
    return [
      T("stats.tokens", { n: f.completion_tokens }),
      f.prefill_tps ? T("stats.prefill", { rate: f.prefill_tps.toFixed(1) }) : null,
      f.decode_tps ? T("stats.decode", { rate: f.decode_tps.toFixed(1) }) : null,
      f.ttft_s !== null ? T("stats.ttft", { secs: fmt.secs(f.ttft_s) }) : null,
      T("stats.cached", { cached: f.cached_tokens, prompt: f.prompt_tokens }),
      f.thinking_s !== null ? T("stats.thinking", { secs: fmt.secs(f.thinking_s) }) : null,
    ].filter(Boolean).join(" · ");
  }

  return { THINKING_MODES, body, run, requestStatus, figures, describe };
})();
