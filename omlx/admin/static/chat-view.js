/* The chat's conversation as Preact components (htm templates): a turn's user message, its
   variant tabs, the answer with its thinking block, tool calls, markdown and figures. */
"use strict";

const ChatView = (function () {
  const html = htm.bind(preact.h);

  function copy(text, done) {
    (navigator.clipboard ? navigator.clipboard.writeText(text) : Promise.reject())
      .then(done).catch(() => toast(T("errors.copy"), "err"));
  }

  function Attachments({ user, onRemove }) {
    const images = user.images || [];
    const docs = user.docs || [];
    if (!images.length && !docs.length) return null;
    return html`<div class="attachments">
      ${images.map((img, i) => html`<figure class="thumb" key=${"i" + i}>
        <img src=${img.url} alt=${img.name} title=${img.name} />
        ${onRemove && html`<button type="button" class="thumb-x" aria-label=${T("attach.remove")}
          onClick=${() => onRemove("images", i)}>✕</button>`}
      </figure>`)}
      ${docs.map((d, i) => html`<span class="doc-chip" key=${"d" + i} title=${T("attach.chars", { n: fmt.int(d.text.length) })}>${d.name}
        ${onRemove && html`<button type="button" class="chip-x" aria-label=${T("attach.remove")}
          onClick=${() => onRemove("docs", i)}>✕</button>`}
      </span>`)}
    </div>`;
  }

  function Thinking({ answer, now }) {
    if (!answer.reasoning) return null;
    const live = answer.streaming && answer.thinking_s === undefined;
    const secs = live ? (now - answer.t_reasoning) / 1000 : answer.thinking_s;
    const label = live ? T("turn.thinking_now", { secs: fmt.secs(Math.max(0, secs || 0)) })
      : secs !== undefined && secs !== null ? T("turn.thought_for", { secs: fmt.secs(secs) }) : T("turn.thinking");
    return html`<details class="thinking" open=${live}>
      <summary>${label}</summary>
      <div class="thinking-text">${answer.reasoning}</div>
    </details>`;
  }

  /* The tool rounds the server ran: each call with its arguments and result. */
  function ToolCalls({ answer }) {
    const msgs = answer.mcp || [];
    const results = Object.fromEntries(msgs.filter((m) => m.role === "tool").map((m) => [m.tool_call_id, m.content]));
    const calls = msgs.flatMap((m) => m.tool_calls || []);
    if (!calls.length) return null;
    return html`<div class="tool-calls">${calls.map((c) => html`<details class="tool-call" key=${c.id} data-tool=${c.function.name}>
      <summary>${T("turn.tool_call", { name: c.function.name })}</summary>
      <div class="tool-part"><span>${T("turn.tool_args")}</span><pre>${c.function.arguments}</pre></div>
      <div class="tool-part"><span>${T("turn.tool_result")}</span><pre class="tool-result">${
        typeof results[c.id] === "string" ? results[c.id] : JSON.stringify(results[c.id])}</pre></div>
    </details>`)}</div>`;
  }

  function Answer({ answer, now, onRegenerate, canAct }) {
    const [copied, setCopied] = preactHooks.useState(false);
    const waiting = answer.streaming && !answer.content && !answer.reasoning;
    let meta = "";
    if (answer.stopped) meta = [T("turn.stopped"), ChatStream.describe(answer.stats)].filter(Boolean).join(" · ");
    else if (answer.stats) meta = ChatStream.describe(answer.stats);
    else if (waiting && answer.prefill) meta = T("turn.prefill", { done: fmt.int(answer.prefill.done), total: fmt.int(answer.prefill.total) });
    else if (waiting) meta = T("turn.waiting");
    return html`<div class="msg assistant">
      <${Thinking} answer=${answer} now=${now} />
      <${ToolCalls} answer=${answer} />
      ${answer.error
        ? html`<div class="bubble error">${answer.error}</div>`
        : html`<div class=${"bubble md" + (answer.streaming ? " cursor" : "")}
            dangerouslySetInnerHTML=${{ __html: Markdown.render(answer.content || "") }} />`}
      ${waiting && answer.prefill && html`<div class="bar prefill-bar"><span style=${{ width: `${100 * answer.prefill.done / Math.max(1, answer.prefill.total)}%` }}></span></div>`}
      <div class="meta">${meta}</div>
      ${canAct && html`<div class="msg-actions">
        <button type="button" class="btn btn-ghost btn-small" data-action="copy-answer"
          onClick=${() => copy(answer.content, () => { setCopied(true); setTimeout(() => setCopied(false), 1200); })}>
          ${copied ? T("turn.copied") : T("turn.copy")}</button>
        <button type="button" class="btn btn-ghost btn-small" data-action="regenerate" onClick=${onRegenerate}>${T("turn.regenerate")}</button>
      </div>`}
    </div>`;
  }

  /* One turn of the path: the user message, its variant tabs, the answer. */
  function Turn({ turn, variant, index, now, busy, onEdit, onRegenerate, onPick }) {
    return html`<div class="turn" data-turn=${index}>
      <div class="msg user">
        <${Attachments} user=${variant.user} />
        ${variant.user.text && html`<div class="bubble">${variant.user.text}</div>`}
        ${!busy && html`<div class="msg-actions">
          <button type="button" class="btn btn-ghost btn-small" data-action="edit" onClick=${onEdit}>${T("turn.edit")}</button>
        </div>`}
      </div>
      ${turn.variants.length > 1 && html`<div class="variant-tabs" role="tablist">
        ${turn.variants.map((_, i) => html`<button type="button" role="tab" key=${i} disabled=${busy}
          aria-selected=${i === turn.active ? "true" : "false"} class=${i === turn.active ? "active" : ""}
          title=${T("turn.variant", { n: i + 1 })} onClick=${() => onPick(i)}>${i + 1}</button>`)}
      </div>`}
      <${Answer} answer=${variant.answer} now=${now} canAct=${!busy && !variant.answer.streaming} onRegenerate=${onRegenerate} />
    </div>`;
  }

  return { html, Turn, Attachments };
})();
