"""One sequence prefilled and decoded on its own, outside mlx-lm's `BatchGenerator`.

A lone request runs the plain `KVCache` loop that mlx-lm's `generate_step` runs (chunked
prefill, then each step launches the next token's forward pass before reading the current
one), cheaper per step than the batch; when a second request arrives the engine hands it to
the `BatchGenerator` (`handoff`) with its cache, the tokens in it and the one token still to
feed (docs/design/solo-path.md). The engine also prefills newcomers to a busy batch with
`feed_chunk` and hands them over with their last prompt token.

With a `quantum`, every chunk's attention shape comes from a small grid that repeats, so
MLX's CUDA backend reuses the cuDNN graphs it built per shape: chunks start at a multiple of
it (`align_cached`) and the last one is padded up to one, its padding trimmed from the cache
after (docs/design/prefill-grid.md). A model with windows or recurrent layers is never padded; its
chunks also end on the prefix cache's capture points, where its layers' state is captured
(`Captures`, docs/design/cache-kinds.md).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache, TokenBuffer, make_prompt_cache
from mlx_lm.sample_utils import greedy_sampler

from omlx.engine.buffers import trim_buffer_cache
from omlx.engine.layer_captures import Captures
from omlx.engine.step_clock import PERF, StepClock

Sampler = Callable[[mx.array], mx.array]
# the most a batched chunk copies of its members' cached keys and values (`feed_chunks_together`)
BATCH_COPY_LIMIT = 256 << 20


def plain_kv(cache: list[Any]) -> bool:
    """Every layer is a plain `KVCache`: trimmable, and batchable without padding."""
    return all(type(c) is KVCache for c in cache)


def align_cached(cache: list[Any] | None, cached: int, quantum: int) -> tuple[list[Any] | None, int]:
    """`cache` cut to the largest multiple of `quantum` tokens it holds, as views ending at the
    new depth: the next write goes to a new buffer, never into a stored block's own arrays."""
    extra = cached % quantum if quantum and cache is not None else 0
    if not extra or not plain_kv(cache):
        return cache, cached
    if cached <= extra:
        return None, 0
    keep = cached - extra
    for c in cache:
        c.keys, c.values, c.offset = c.keys[..., :keep, :], c.values[..., :keep, :], keep
    return cache, keep


# Seconds to build a cuDNN attention graph for a shape met the first time (docs/design/prefill-grid.md)
GRAPH_BUILD_S = 0.04


MLX_SDPA_CACHE_DEFAULT = 128  # MLX's own size of that cache


def sdpa_graph_capacity() -> int:
    """How many attention graphs MLX's CUDA backend keeps per thread (`omlx serve` sets 1,024)."""
    try:
        return int(os.environ.get("MLX_CUDA_SDPA_CACHE_SIZE", MLX_SDPA_CACHE_DEFAULT))
    except ValueError:
        return MLX_SDPA_CACHE_DEFAULT


class PrefillShapes:
    """The (batch, queries, keys) attention shapes of the prefill chunks an engine's thread
    has run, least recently used first: on a CUDA GPU each has its cuDNN graph built, kept in
    a per-thread LRU of `capacity` (MLX's `MLX_CUDA_SDPA_CACHE_SIZE`) that this mirrors."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self._seen: OrderedDict[tuple[int, int, int], None] = OrderedDict()

    def add(self, batch: int, queries: int, keys: int) -> None:
        shape = (batch, queries, keys)
        self._seen[shape] = None
        self._seen.move_to_end(shape)
        while len(self._seen) > self.capacity:
            self._seen.popitem(last=False)

    def __contains__(self, shape: object) -> bool:
        return shape in self._seen


def _chunk_len(depth: int, todo: int, step: int, stops: Sequence[int] = ()) -> int:
    """Tokens of the next chunk with `depth` cached and `todo` to feed (never the last one),
    ending at the first of `stops` (token indices) after `depth`, if any comes first."""
    n = min(step - depth % step, todo - 1) if todo > 1 else 0
    stop = next((p for p in stops if p > depth), None)
    return min(n, stop - depth) if stop is not None else n


def _padding(n: int, depth: int, quantum: int) -> int:
    return (-n) % quantum if quantum and depth % quantum == 0 else 0


def onto_built_shapes(
    cache: list[Any] | None,
    cached: int,
    prompt_len: int,
    step: int,
    shapes: PrefillShapes | None,
    quantum: int,
    prefill_seconds: Callable[[int, int], float | None],
) -> tuple[list[Any] | None, int]:
    """A restored prefix cut back to the multiple of `step` below when that first chunk's
    attention shape is built and its own is not, and recomputing the tokens cut
    (`prefill_seconds(tokens, depth)`) costs less than a build (docs/design/prefill-grid.md)."""
    extra = cached % step if cache is not None and shapes is not None else 0
    if not extra or prompt_len - 1 - cached <= step - extra:
        return cache, cached  # a prompt ending before the multiple above has a last chunk's shape either way
    base = cached - extra
    if first_chunk_shape(cached, prompt_len - cached, step, quantum) in shapes:
        return cache, cached
    if first_chunk_shape(base, prompt_len - base, step, quantum) not in shapes:
        return cache, cached  # a graph to build either way
    recompute = prefill_seconds(extra, base)
    if recompute is None or recompute >= GRAPH_BUILD_S:
        return cache, cached
    return align_cached(cache, cached, step)


def first_chunk_shape(depth: int, todo: int, step: int, quantum: int) -> tuple[int, int, int] | None:
    """The attention shape of the first chunk a `SoloSequence` feeds with `depth` tokens cached
    and `todo` to feed (None: only the last token is left, fed alone)."""
    n = _chunk_len(depth, todo, step)
    if not n:
        return None
    pad = _padding(n, depth, quantum)
    return (1, n + pad, depth + n + pad)


class SoloSequence:
    """Prefill and pipelined decode of one sequence (all calls on the engine thread)."""

    def __init__(
        self,
        model: Any,
        prompt: list[int],
        *,
        cache: list[Any] | None,
        cached: list[int],
        sampler: Sampler | None,
        logits_processors: list[Callable],
        prefill_step_size: int,
        quantum: int = 0,
        shapes: PrefillShapes | None = None,
        captures: Captures | None = None,
        clock: StepClock | None = None,
        vision: Any = None,
    ):
        if not prompt:
            raise ValueError("a solo sequence needs at least one prompt token to feed")
        self.model = model
        self.cache = cache if cache is not None else make_prompt_cache(model)
        self.fed: list[int] = list(cached)  # the tokens whose keys/values are in `cache`
        self.todo: list[int] = list(prompt)  # prompt tokens not fed yet
        self.sampler = sampler or greedy_sampler  # BatchGenerator's fallback too
        self.processors = logits_processors
        self.context = TokenBuffer(self.fed) if logits_processors else None
        self.step_size = prefill_step_size
        # see the module's docstring; chunks end on multiples of the step, so it must be one too
        self.quantum = quantum if quantum and prefill_step_size % quantum == 0 and plain_kv(self.cache) else 0
        self.shapes = shapes  # where the chunks fed are recorded, if anywhere
        self.captures = captures  # a stateful model's layer states, taken at block boundaries
        self.clock = clock  # where its decode steps' time goes, if anywhere
        # a vision prompt's chunks' image features and positions (`vision_lm.VisionPrefill`); its
        # cache carries the rope delta, so it is never padded (plain_kv is false)
        self.vision = vision
        # The sampled token (and its logprobs) that has not been returned yet: set once the
        # prompt is fed; after that, always one forward pass ahead of what was returned.
        self.pending: tuple[mx.array, mx.array] | None = None

    @property
    def prefilling(self) -> bool:
        return self.pending is None

    def feed_chunk(self) -> bool:
        """Launch (not wait for: `wait`) one chunk of the prompt, never its last token; True once
        only that is left. Chunks end on multiples of the step size counted from the
        sequence's start, so long prompts repeat the same shapes (prefill-grid.md)."""
        n = self.chunk_len()
        if n:
            chunk = self.todo[:n]
            pad = self.padding(n)
            extra = self.vision.chunk(len(self.fed), n) if self.vision is not None else {}
            self.model(mx.array(chunk + chunk[-1:] * pad)[None], cache=self.cache, **extra)
            if self.shapes is not None:
                self.shapes.add(1, n + pad, len(self.fed) + n + pad)
            for c in self.cache if pad else ():
                c.trim(pad)
            mx.async_eval([c.state for c in self.cache])
            self._advance(chunk)
            if self.captures is not None and (len(self.todo) == 1 or len(self.fed) in self.captures.points):
                self.captures.take(self.cache, len(self.fed))
        return len(self.todo) <= 1

    def padding(self, n: int) -> int:
        """Tokens to feed after a chunk of `n` so that it ends on a multiple of the quantum
        (only a last chunk needs any; none when the cached depth is off the grid anyway)."""
        return _padding(n, len(self.fed), self.quantum)

    def chunk_len(self) -> int:
        """Prompt tokens the next `feed_chunk` feeds (0: only the last one is left)."""
        stops = self.captures.points if self.captures is not None else ()
        return _chunk_len(len(self.fed), len(self.todo), self.step_size, stops)

    def _advance(self, chunk: list[int]) -> None:
        """`chunk`, now in the cache, moves from the prompt to the fed tokens."""
        if self.context is not None:
            self.context.update_and_fetch(mx.array(chunk, dtype=mx.int32))
        self.fed += chunk
        self.todo = self.todo[len(chunk) :]

    def wait(self) -> None:
        """Until the chunks launched so far are in the cache."""
        mx.eval([c.state for c in self.cache])

    def prefill(self) -> bool:
        """Feed one chunk of the prompt; True when the prompt is fed and a token is pending (the
        last prompt token is fed alone, as mlx-lm does: the LM head runs on one position)."""
        more = not self.feed_chunk()
        self.wait()
        trim_buffer_cache()
        if more:
            return False
        last = self.todo
        self.todo = []
        self.pending = self._forward(mx.array(last))
        mx.async_eval(*self.pending)
        self.fed += last
        self._crossed()
        return True

    def next(self, *, launch: bool) -> tuple[int, mx.array]:
        """Return the pending token and its logprobs; with `launch`, first start the forward
        pass that feeds it (so the device works while the host handles this token)."""
        assert self.pending is not None, "prefill first"
        token, logprobs = self.pending
        tic = built = launched = PERF()
        if launch:
            self.pending = self._forward(token)
            built = PERF()
            mx.async_eval(*self.pending)
            launched = PERF()
        else:
            self.pending = None
        value = token.item()
        if self.clock is not None:
            self.clock.decode_step(built - tic, launched - built, PERF() - launched)
            self.clock.decoded_rows(1)
        if launch:
            self.fed.append(value)
            self._crossed()
        return value, logprobs

    def _crossed(self) -> None:
        """A forward pass just made the cache's length a block multiple: capture its state."""
        if self.captures is not None:
            self.captures.at_boundary(self.cache, len(self.fed))

    def handoff(self, unfed: int | None = None) -> tuple[list[int], list[Any], list[int]]:
        """(tokens still to feed, cache, tokens in the cache) for `BatchGenerator.insert`: the
        rest of the prompt while prefilling, else `unfed`, the token `next(launch=False)` returned."""
        assert self.pending is None, "a launched step cannot be handed off"
        todo = self.todo if unfed is None else [unfed]
        assert todo, "nothing left to feed"
        return todo, self.cache, self.fed

    def _forward(self, tokens: mx.array) -> tuple[mx.array, mx.array]:
        logits = self.model(tokens.reshape(1, -1), cache=self.cache)[:, -1, :]
        if self.context is not None:
            context = self.context.update_and_fetch(tokens.reshape(-1).astype(mx.int32))
            for processor in self.processors:
                logits = processor(context, logits)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        return self.sampler(logprobs), logprobs.squeeze(0)


def feed_chunks_together(seqs: list[SoloSequence]) -> list[bool]:
    """`feed_chunk` for each of `seqs` (launched, not waited for); which have only their last
    prompt token left. Chunks of one shape (after padding) on plain `KVCache` layers go
    through the model as one batch (docs/design/prefill-grid.md, "Batched chunks")."""
    groups: dict[tuple[int, int], list[SoloSequence]] = {}
    for seq in seqs:
        n = seq.chunk_len()
        if n and (not seq.fed or n < seq.step_size) and plain_kv(seq.cache) and seq.vision is None:
            groups.setdefault((len(seq.fed), n + seq.padding(n)), []).append(seq)
        else:
            seq.feed_chunk()
    for (offset, width), members in groups.items():
        if len(members) > 1 and len(members) * offset * _kv_bytes_per_token(members[0]) <= BATCH_COPY_LIMIT:
            _feed_batch(members, offset, width)
        else:
            for seq in members:
                seq.feed_chunk()
    return [len(seq.todo) <= 1 for seq in seqs]


def _kv_bytes_per_token(seq: SoloSequence) -> int:
    return sum(c.keys.nbytes // c.keys.shape[2] + c.values.nbytes // c.values.shape[2] for c in seq.cache if c.keys is not None)


def _feed_batch(members: list[SoloSequence], offset: int, width: int) -> None:
    """One chunk of each of `members` (`offset` tokens cached each, chunks `width` long once
    padded): their caches stacked into a batch cache, then each takes its row back (views)."""
    batch = []
    for layer in range(len(members[0].cache)):
        c = KVCache()
        if offset:
            c.keys = mx.concatenate([m.cache[layer].keys[..., :offset, :] for m in members])
            c.values = mx.concatenate([m.cache[layer].values[..., :offset, :] for m in members])
            c.offset = offset
        batch.append(c)
    chunks = [m.todo[: m.chunk_len()] for m in members]
    members[0].model(mx.array([c + c[-1:] * (width - len(c)) for c in chunks]), cache=batch)
    if members[0].shapes is not None:
        members[0].shapes.add(len(members), width, offset + width)
    for i, m in enumerate(members):
        end = offset + len(chunks[i])  # keys and values past it are padding's
        for layer, c in enumerate(batch):
            own = KVCache()
            own.keys, own.values, own.offset = c.keys[i : i + 1, :, :end], c.values[i : i + 1, :, :end], end
            m.cache[layer] = own  # in place: the engine hands this list to the BatchGenerator
        m._advance(chunks[i])
    mx.async_eval([c.state for c in batch])
