"""Regenerate the README's settings table from `omlx.settings.SETTINGS`.

Run `python -m omlx.docs` after changing a setting; a unit test fails when the
README and the code differ.
"""

from __future__ import annotations

import re
from pathlib import Path

from omlx.settings import settings_table_markdown

BEGIN, END = "<!-- settings-table:begin -->", "<!-- settings-table:end -->"


def update_readme(path: Path) -> bool:
    text = path.read_text()
    new = re.sub(
        re.escape(BEGIN) + ".*?" + re.escape(END),
        f"{BEGIN}\n{settings_table_markdown()}\n{END}",
        text,
        flags=re.S,
    )
    if new != text:
        path.write_text(new)
    return new != text


if __name__ == "__main__":
    readme = Path(__file__).resolve().parents[1] / "README.md"
    print("updated" if update_readme(readme) else "up to date", readme)
