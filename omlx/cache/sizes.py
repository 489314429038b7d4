"""Parse human-written byte sizes (`--hot-cache-max-size`, `--ssd-cache-max-size`,
`--max-model-memory`): a unit with an `i` is binary (KiB = 1024), one without is decimal
(KB = K = 1000), as in Kubernetes; "20%" is a share of `total`."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

from pydantic import ByteSize, TypeAdapter

__all__ = ["parse_size", "format_size"]

# pydantic's ByteSize reads the byte forms (a unit with an `i` is binary); it lacks the short
# units (K, Mi, ...), which are spelled out for it here, and the "%" share, handled below.
_BYTE_SIZE = TypeAdapter(ByteSize)
_UNITS = {"", "b", "kb", "mb", "gb", "tb", "kib", "mib", "gib", "tib"}
_SHORT = {"": "b", "k": "kb", "m": "mb", "g": "gb", "t": "tb", "ki": "kib", "mi": "mib", "gi": "gib", "ti": "tib"}

_PATTERN = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*|%)\s*$")


def parse_size(text: str, *, total: int | None) -> int:
    """The bytes `text` names: "800000", "2GB", "512MiB", "1.5G", "0", or "20%" (a share of
    `total`); a ValueError saying what was wrong and what is accepted."""
    if not isinstance(text, str):
        raise ValueError(f"size must be a string, got {type(text).__name__}")
    m = _PATTERN.match(text)
    if m is None:
        raise ValueError(
            f"invalid size {text!r}: expected a non-negative number with an optional unit "
            "(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB) or a percentage such as '20%'"
        )
    number_text, unit = m.group(1), m.group(2).lower()
    try:
        number = Decimal(number_text)
    except InvalidOperation as exc:  # pragma: no cover - the regex already guards this
        raise ValueError(f"invalid size {text!r}: bad number") from exc
    if unit == "%":
        if total is None:
            raise ValueError(
                f"invalid size {text!r}: a percentage needs a total to take a share of"
            )
        if total < 0:
            raise ValueError(f"invalid total {total} for size {text!r}")
        if number > 100:
            raise ValueError(f"invalid size {text!r}: percentage above 100%")
        return int(Decimal(total) * number / 100)
    unit = _SHORT.get(unit, unit)
    if unit not in _UNITS:
        raise ValueError(
            f"invalid size {text!r}: unknown unit {m.group(2)!r} "
            "(use B, KB, MB, GB, TB, KiB, MiB, GiB, TiB or %)"
        )
    return int(_BYTE_SIZE.validate_python(f"{number}{unit}"))


def format_size(n: int) -> str:
    """Short binary-unit rendering for logs and stats (``12.0 MiB``)."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"
