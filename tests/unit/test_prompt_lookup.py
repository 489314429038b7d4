"""Prompt-lookup drafts: what follows the latest earlier occurrence of the sequence's end, a
length that adapts to acceptance, and rests while acceptance is low (no model)."""

from __future__ import annotations

from omlx.engine.prompt_lookup import FIRST_DRAFT, MISS_STREAK, REST_TOKENS, WINDOW, PromptLookup
from omlx.engine.speculation import step_aside


def test_a_draft_is_what_followed_the_latest_earlier_occurrence_of_the_end():
    lookup = PromptLookup([1, 2, 3, 4, 5, 6, 7, 9, 2, 3, 4, 8, 8], draft_max=8)
    lookup.extend([9, 2, 3, 4])  # `2 3 4` occurred twice: the later one (followed by 8 8 9) wins
    assert lookup.draft(8) == [8, 8, 9, 2][:FIRST_DRAFT]
    assert lookup.draft(2) == [8, 8]


def test_the_longest_matching_ngram_decides():
    # `5 3 4` occurs once (followed by 7); `3 4` last occurred followed by 1
    lookup = PromptLookup([5, 3, 4, 7, 0, 3, 4, 1, 0, 5, 3, 4], draft_max=8)
    assert lookup.draft(1) == [7]


def test_no_draft_without_an_earlier_occurrence_and_a_miss_streak_rests():
    lookup = PromptLookup(list(range(100)), draft_max=8)
    for _ in range(MISS_STREAK):
        assert lookup.draft(8) == []
    assert lookup.resting
    lookup.extend(range(100, 100 + REST_TOKENS))
    assert not lookup.resting


def test_length_grows_on_full_acceptance_and_shrinks_to_what_was_kept():
    lookup = PromptLookup([1, 2, 3] * 20, draft_max=8)
    assert len(lookup.draft(16)) == FIRST_DRAFT
    lookup.accepted(FIRST_DRAFT, FIRST_DRAFT)
    assert len(lookup.draft(16)) == 8  # doubled, capped by draft_max
    lookup.accepted(8, 2)
    assert len(lookup.draft(16)) == 3  # what was kept, plus one
    assert (lookup.drafted, lookup.kept) == (FIRST_DRAFT + 8, FIRST_DRAFT + 2)


def test_low_acceptance_rests_longer_each_time_then_drafts_again():
    lookup = PromptLookup([1, 2, 3] * 20, draft_max=8)
    rests = []
    for _ in range(2):
        drafted = 0
        while drafted < WINDOW:
            assert lookup.draft(8)
            lookup.accepted(4, 0)
            drafted += 4
        assert lookup.resting
        rests.append(lookup.rest)
        lookup.extend([1, 2, 3] * (lookup.rest // 3 + 1))
        assert not lookup.resting and lookup.draft(8)
    assert rests == [REST_TOKENS, 2 * REST_TOKENS]
    # a good window resets the rest that the next low one takes
    lookup.accepted(WINDOW, WINDOW)
    assert lookup.next_rest == REST_TOKENS


def test_requests_that_cannot_keep_the_output_unchanged_step_aside():
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    plain = [KVCache(), KVCache()]
    assert step_aside(True, [], False, plain) is None  # greedy or sampled alike
    assert step_aside(False, [], False, plain) == "off"
    assert step_aside(True, [object()], False, plain) == "logits processors"
    assert step_aside(True, [], True, plain) == "constrained"
    assert step_aside(True, [], False, plain, images=True) == "images"
    assert step_aside(True, [], False, [KVCache(), RotatingKVCache(max_size=8)]) == "cache layers that cannot roll back"


def test_a_model_with_a_window_or_recurrent_layer_does_not_speculate_and_says_why(caplog):
    from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

    from omlx.engine.speculation import model_speculates

    class Layers:  # what mlx-lm's `make_prompt_cache` asks of a model: its `make_cache`
        def __init__(self, *kinds):
            self.kinds = kinds

        def make_cache(self):
            return [kind() for kind in self.kinds]

    assert model_speculates(Layers(KVCache, KVCache), "plain")
    caplog.set_level("INFO", logger="omlx.engine")
    assert not model_speculates(Layers(KVCache, lambda: RotatingKVCache(max_size=8)), "windowed")
    assert not model_speculates(Layers(lambda: ArraysCache(2), KVCache), "recurrent")
    lines = [r.getMessage() for r in caplog.records]
    assert any("model=windowed does not speculate" in line for line in lines)
    assert any("model=recurrent does not speculate" in line for line in lines)
