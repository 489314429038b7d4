/* A small markdown renderer and code highlighter for chat answers.

   Everything the model wrote is escaped first; only the tags this file emits reach the DOM.
   Handles fenced code (also unterminated, while streaming), headings, lists, quotes, rules,
   tables, inline code, bold, italics and http(s) links. */
"use strict";

const Markdown = (function () {
  function esc(s) {
    return s.replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;").replace(/"/g, "&quot;");
  }

  const KEYWORDS = new Set((
    "if else elif for while do return break continue def class function fn let const var import from as " +
    "export default try except catch finally raise throw new await async yield with in is not and or lambda " +
    "pub struct enum impl trait match mod use crate self super static mut where type interface package go " +
    "func defer select switch case public private protected void int float double bool char string long " +
    "unsigned signed auto extern sizeof typedef namespace template using echo fi then done esac local"
  ).split(" "));
  const LITERALS = new Set("true false null None True False nil undefined this NaN".split(" "));

  // One regex, tried left to right: comments, strings, numbers, words.
  const TOKEN = /(\/\/[^\n]*|#[^\n]*|\/\*[\s\S]*?\*\/|--[^\n]*)|("(?:\\.|[^"\\\n])*"|'(?:\\.|[^'\\\n])*'|`(?:\\.|[^`\\])*`)|(\b\d+(?:\.\d+)?(?:e[+-]?\d+)?\b|\b0x[0-9a-f]+\b)|([A-Za-z_][\w]*)/gi;

  function highlight(code, lang) {
    const hashComments = /^(py|python|sh|bash|shell|zsh|rb|ruby|yaml|yml|toml|r|perl|dockerfile|make|makefile|conf)$/i.test(lang || "");
    const dashComments = /^(sql|lua|haskell|hs)$/i.test(lang || "");
    let out = "";
    let last = 0;
    TOKEN.lastIndex = 0;
    let m;
    while ((m = TOKEN.exec(code)) !== null) {
      let [tok, com, str, num, word] = m;
      if (com && ((com[0] === "#" && !hashComments) || (com.startsWith("--") && !dashComments))) {
        // Not a comment in this language: emit the first char and rescan after it.
        out += esc(code.slice(last, m.index + 1));
        last = m.index + 1;
        TOKEN.lastIndex = last;
        continue;
      }
      out += esc(code.slice(last, m.index));
      last = m.index + tok.length;
      if (com) out += `<span class="tok-com">${esc(tok)}</span>`;
      else if (str) out += `<span class="tok-str">${esc(tok)}</span>`;
      else if (num) out += `<span class="tok-num">${esc(tok)}</span>`;
      else if (KEYWORDS.has(word)) out += `<span class="tok-kw">${esc(tok)}</span>`;
      else if (LITERALS.has(word)) out += `<span class="tok-lit">${esc(tok)}</span>`;
      else if (code[last] === "(") out += `<span class="tok-fn">${esc(tok)}</span>`;
      else out += esc(tok);
    }
    return out + esc(code.slice(last));
  }

  function inline(text) {
    // Code spans first, protected from the other rules by placeholders.
    const codes = [];
    let s = text.replace(/`([^`\n]+)`/g, (_, c) => { codes.push(c); return `\u0000${codes.length - 1}\u0000`; });
    s = esc(s);
    s = s.replace(/\[([^\]\n]+)\]\((https?:\/\/[^\s)]+)\)/g, (_, label, url) => `<a href="${url}" target="_blank" rel="noopener noreferrer">${label}</a>`);
    s = s.replace(/\*\*([^*\n]+)\*\*/g, "<strong>$1</strong>").replace(/__([^_\n]+)__/g, "<strong>$1</strong>");
    s = s.replace(/(^|[^*\w])\*(?=\S)([^*\n]+?)(?<=\S)\*(?!\w)/g, "$1<em>$2</em>")
      .replace(/(^|[^_\w])_(?=\S)([^_\n]+?)(?<=\S)_(?!\w)/g, "$1<em>$2</em>");
    s = s.replace(/~~([^~\n]+)~~/g, "<del>$1</del>");
    return s.replace(/\u0000(\d+)\u0000/g, (_, i) => `<code>${esc(codes[Number(i)])}</code>`);
  }

  function codeBlock(code, lang) {
    const label = esc(lang || "code");
    return `<div class="codeblock"><div class="codeblock-head"><span>${label}</span><button type="button" data-copy>Copy</button></div>` +
      `<pre><code>${highlight(code, lang)}</code></pre></div>`;
  }

  function table(lines) {
    const cells = (l) => l.trim().replace(/^\||\|$/g, "").split("|").map((c) => inline(c.trim()));
    const head = cells(lines[0]);
    const rows = lines.slice(2).map(cells);
    return `<table><thead><tr>${head.map((c) => `<th>${c}</th>`).join("")}</tr></thead><tbody>` +
      rows.map((r) => `<tr>${r.map((c) => `<td>${c}</td>`).join("")}</tr>`).join("") + "</tbody></table>";
  }

  function blocks(text) {
    const lines = text.split("\n");
    let html = "";
    let para = [];
    const flush = () => {
      if (para.length) html += `<p>${para.map(inline).join("<br>")}</p>`;
      para = [];
    };
    for (let i = 0; i < lines.length; i++) {
      const line = lines[i];
      let m;
      if (!line.trim()) { flush(); continue; }
      if ((m = /^(#{1,6})\s+(.*)$/.exec(line))) {
        flush();
        const n = Math.min(m[1].length, 4);
        html += `<h${n}>${inline(m[2])}</h${n}>`;
      } else if (/^\s*([-*_])(\s*\1){2,}\s*$/.test(line)) {
        flush();
        html += "<hr>";
      } else if (/^\s*>/.test(line)) {
        flush();
        const quote = [];
        while (i < lines.length && /^\s*>/.test(lines[i])) quote.push(lines[i++].replace(/^\s*>\s?/, ""));
        i--;
        html += `<blockquote>${blocks(quote.join("\n"))}</blockquote>`;
      } else if (/^\s*([-*+]|\d+[.)])\s+/.test(line)) {
        flush();
        const ordered = /^\s*\d+[.)]/.test(line);
        const items = [];
        while (i < lines.length && /^\s*([-*+]|\d+[.)])\s+/.test(lines[i])) {
          let item = lines[i].replace(/^\s*([-*+]|\d+[.)])\s+/, "");
          while (i + 1 < lines.length && /^\s{2,}\S/.test(lines[i + 1]) && !/^\s*([-*+]|\d+[.)])\s+/.test(lines[i + 1])) {
            item += " " + lines[++i].trim();
          }
          items.push(`<li>${inline(item)}</li>`);
          i++;
        }
        i--;
        html += ordered ? `<ol>${items.join("")}</ol>` : `<ul>${items.join("")}</ul>`;
      } else if (/^\s*\|.*\|\s*$/.test(line) && i + 1 < lines.length && /^\s*\|?\s*:?-{2,}/.test(lines[i + 1])) {
        flush();
        const rows = [];
        while (i < lines.length && /^\s*\|.*\|\s*$/.test(lines[i])) rows.push(lines[i++]);
        i--;
        html += table(rows);
      } else {
        para.push(line);
      }
    }
    flush();
    return html;
  }

  function render(text) {
    let html = "";
    const fence = /^```([\w+#.-]*)[^\n]*\n([\s\S]*?)(?:^```[ \t]*$|$(?![\s\S]))/m;
    let rest = text;
    let m;
    while ((m = fence.exec(rest)) !== null) {
      html += blocks(rest.slice(0, m.index));
      html += codeBlock(m[2].replace(/\n$/, ""), m[1]);
      rest = rest.slice(m.index + m[0].length);
    }
    return html + blocks(rest);
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
