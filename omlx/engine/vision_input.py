"""A vision prompt's images as the engine takes them (numpy, no MLX: built on the asyncio side)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class VisionInput:
    """A prompt's images, ready for the vision tower: `pixel_values` as the model's image
    processor made them (all images' patches, in order), `grid_thw` (n, 3) per image, and where
    each image's tokens lie in the prompt (`spans`: start, length); `keys`: each image's digest at
    its first token's position, the prefix cache's extra block keys."""

    pixel_values: np.ndarray
    grid_thw: np.ndarray
    spans: list[tuple[int, int]]
    activation_bytes: int = 0  # the vision tower's estimated peak, which admission reserves too
    keys: dict[int, bytes] = field(default_factory=dict)

    def patches(self, i: int) -> tuple[int, int]:
        """Image `i`'s rows of `pixel_values` (start, end)."""
        counts = self.grid_thw.prod(axis=1)
        start = int(counts[:i].sum())
        return start, start + int(counts[i])

    @property
    def end(self) -> int:
        """The index after the last image token."""
        return max(s + n for s, n in self.spans) if self.spans else 0


@dataclass
class OcrInput:
    """A DeepSeek-OCR prompt's images as mlx-vlm's processor made them (on the engine thread: MLX
    arrays): per image its tiles (None when it is the global view only), its global view (1, 3,
    1024, 1024) and its tile grid (across, down); where each image's slots lie (`spans`); `keys` as
    `VisionInput`'s."""

    views: list[tuple[Any, Any, tuple[int, int]]]
    spans: list[tuple[int, int]]
    activation_bytes: int = 0
    keys: dict[int, bytes] = field(default_factory=dict)

    @property
    def end(self) -> int:
        """The index after the last image token."""
        return max(s + n for s, n in self.spans) if self.spans else 0


def image_keys(vision: VisionInput | OcrInput | None) -> dict[int, bytes] | None:
    """A prompt's image keys (None: no images): the prefix cache's extra block keys."""
    return (vision.keys or None) if vision is not None else None
