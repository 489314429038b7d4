"""Per-model settings and named profiles, persisted in `$OMLX_HOME/model_settings.json`.

Precedence for a request: request parameters > profile > model settings > global
defaults. A request for `model:profile` uses that profile on the same loaded engine.
"""

from __future__ import annotations

import fnmatch
import json
import os
import threading
from pathlib import Path
from typing import Any, Literal

from pydantic import ConfigDict, Field, ValidationError

from omlx.api.wire import SamplingValues
from omlx.errors import InvalidRequestError, NotFoundError


class GenerationDefaults(SamplingValues):
    """What a model or profile may preset; None means "not set here"."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    max_tokens: int | None = Field(default=None, ge=1)
    # what a request may ask for at most (agents send max_tokens 32000 whatever the model)
    max_tokens_cap: int | None = Field(default=None, ge=1, description="Cap on a request's max_tokens")
    context_length: int | None = Field(default=None, ge=16, description="Cap on the context window")
    chat_template_kwargs: dict[str, Any] | None = None
    # the system message of a request that sends none (a profile's: a prompt preset, docs/chat.md)
    system_prompt: str | None = Field(default=None, max_length=100_000, description="System message when a request sends none")


class ModelSettings(GenerationDefaults):
    aliases: list[str] = Field(default_factory=list, description="Other names, globs allowed (claude-*)")
    pinned: bool = False
    ttl: int | None = Field(default=None, ge=0, description="Idle seconds before unload; 0 = never")
    type: Literal["llm", "embedding", "reranker"] | None = None
    speculation: bool | None = Field(default=None, description="Prompt-lookup speculation (None: the server's)")
    # a smaller model of the same tokenizer that drafts for this one (docs/design/speculation.md)
    draft_model: str | None = Field(default=None, min_length=1, description="Model id that drafts for a request decoding alone")
    profiles: dict[str, GenerationDefaults] = Field(default_factory=dict)

    def effective(self, profile: str | None) -> GenerationDefaults:
        """The model's defaults with the profile's set fields on top."""
        base = GenerationDefaults(**self.model_dump(include=set(GenerationDefaults.model_fields)))
        if profile is None:
            return base
        overrides = self.profiles[profile].model_dump(exclude_none=True)
        return base.model_copy(update=overrides)


def _invalid(exc: ValidationError) -> InvalidRequestError:
    """The first validation problem as a 400 naming the field."""
    err = exc.errors()[0]
    field = ".".join(str(p) for p in err["loc"])
    return InvalidRequestError(f"Invalid value for '{field}': {err['msg']}.", param=field)


_DEFAULT = ModelSettings()


class ModelSettingsStore:
    """Thread-safe, atomically persisted map of model id → ModelSettings."""

    def __init__(self, path: Path):
        self.path = path
        self._lock = threading.Lock()
        self._data: dict[str, ModelSettings] = {}
        if path.exists():
            try:
                raw = json.loads(path.read_text())
                self._data = {k: ModelSettings(**v) for k, v in raw.items()}
            except (OSError, ValueError, ValidationError, TypeError, AttributeError) as exc:
                from omlx.errors import ConfigError

                raise ConfigError(f"Cannot read {path}: {exc}. Fix or delete the file.") from None

    def get(self, model_id: str) -> ModelSettings:
        """The model's settings, shared and read-only (this sits on every request's path)."""
        with self._lock:
            return self._data.get(model_id, _DEFAULT)

    def _editable(self, model_id: str) -> ModelSettings:
        return self.get(model_id).model_copy(deep=True)

    def put(self, model_id: str, settings: ModelSettings) -> None:
        with self._lock:
            self._data[model_id] = settings
            self._save()

    def update(self, model_id: str, patch: dict[str, Any]) -> ModelSettings:
        current = self.get(model_id).model_dump()
        current.update(patch)
        try:
            new = ModelSettings(**current)
        except ValidationError as exc:
            raise _invalid(exc) from None
        self.put(model_id, new)
        return new

    def set_profile(self, model_id: str, name: str, values: dict[str, Any], *, create: bool) -> ModelSettings:
        if not name or ":" in name or "/" in name:
            raise InvalidRequestError("Profile names must be non-empty and contain no ':' or '/'.", param="name")
        settings = self._editable(model_id)
        if create and name in settings.profiles:
            raise InvalidRequestError(f"Profile '{name}' already exists for '{model_id}'.", param="name")
        if not create and name not in settings.profiles:
            raise NotFoundError(f"Model '{model_id}' has no profile '{name}'.")
        try:
            settings.profiles[name] = GenerationDefaults(**values)
        except ValidationError as exc:
            raise _invalid(exc) from None
        self.put(model_id, settings)
        return settings

    def rename_profile(self, model_id: str, name: str, new: str) -> ModelSettings:
        """`name` becomes `new`, its values and place kept."""
        if not isinstance(new, str) or not new or ":" in new or "/" in new:
            raise InvalidRequestError("Profile names must be non-empty and contain no ':' or '/'.", param="to")
        settings = self._editable(model_id)
        if name not in settings.profiles:
            raise NotFoundError(f"Model '{model_id}' has no profile '{name}'.")
        if new != name and new in settings.profiles:
            raise InvalidRequestError(f"Profile '{new}' already exists for '{model_id}'.", param="to")
        settings.profiles = {new if k == name else k: v for k, v in settings.profiles.items()}
        self.put(model_id, settings)
        return settings

    def delete_profile(self, model_id: str, name: str) -> None:
        settings = self._editable(model_id)
        if name not in settings.profiles:
            raise NotFoundError(f"Model '{model_id}' has no profile '{name}'.")
        del settings.profiles[name]
        self.put(model_id, settings)

    def resolve_alias(self, name: str, known: set[str]) -> str | None:
        """The model id an alias (exact first, then glob) points to, if any."""
        with self._lock:
            items = [(mid, s.aliases) for mid, s in self._data.items() if mid in known]
        for mid, aliases in items:
            if name in aliases:
                return mid
        for mid, aliases in items:
            if any(fnmatch.fnmatchcase(name, pattern) for pattern in aliases):
                return mid
        return None

    def _save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps({k: v.model_dump(exclude_defaults=True) for k, v in self._data.items()}, indent=2))
        os.replace(tmp, self.path)
