"""Every server setting, declared once: name, type, default, help, CLI flag and env var.

Layering: CLI flag > ``OMLX_<NAME>`` environment variable > ``$OMLX_HOME/settings.json``
> default. The CLI options and the README's settings table are generated from
``SETTINGS`` so the documentation cannot drift from the code.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omlx.errors import ConfigError


def omlx_home() -> Path:
    """`OMLX_HOME` relocates ~/.omlx (tests use temporary homes)."""
    return Path(os.environ.get("OMLX_HOME") or Path.home() / ".omlx").expanduser()


@dataclass(frozen=True)
class Setting:
    """One setting. `help` is the README's description; `summary` is `omlx serve --help`'s
    line (it fits 80 columns beside the flag)."""

    name: str
    type: type
    default: Any
    help: str
    choices: tuple[str, ...] | None = None
    minimum: float | None = None
    # Defaults that depend on OMLX_HOME are shown as text and resolved at load time.
    default_doc: str | None = None
    summary: str = ""

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return "OMLX_" + self.name.upper()


SETTINGS: tuple[Setting, ...] = (
    Setting("host", str, "127.0.0.1", "Address to bind. Without an API key only loopback is safe.", summary="Address to bind"),
    Setting("port", int, 8000, "TCP port to listen on.", minimum=1, summary="TCP port to listen on"),
    Setting(
        "model_dir", Path, None, "Folder scanned for models.", default_doc="$OMLX_HOME/models",
        summary="Folder scanned for models",
    ),
    Setting("model", str, None, "Model id to load at start, first, besides the models loaded when the server last stopped and the pinned ones (others load on their first request).", summary="Model to load at start"),
    Setting(
        "api_key",
        str,
        None,
        "Require this key (Bearer or x-api-key) on every route but /health, / and the dashboard's login; "
        "the /admin dashboard asks for it at login.",
        summary="Key required on all but /health and login",
    ),
    Setting(
        "metrics_public",
        bool,
        False,
        "Serve /metrics without the API key (for a Prometheus scraper on a trusted network).",
        summary="Serve /metrics without the API key",
    ),
    Setting(
        "max_concurrent_requests", int, 8, "Sequences decoded together per model.", minimum=1,
        summary="Sequences decoded together per model",
    ),
    Setting(
        "max_waiting_requests",
        int,
        64,
        "Requests allowed to wait for a batch slot; beyond it 429 with Retry-After.",
        minimum=0,
        summary="Requests that may wait; beyond it 429",
    ),
    Setting(
        "prefill_step_size",
        int,
        512,
        "Prompt tokens prefilled per request per engine step (up to 8 requests at once), so running streams keep flowing. On a CUDA GPU keep it a multiple of the cache block size, so that MLX reuses its prefill attention graphs; there a request alone in its engine goes in chunks of its smallest multiple of at least 2048 tokens, as raw mlx-lm does.",
        minimum=16,
        summary="Prompt tokens prefilled per request per step",
    ),
    Setting(
        "graph_warmup_tokens",
        int,
        32768,
        "On a CUDA GPU, a model's engine feeds a dummy prompt of this many tokens (at most its context window, and a KV cache of about 5% of GPU memory) once after loading, in the chunks a lone prompt is prefilled in, while no model has requests (one that comes waits for at most the chunk in progress; the warm-up then drops what it fed and starts over when all are idle again, giving up after 8 interruptions): MLX then builds the attention graph of each chunk shape (tens of milliseconds each) before a user's long prompt needs it. 0 = off; ignored on other devices.",
        minimum=0,
        summary="CUDA: dummy prompt that builds graphs (0=off)",
    ),
    Setting(
        "speculation",
        bool,
        True,
        "Prompt-lookup speculative decoding: a request (greedy or sampled) drafts up to --draft-max tokens from n-grams of its own prompt and output and verifies them in one forward pass, alone or with the other batch rows' drafts in the same pass (--batch-speculation), as long as the wider pass pays (requests without logits processors or images, on models with only full-attention layers; output unchanged); a request whose drafts are mostly rejected stops drafting for a while. A model's own `speculation` setting overrides it.",
        summary="Prompt-lookup speculation (--no-speculation: off)",
    ),
    Setting(
        "batch_speculation",
        str,
        "auto",
        "Whether requests decoding in a batch verify their drafts together in one forward pass (a request alone always may): on, off, or auto = on a CPU only, since a GPU's wider batch step is not measured yet to pay (docs/design/speculation.md).",
        choices=("auto", "on", "off"),
        summary="Batch rows speculate together (auto: CPU only)",
    ),
    Setting(
        "draft_max",
        int,
        8,
        "Most tokens a speculative draft holds (its length adapts to what the request accepts).",
        minimum=1,
        summary="Most tokens a speculative draft holds",
    ),
    Setting(
        "default_max_tokens",
        int,
        4096,
        "Completion limit when a request sets none (always clamped to the context window).",
        minimum=1,
        summary="Completion limit when a request sets none",
    ),
    Setting(
        "keepalive_interval",
        float,
        10.0,
        "Seconds between keep-alives (SSE comment / Anthropic ping) on a stream until its first token.",
        minimum=0.05,
        summary="Seconds between keep-alives until a 1st token",
    ),
    Setting(
        "max_image_bytes",
        int,
        20 << 20,
        "Largest image a request may carry, in bytes (encoded, as sent or fetched); larger: 400.",
        minimum=1,
        summary="Largest image per request part, in bytes",
    ),
    Setting(
        "max_image_pixels",
        int,
        32 << 20,
        "Most pixels (width x height) an image may have; checked from its header before it is decoded, so a decompression bomb is refused with a 400.",
        minimum=1,
        summary="Most pixels an image may have",
    ),
    Setting(
        "allow_remote_images",
        bool,
        False,
        "Fetch http(s) image URLs in requests (off: only data: URLs and base64 images are accepted), within --max-image-bytes and --remote-image-timeout.",
        summary="Fetch http(s) image URLs in requests",
    ),
    Setting(
        "remote_image_timeout",
        float,
        10.0,
        "Seconds a remote image may take to fetch in all.",
        minimum=0.1,
        summary="Seconds a remote image may take to fetch",
    ),
    Setting(
        "compute_dtype",
        str,
        "auto",
        "Dtype models compute in. auto: float32 on a CPU (fastest there), the model's own dtype on a GPU.",
        choices=("auto", "float32", "bfloat16", "float16", "native"),
        summary="auto, float32, bfloat16, float16 or native",
    ),
    Setting(
        "max_model_memory",
        str,
        "80%",
        "Memory all loaded models may use together (bytes like 16GB or a share of RAM / GPU memory like 80%); least recently used idle models are unloaded to make room. 0 = no limit.",
        summary="Memory loaded models may use (bytes or %)",
    ),
    Setting(
        "max_kv_memory",
        str,
        "auto",
        "KV cache memory one model's running sequences may hold (bytes like 8GB or a share like 30%). auto: what 90% of the device's memory (GPU memory, else RAM) leaves next to weights and other models; the hot cache tier yields first. A request waits until its prompt plus 512 tokens fit; a prompt that can never fit gets a 400; when decoding sequences outgrow it, the newest is paused and resumed later.",
        summary="KV memory per model (bytes, % or auto)",
    ),
    Setting(
        "max_process_memory",
        str,
        "0",
        "Limit on the whole process's resident memory (bytes like 12GB or a share of RAM like 90%; 0 = no limit). Over it, in turn: MLX's freed buffers are handed back, idle unpinned models are unloaded (least recently used first), the RAM and hot cache tiers shrink, and new requests wait 2 s, then get 503 with Retry-After; a model load that would cross it gets that 503. Changes apply at once.",
        summary="Limit on the process's memory (bytes or %)",
    ),
    Setting(
        "idle_timeout",
        int,
        0,
        "Unload a model after this many idle seconds (0 = never); a model's own ttl overrides it.",
        minimum=0,
        summary="Unload a model after this many idle seconds",
    ),
    Setting("cache_dir", Path, None, "SSD tier of the prefix cache.", default_doc="$OMLX_HOME/cache", summary="SSD tier of the prefix cache"),
    Setting(
        "cache_block_size", int, 256, "Tokens per prefix-cache block.", minimum=16,
        summary="Tokens per prefix-cache block",
    ),
    Setting(
        "stateful_block_size",
        str,
        "auto",
        "Tokens per prefix-cache block of a model with sliding-window or recurrent layers, whose every block also holds those layers' whole state: restores of such a model are granular to it. auto: the chunk a prompt alone is prefilled in (2048 on a CUDA GPU, --prefill-step-size elsewhere), so capturing the states never cuts a prefill chunk short.",
        summary="Block tokens of window/recurrent models",
    ),
    Setting(
        "hot_cache_max_size",
        str,
        "10%",
        "Hot prefix-cache tier budget (device memory on a GPU, RAM otherwise): bytes like 2GB or a share like 20%.",
        summary="Hot cache tier budget (bytes or %)",
    ),
    Setting(
        "ram_cache_max_size",
        str,
        "auto",
        "Warm prefix-cache tier in host RAM, between a discrete GPU's hot tier and the SSD: blocks pushed out of device memory are kept here. auto: 20% of RAM on a CUDA GPU, off where the hot tier is already RAM (CPU, Apple silicon). Bytes like 16GB, a share like 10%, or 0 (off).",
        summary="RAM cache tier budget (bytes, %, auto or 0)",
    ),
    Setting(
        "ssd_cache_max_size",
        str,
        "10%",
        "SSD prefix-cache tier budget: bytes like 50GB or a share of the disk like 10%.",
        summary="SSD cache tier budget (bytes or % of disk)",
    ),
    Setting("hot_cache_only", bool, False, "Keep the prefix cache in memory only (no SSD tier).", summary="Keep the prefix cache in memory only"),
    Setting("no_cache", bool, False, "Disable the prefix cache entirely.", summary="Disable the prefix cache"),
    Setting(
        "mcp_config",
        Path,
        None,
        "A JSON or YAML file of MCP servers whose tools the server offers ({\"servers\": [...]} or {\"mcpServers\": {...}}; needs the omlx[mcp] extra): listed at /v1/mcp/tools, run by POST /v1/mcp/execute and by the tool loop a chat or Messages request opts in to with \"mcp\": true (docs/agents.md). Servers connect in the background and are retried when they fail; none holds up the start.",
        default_doc="(none)",
        summary="MCP servers' config file (JSON or YAML)",
    ),
    Setting(
        "mcp_tool_timeout",
        float,
        30.0,
        "Seconds an MCP tool call may take (POST /v1/mcp/execute and the tool loop); beyond it the call fails with 504, or the model is told so.",
        minimum=0.1,
        summary="Seconds an MCP tool call may take",
    ),
    Setting(
        "mcp_max_rounds",
        int,
        10,
        "Generations of one request's MCP tool loop (a request may ask for fewer); the last round's answer is returned as it is.",
        minimum=1,
        summary="Rounds of a request's MCP tool loop",
    ),
    Setting(
        "hf_endpoint",
        str,
        None,
        "Hugging Face hub URL for model downloads (a mirror); HF_ENDPOINT is honoured too.",
        default_doc="https://huggingface.co",
        summary="Hugging Face hub URL for downloads",
    ),
    Setting(
        "log_level",
        str,
        "info",
        "Log verbosity.",
        choices=("debug", "info", "warning", "error"),
        summary="debug, info, warning or error",
    ),
    Setting(
        "log_format",
        str,
        "text",
        "Log lines as text or as one JSON object per line (time, level, logger, request_id, model, message), on stderr and in the log files.",
        choices=("text", "json"),
        summary="text or json (one object per line)",
    ),
    Setting(
        "log_dir",
        Path,
        None,
        "Also write the log to omlx.log in this folder, rolled over daily into omlx.log.YYYY-MM-DD.",
        default_doc="(none: stderr only)",
        summary="Also write daily log files here",
    ),
    Setting(
        "log_retention_days",
        int,
        7,
        "Days of rolled-over log files kept in --log-dir.",
        minimum=1,
        summary="Days of log files kept in --log-dir",
    ),
)

SETTINGS_BY_NAME = {s.name: s for s in SETTINGS}


@dataclass
class Settings:
    """The resolved settings; `sources` says where each value came from."""

    values: dict[str, Any]
    sources: dict[str, str] = field(default_factory=dict)

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["values"][name]
        except KeyError:
            raise AttributeError(name) from None

    @property
    def home(self) -> Path:
        return omlx_home()

    def public_dict(self) -> dict[str, Any]:
        """Values safe to show (the API key is masked)."""
        out = {k: (str(v) if isinstance(v, Path) else v) for k, v in self.values.items()}
        if out.get("api_key"):
            out["api_key"] = "***"
        return out


def convert(setting: Setting, raw: Any, source: str) -> Any:
    """Convert and validate one raw value; errors name the setting and its source."""
    if raw is None:
        return None
    where = f"{setting.name} (from {source})"
    try:
        if setting.type is bool:
            if isinstance(raw, bool):
                value: Any = raw
            else:
                text = str(raw).strip().lower()
                if text in ("1", "true", "yes", "on"):
                    value = True
                elif text in ("0", "false", "no", "off", ""):
                    value = False
                else:
                    raise ValueError(f"expected true or false, got {raw!r}")
        elif setting.type is int:
            if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()):
                raise ValueError(f"expected an integer, got {raw!r}")
            value = int(str(raw).strip()) if isinstance(raw, str) else int(raw)
        elif setting.type is float:
            value = float(raw)
        elif setting.type is Path:
            value = Path(str(raw)).expanduser()
        else:
            value = str(raw)
    except (TypeError, ValueError) as exc:
        msg = str(exc) if "expected" in str(exc) else f"expected {setting.type.__name__}, got {raw!r}"
        raise ConfigError(f"Invalid value for {where}: {msg}") from None
    if setting.choices and value not in setting.choices:
        raise ConfigError(
            f"Invalid value for {where}: {value!r}; choose one of {', '.join(setting.choices)}"
        )
    if setting.minimum is not None and value < setting.minimum:
        raise ConfigError(f"Invalid value for {where}: {value} is below the minimum {setting.minimum:g}")
    return value


def settings_file() -> Path:
    return omlx_home() / "settings.json"


def read_settings_file(path: Path | None = None) -> dict[str, Any]:
    path = path or settings_file()
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"Cannot read {path}: {exc}. Fix or delete the file.") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a JSON object of setting names to values.")
    unknown = sorted(set(data) - set(SETTINGS_BY_NAME))
    if unknown:
        raise ConfigError(f"{path} has unknown settings: {', '.join(unknown)}")
    return data


def load_settings(cli: dict[str, Any] | None = None, env: dict[str, str] | None = None) -> Settings:
    """Resolve every setting: CLI > env > settings.json > default."""
    cli = {k: v for k, v in (cli or {}).items() if v is not None}
    env = dict(os.environ if env is None else env)
    file_values = read_settings_file()
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for s in SETTINGS:
        if s.name in cli:
            values[s.name], sources[s.name] = convert(s, cli[s.name], s.flag), "cli"
        elif env.get(s.env) not in (None, ""):
            values[s.name], sources[s.name] = convert(s, env[s.env], s.env), "env"
        elif s.name in file_values:
            values[s.name] = convert(s, file_values[s.name], str(settings_file()))
            sources[s.name] = "file"
        else:
            values[s.name], sources[s.name] = s.default, "default"
    home = omlx_home()
    if values["model_dir"] is None:
        values["model_dir"] = home / "models"
    if values["cache_dir"] is None:
        values["cache_dir"] = home / "cache"
    return Settings(values, sources)


def settings_table_markdown() -> str:
    """The README's settings table, generated from SETTINGS."""
    rows = ["| Flag | Env var | Default | Description |", "| --- | --- | --- | --- |"]
    for s in SETTINGS:
        default = s.default_doc or ("(none)" if s.default is None else str(s.default))
        if s.type is bool:
            default = "off" if not s.default else "on"
        extra = f" One of: {', '.join(s.choices)}." if s.choices else ""
        rows.append(f"| `{s.flag}` | `{s.env}` | `{default}` | {s.help}{extra} |")
    return "\n".join(rows)
