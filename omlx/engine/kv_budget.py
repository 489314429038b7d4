"""How much KV memory an engine's sequences may hold, and what a request reserves of it.

A request is admitted when its reservation fits next to what the running sequences hold:
its prompt plus a margin of the tokens it will generate, not all of `max_tokens` (agents
send `max_tokens: 32000` with every turn). While they decode, sequences grow past their
reservations; when they outgrow the room, the newest is paused (its cache stored to the
prefix cache's tiers) and resumed once there is room again. Pure arithmetic: the engine
measures the numbers (docs/design/memory-admission.md).
"""

from __future__ import annotations

from dataclasses import dataclass

# Generated tokens a reservation covers beyond the prompt.
RESERVE_MARGIN_TOKENS = 512
# Of the device's memory (GPU memory, else RAM), the share weights, KV and the hot tier may
# fill together by default; the rest is left to activations, MLX's buffers and the system.
DEVICE_SHARE = 0.9


@dataclass
class KvBudget:
    """`bytes_per_token` of this model's KV cache (0: not known, nothing is limited); `cap`
    the most this engine's sequences may hold (`--max-kv-memory`, None: what the device
    leaves); `device_bytes` the device's memory; `draft_tokens` the longest speculative draft."""

    bytes_per_token: int
    device_bytes: int
    cap: int | None = None
    draft_tokens: int = 0  # a verify's headroom: a draft's tokens sit in the cache until trimmed

    def reservation(self, prompt_tokens: int, max_tokens: int) -> int:
        """Tokens a request reserves at admission."""
        return prompt_tokens + min(max(max_tokens, 1), RESERVE_MARGIN_TOKENS) + self.draft_tokens

    def room(self, active_bytes: int, held_bytes: int, hot_bytes: int) -> int:
        """Bytes this engine's sequences may hold now: `active_bytes` is all the memory MLX
        has in use, of which `held_bytes` this engine's sequences and `hot_bytes` the hot
        tier (which yields before anything is refused)."""
        others = max(0, active_bytes - held_bytes - hot_bytes)
        room = int(self.device_bytes * DEVICE_SHARE) - others
        return room if self.cap is None else min(room, self.cap)

    def most_tokens(self, weights_bytes: int) -> int | None:
        """The longest sequence that could ever be held here (all memory but this model's
        weights), or None where nothing is limited."""
        if not self.bytes_per_token:
            return None
        room = int(self.device_bytes * DEVICE_SHARE) - weights_bytes
        if self.cap is not None:
            room = min(room, self.cap)
        return max(0, room // self.bytes_per_token)
