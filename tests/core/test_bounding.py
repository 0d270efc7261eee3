"""The prefilter's choice (dp_core.bounding): hand-computed cases of its rule."""

from __future__ import annotations

from dp_core.bounding import GROUPS_MIN_USERS, groups_per_user, prefilter_wanted


def test_a_small_sample_decides_nothing() -> None:
    assert groups_per_user(5_000, GROUPS_MIN_USERS - 1) is None
    assert groups_per_user(660, 100) == 6.6
    assert not prefilter_wanted(None, 1)


def test_many_groups_few_kept() -> None:
    # 6.6 groups per user: C_u up to 3 keeps at most half of them
    assert prefilter_wanted(6.6, 1) and prefilter_wanted(6.6, 3)
    assert not prefilter_wanted(6.6, 4)
    # below 5 groups per user the prefilter's window costs more than it saves
    assert not prefilter_wanted(4.9, 1)
    assert prefilter_wanted(5.0, 2) and not prefilter_wanted(5.0, 3)
