/* Chat answers as markdown: marked parses (GitHub flavour, also an unterminated fence while
   streaming), highlight.js colours code, DOMPurify keeps only safe HTML. The libraries are
   vendored in static/vendor (VENDOR.json: versions, licences, hashes).

   HTML the model writes is shown as text, never as markup; links open in a new tab. */
"use strict";

const Markdown = (function () {
  function esc(s) {
    return s.replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;").replace(/"/g, "&quot;");
  }

  function highlight(code, lang) {
    const language = (lang || "").trim().split(/\s+/)[0].toLowerCase();
    if (language && hljs.getLanguage(language)) {
      return hljs.highlight(code, { language, ignoreIllegals: true }).value;
    }
    return esc(code);
  }

  const parser = new marked.Marked({
    gfm: true,
    breaks: true,
    renderer: {
      html({ text }) { return esc(text); },
      code({ text, lang }) {
        const label = esc((lang || "code").trim().split(/\s+/)[0] || "code");
        return `<div class="codeblock"><div class="codeblock-head"><span>${label}</span>` +
          `<button type="button" data-copy>Copy</button></div>` +
          `<pre><code class="hljs">${highlight(text, lang)}</code></pre></div>`;
      },
    },
  });

  DOMPurify.addHook("afterSanitizeAttributes", (node) => {
    if (node.tagName === "A" && node.hasAttribute("href")) {
      node.setAttribute("target", "_blank");
      node.setAttribute("rel", "noopener noreferrer");
    }
  });

  function render(text) {
    return DOMPurify.sanitize(parser.parse(text || ""), { ADD_ATTR: ["target"] });
  }

  /* Copy buttons inside rendered answers. */
  document.addEventListener("click", (e) => {
    const btn = e.target.closest && e.target.closest("[data-copy]");
    if (!btn) return;
    const code = btn.closest(".codeblock").querySelector("code").textContent;
    (navigator.clipboard ? navigator.clipboard.writeText(code) : Promise.reject())
      .then(() => { btn.textContent = "Copied"; setTimeout(() => { btn.textContent = "Copy"; }, 1200); })
      .catch(() => toast("Copy is not available here", "err"));
  });

  return { render, highlight, escape: esc };
})();
