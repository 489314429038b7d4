"""Request bodies of the admin API as pydantic models.

They put each body in the OpenAPI schema and pass it on as sent: fields are typed for the
schema but not validated here (`SkipValidation`), so each route validates as it always did,
with its own messages and `param`s. Only a body that is not a JSON object is refused here.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, SkipValidation, create_model
from pydantic.fields import FieldInfo

from omlx.pool.model_settings import GenerationDefaults, ModelSettings
from omlx.settings import SETTINGS


class PassThrough(BaseModel):
    """A JSON object; unknown fields are kept and handed to the route, which decides."""

    model_config = ConfigDict(extra="allow")


def as_sent(body: BaseModel) -> dict[str, Any]:
    """The fields the client sent (explicit nulls included), unknown ones too, unconverted."""
    sent = {name: getattr(body, name) for name in body.model_fields_set if name in type(body).model_fields}
    return {**sent, **(body.model_extra or {})}


def _unchecked(info: FieldInfo) -> tuple[Any, Any]:
    """A field typed as `info` in the schema, left unvalidated, absent unless sent."""
    return SkipValidation[info.annotation], Field(None, description=info.description, **_bounds(info))


def _bounds(info: FieldInfo) -> dict[str, Any]:
    """`ge`/`le`/`gt`/`lt` of a field's annotated metadata, for the schema."""
    out: dict[str, Any] = {}
    for meta in info.metadata:
        for key in ("ge", "le", "gt", "lt"):
            if getattr(meta, key, None) is not None:
                out[key] = getattr(meta, key)
    return out


def passthrough_of(model: type[BaseModel], name: str, doc: str, *, exclude: tuple[str, ...] = ()) -> type[BaseModel]:
    """A PassThrough with `model`'s fields (schema only); the schema says unknown fields are refused."""
    fields = {k: _unchecked(v) for k, v in model.model_fields.items() if k not in exclude}
    config = ConfigDict(extra="allow", json_schema_extra={"additionalProperties": False})
    return create_model(name, __config__=config, __doc__=doc, **fields)


def _settings_patch() -> type[BaseModel]:
    types = {bool: bool, int: int, float: float, str: str}
    fields = {
        s.name: (SkipValidation[types.get(s.type, str) | None], Field(None, description=s.help))
        for s in SETTINGS
        if s.name != "api_key"  # set only when the server starts; the route says so
    }
    config = ConfigDict(extra="allow", json_schema_extra={"additionalProperties": False})
    doc = "Settings to save in settings.json, by name; null removes one (back to its default)."
    return create_model("SettingsPatch", __config__=config, __doc__=doc, **fields)


SettingsPatch = _settings_patch()
ModelSettingsPatch = passthrough_of(
    ModelSettings, "ModelSettingsPatch",
    "Per-model settings to change; null resets one. `profiles` is ignored (profiles have their own routes).",
    exclude=("profiles",),
)
ProfileBody = passthrough_of(GenerationDefaults, "ProfileBody", "A profile's presets; unset fields are not preset.")


def required(*names: str) -> ConfigDict:
    """A PassThrough config whose schema marks `names` required (the route checks that they are)."""

    def mark(schema: dict[str, Any]) -> None:
        schema["required"] = list(names)
        for name in names:
            schema["properties"][name].pop("default", None)

    return ConfigDict(extra="allow", json_schema_extra=mark)


class LoginBody(PassThrough):
    """The main API key, to open a dashboard session."""

    model_config = required("api_key")
    api_key: SkipValidation[str] = Field(None, description="The server's main API key")


class KeyBody(PassThrough):
    """A new inference-only sub-key's name."""

    model_config = required("name")
    name: SkipValidation[str] = Field(None, min_length=1, max_length=64, description="1 to 64 characters, unique")


class RenameBody(PassThrough):
    """A profile's new name."""

    model_config = required("to")
    to: SkipValidation[str] = Field(None, description="The new name: non-empty, no ':' or '/'")
