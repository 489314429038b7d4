/* The chat's conversations, kept in the browser's localStorage (they survive a reload).

   A chat remembers its model, preset, system prompt, sampling settings, thinking mode and
   tools. Its turns form a tree: a turn holds variants (regenerated answers, or an edited user
   message with its answer) and the one shown; each variant has the turn that follows it, so
   switching a variant switches the conversation after it, and nothing is ever lost. */
"use strict";

const ChatStore = (function () {
  const KEY = "omlx.chats.v1";
  const SAMPLING = ["temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
    "frequency_penalty", "max_tokens"];

  function uid() {
    return Date.now().toString(36) + Math.random().toString(36).slice(2, 8);
  }

  function blank(model) {
    const now = Date.now();
    return {
      id: uid(), title: "", created: now, updated: now,
      model: model || "", preset: "", system: "", settings: {},
      thinking: { mode: "auto", budget: 1024 },
      tools: { on: false, require: false },
      root: null,
    };
  }

  function load() {
    try {
      const data = JSON.parse(localStorage.getItem(KEY));
      if (data && Array.isArray(data.chats)) return data;
    } catch (_) { /* unreadable: start afresh */ }
    return { chats: [], current: null };
  }

  /* Save all chats; the error (storage full) or null. */
  function save(data) {
    try {
      localStorage.setItem(KEY, JSON.stringify(data));
      return null;
    } catch (err) {
      return err;
    }
  }

  /* The turns shown: [{turn, variant}] from the first, following each turn's chosen variant. */
  function path(chat) {
    const out = [];
    let turn = chat.root;
    while (turn) {
      const variant = turn.variants[turn.active];
      out.push({ turn, variant });
      turn = variant.next;
    }
    return out;
  }

  function newAnswer() {
    return { content: "", reasoning: "", tools: [], mcp: [], stats: null, error: null, stopped: false, streaming: true };
  }

  /* Append a turn after the last one shown; returns its variant. */
  function addTurn(chat, user) {
    const variant = { user, answer: newAnswer(), next: null };
    const turn = { variants: [variant], active: 0 };
    const shown = path(chat);
    if (shown.length) shown[shown.length - 1].variant.next = turn;
    else chat.root = turn;
    if (!chat.title) chat.title = titleFrom(user.text);
    return variant;
  }

  /* A new variant of `turn` (same user message unless `user` is given), shown from now on. */
  function addVariant(turn, user) {
    const variant = { user: user || turn.variants[turn.active].user, answer: newAnswer(), next: null };
    turn.variants.push(variant);
    turn.active = turn.variants.length - 1;
    return variant;
  }

  function titleFrom(text) {
    const line = (text || "").trim().split("\n")[0];
    return line.length > 48 ? `${line.slice(0, 47)}…` : line;
  }

  /* A user message in the API's form: documents as text before the typed text, images as parts. */
  function userMessage(user) {
    const docs = (user.docs || []).map((d) => `<document name="${d.name}">\n${d.text}\n</document>\n\n`).join("");
    const text = docs + (user.text || "");
    if (!(user.images || []).length) return { role: "user", content: text };
    return {
      role: "user",
      content: [{ type: "text", text }, ...user.images.map((img) => ({ type: "image_url", image_url: { url: img.url } }))],
    };
  }

  /* The messages of a request for the turn at `index` of the path: the system prompt, every
     earlier turn (the tool rounds the server ran, then the answer) and this turn's user message.
     A turn whose answer failed is left out. */
  function messages(chat, index) {
    const shown = path(chat);
    const out = [];
    if ((chat.system || "").trim()) out.push({ role: "system", content: chat.system });
    shown.slice(0, index).forEach(({ variant }) => {
      const a = variant.answer;
      if (a.error) return;
      out.push(userMessage(variant.user));
      out.push(...(a.mcp || []));
      out.push({ role: "assistant", content: a.content.slice(a.final_from || 0) });  // the rounds' text is in `mcp`
    });
    out.push(userMessage(shown[index].variant.user));
    return out;
  }

  /* Every text of the chat, for search. */
  function matches(chat, query) {
    const q = query.trim().toLowerCase();
    if (!q) return true;
    if ((chat.title || "").toLowerCase().includes(q)) return true;
    return path(chat).some(({ variant }) => (variant.user.text || "").toLowerCase().includes(q)
      || (variant.answer.content || "").toLowerCase().includes(q));
  }

  return { KEY, SAMPLING, blank, load, save, path, addTurn, addVariant, messages, matches, titleFrom, userMessage };
})();
