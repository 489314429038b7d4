"""Capture what Qwen2.5-Coder-0.5B and SmolLM2-135M really print when offered tools: the raw
text of each generation, for the tool-call corpus (tests/unit/corpus/tool_outputs_captured.json).

Rerun to refresh it (a few minutes on a CPU); review each entry's `expected`, which this
script fills with what the parser reads today, before committing:

    python -m tests.support.capture_tool_outputs [--out FILE]
    python -m tests.support.capture_tool_outputs --relabel   # only re-read the outputs kept
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather for a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "read_file", "description": "Read a text file and return its contents.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}},
    {"type": "function", "function": {
        "name": "write_file", "description": "Write text to a file, replacing it.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
                       "required": ["path", "content"]}}},
]  # fmt: skip
PROMPTS = {
    "weather": "What is the weather in Paris right now?",
    "two-cities": "Get the current weather in Paris and also in Tokyo.",
    "read": "Show me what is in the file README.md.",
    "write": "Create the file hello.py containing a hello world program.",
    "no-tool": "What is 2 + 2? Answer in one word.",
}
SETTINGS = [("greedy", 0.0, 0), ("sampled-1", 0.7, 1), ("sampled-2", 0.7, 2)]
OUT = Path(__file__).resolve().parent.parent / "unit" / "corpus" / "tool_outputs_captured.json"


def _models() -> dict[str, Path]:
    from omlx.models.default_model import DEFAULT_MODEL_ID, provision_default_model
    from tests.support.qwen_coder import cache_root, qwen_coder_dir

    smol = provision_default_model(cache_root() / "models")
    return {DEFAULT_MODEL_ID: smol, "Qwen2.5-Coder-0.5B-Instruct": qwen_coder_dir()}


def capture(out: Path) -> None:
    import mlx.core as mx
    from mlx_lm.generate import generate
    from mlx_lm.sample_utils import make_sampler

    from omlx.api.tool_prompt import template_supports_tools
    from omlx.models.discovery import discover_models
    from omlx.models.loader import load_llm
    from omlx.server.chat_pipeline import ChatTurn, _family, render_turn

    entries = []
    for name, path in _models().items():
        info = discover_models(path.parent).models[path.name]
        loaded = load_llm(info)
        tok = loaded.tokenizer
        native = template_supports_tools(tok)
        holder = type("E", (), {"tokenizer": tok})()
        family = _family(holder) if native else "hermes"
        specs = [t["function"] for t in TOOLS]
        for prompt_id, text in PROMPTS.items():
            turn = ChatTurn(messages=[{"role": "user", "content": text}], tools=specs)
            prompt, _ = render_turn(tok, turn, specs, native)
            for setting, temp, seed in SETTINGS:
                mx.random.seed(seed)
                raw = generate(loaded.model, tok, prompt, max_tokens=160, sampler=make_sampler(temp=temp))
                entries.append({"model": name, "family": family, "prompt": prompt_id, "setting": setting, "output": raw})
                print(f"{name} {prompt_id} {setting}: {len(raw)} characters", flush=True)
    write(out, entries)


def write(out: Path, entries: list[dict]) -> None:
    """The entries with `expected` as the parser reads their outputs today."""
    from omlx.api.output_parser import parse_output

    for entry in entries:
        parsed = parse_output(entry["output"], family=entry["family"], tools=TOOLS, reasoning=False)
        entry["expected"] = {
            "calls": [[c.name, c.arguments] for c in parsed.tool_calls],
            "text": parsed.text,
            "warnings": [w.code for w in parsed.warnings],
        }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"tools": TOOLS, "entries": entries}, indent=1, ensure_ascii=False) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--relabel", action="store_true", help="re-read the kept outputs; run no model")
    args = ap.parse_args()
    if args.relabel:
        write(args.out, json.loads(args.out.read_text())["entries"])
        return
    os.environ.setdefault("OMLX_HOME", tempfile.mkdtemp(prefix="omlx-capture-"))
    capture(args.out)


if __name__ == "__main__":
    main()
