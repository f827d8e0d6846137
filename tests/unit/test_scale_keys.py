"""aggnet.torch.scale_keys: the keys the backend gives its int32 all-reduces,
from the sizes of its calls in order (what every rank sees alike)."""

import pytest

from aggnet.torch.scale_keys import ScaleKeys


def keys_of(sizes, **kw) -> list[int]:
    keys = ScaleKeys(**kw)
    return [keys.key(s) for s in sizes]


def last_use(sizes, keys) -> list[int | None]:
    """For each call, the call its key was last given to (None: a new key)."""
    seen, out = {}, []
    for i, k in enumerate(keys):
        out.append(seen.get(k))
        seen[k] = i
    return out


def test_a_loop_over_tensors_of_distinct_sizes_carries_each_from_its_last_step():
    sizes = [100, 200, 300] * 5
    keys = keys_of(sizes)
    assert keys[:3] == [0, 1, 2] and keys == keys[:3] * 5
    assert last_use(sizes, keys)[3:] == list(range(12))


def test_tensors_of_one_size_issued_together_never_share_a_key_with_the_call_before():
    sizes = [64] * 12
    keys = keys_of(sizes)
    uses = last_use(sizes, keys)
    assert len(set(keys)) == 2  # LAG keys a size, no more
    for i, prev in enumerate(uses):
        assert prev is None or i - prev >= 2


def test_a_step_of_fewer_calls_than_the_lag_carries_from_as_far_back_as_the_lag():
    keys = keys_of([7] * 6, lag=4)
    assert keys == [0, 1, 2, 3, 0, 1]
    # one size a step, lag 1: every step its own last one
    assert keys_of([7] * 5, lag=1) == [0] * 5


def test_equal_layers_among_others_take_the_key_used_longest_ago_of_those_lag_calls_back():
    # a step: two equal layers, a bias, two more equal layers, over three steps
    sizes = [1000, 1000, 10, 1000, 1000] * 3
    keys = keys_of(sizes)
    assert keys == [0, 1, 2, 0, 1] * 3
    for i, prev in enumerate(last_use(sizes, keys)):
        if prev is not None:
            assert sizes[prev] == sizes[i] and i - prev >= 2


def test_two_tensors_of_one_size_a_step_each_carry_from_themselves():
    # FSDP2's two equal layers and its root, in the order backward reduces them
    sizes = [500, 500, 900] * 4
    keys = keys_of(sizes)
    assert keys == [0, 1, 2] * 4
    assert last_use(sizes, keys)[3:] == list(range(9))


def test_the_keys_depend_only_on_the_sizes_in_order():
    sizes = [5, 9, 5, 5, 9, 3, 5, 9] * 4
    assert keys_of(sizes) == keys_of(sizes)
    assert keys_of(sizes) != keys_of(sizes[1:] + sizes[:1])


def test_a_forgotten_size_takes_a_new_key():
    keys = keys_of([1, 2, 3, 1], max_sizes=2, lag=1)
    assert keys == [0, 1, 2, 3]  # size 1 was the least recently used of three
    assert keys_of([1, 2, 1, 3, 1], max_sizes=2, lag=1) == [0, 1, 0, 2, 0]


def test_a_lag_below_one_is_refused():
    with pytest.raises(ValueError, match="lag must be at least 1"):
        ScaleKeys(lag=0)
