"""An engine's settings, with the choices that depend on the device resolved once.

On a CUDA GPU (`discrete_gpu()`) the engine prefills newcomers itself, tracks the attention
shapes it has built graphs for, warms those graphs up while idle, and empties MLX's buffer
cache of what other threads freed (docs/design/prefill-grid.md, graph-warmup.md); elsewhere
none of that pays. Batch rows speculate on a CPU only, where it was measured (speculation.md,
"Inside the batch"). Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass

from omlx.platform_info import cpu_device, discrete_gpu

# A request alone in the engine is prefilled in chunks of at least this many tokens where the
# engine prefills (a CUDA GPU), as raw mlx-lm does (docs/design/solo-path.md, "Solo chunks").
SOLO_PREFILL_TOKENS = 2048
# Prefill chunks start and end on multiples of this on a CUDA GPU when no prefix cache sets it
# (mlx-lm's `KVCache` grows in steps of 256 too): docs/design/prefill-grid.md.
PREFILL_QUANTUM = 256


@dataclass(frozen=True)
class EngineConfig:
    """What an engine does, fixed when it is made (`resolve` reads the device)."""

    max_concurrent: int
    max_waiting: int
    prefill_step_size: int
    solo: bool  # a lone request decodes outside the BatchGenerator
    own_prefill: bool  # newcomers to a busy engine are prefilled by the engine, not mlx-lm
    solo_prefill_step_size: int  # a lone request's chunks: a multiple of the step
    graph_warmup_tokens: int  # depth of the idle attention-graph warm-up (0: none)
    track_shapes: bool  # remember the prefill chunks' attention shapes built (`PrefillShapes`)
    idle_empties_cache: bool  # an idle engine empties what other threads freed into MLX's cache
    prefill_quantum: int | None = None  # asked for (None: chosen by `prefill_grid`)
    speculation: bool = True  # prompt-lookup drafts verified in one pass (docs/design/speculation.md)
    draft_max: int = 8  # the longest draft
    batch_speculation: bool = True  # greedy batch rows speculate too, not only a request alone

    @classmethod
    def resolve(
        cls,
        *,
        max_concurrent: int = 8,
        max_waiting: int = 64,
        prefill_step_size: int = 512,
        solo: bool = True,
        own_prefill: bool | None = None,
        prefill_quantum: int | None = None,
        solo_prefill_step_size: int | None = None,
        graph_warmup_tokens: int = 0,
        graph_shapes: bool | None = None,
        idle_empties_cache: bool | None = None,
        speculation: bool = True,
        draft_max: int = 8,
        batch_speculation: bool | None = None,
    ) -> EngineConfig:
        """The settings given, with every None resolved for this device."""
        gpu = discrete_gpu()
        own = gpu if own_prefill is None else own_prefill
        solo_step = solo_prefill_step_size or (SOLO_PREFILL_TOKENS if own else prefill_step_size)
        return cls(
            max_concurrent=max_concurrent,
            max_waiting=max_waiting,
            prefill_step_size=prefill_step_size,
            solo=solo,
            own_prefill=own,
            # so that a hand-off mid-prompt leaves its chunks on the step's grid
            solo_prefill_step_size=max(1, -(-solo_step // prefill_step_size)) * prefill_step_size,
            graph_warmup_tokens=graph_warmup_tokens if own and solo else 0,
            track_shapes=gpu if graph_shapes is None else graph_shapes,
            idle_empties_cache=gpu if idle_empties_cache is None else idle_empties_cache,
            prefill_quantum=prefill_quantum,
            speculation=speculation and draft_max > 0,
            draft_max=max(0, draft_max),
            batch_speculation=speculation and draft_max > 0 and (cpu_device() if batch_speculation is None else batch_speculation),
        )

    @property
    def prefill_batch_size(self) -> int:
        """Newcomers prefilled per step (each by a chunk), as mlx-lm's own prefill would."""
        return min(8, self.max_concurrent)

    def stateful_block_size(self, setting: str) -> int:
        """Tokens per prefix-cache block of a model with stateful layers: `setting` ("auto" or a
        count); auto is a lone prompt's prefill chunk, so that its chunks end on block boundaries
        as they would without the cache (docs/design/cache-kinds.md, "Block size"). ValueError on
        a bad count."""
        if setting == "auto":
            return self.solo_prefill_step_size
        tokens = int(setting)
        if tokens < 16:
            raise ValueError(f"{tokens} tokens is under the 16 a block needs at least")
        return tokens

    def prefill_grid(self, block_size: int) -> int:
        """Prefill chunks start and end on multiples of this (0: anywhere): by default where
        the engine prefills, the prefix cache's `block_size` (else `PREFILL_QUANTUM`). It
        must divide the step, since chunks end on its multiples too."""
        q = self.prefill_quantum
        if q is None:
            q = (block_size or PREFILL_QUANTUM) if self.own_prefill else 0
        return q if q and self.prefill_step_size % q == 0 else 0
