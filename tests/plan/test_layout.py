"""Layout math, single process: every element of every parameter is owned exactly once."""

import itertools

import pytest

from zerolite.plan.layout import FlatLayout, size_partition

SIZES = [
    (1,),
    (1, 1, 1),
    (7,),
    (3, 5, 1, 8),
    (1, 100, 1),
    (64, 64, 1, 3, 17),
    (5,) * 11,
]


@pytest.mark.parametrize("numels", SIZES)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5, 8])
def test_every_element_owned_once(numels, world_size):
    layout = FlatLayout(numels, world_size)
    assert layout.numel == sum(numels)
    assert layout.padded_numel % world_size == 0
    assert 0 <= layout.padding <= world_size - 1
    owner = {}
    for rank in range(world_size):
        lo, hi = layout.shard_range(rank)
        assert hi - lo == layout.shard_numel
        for piece in layout.spans(rank):
            start, _ = layout.param_range(piece.index)
            assert piece.numel > 0
            for k in range(piece.numel):
                element = (piece.index, piece.param_start + k)
                assert element not in owner
                owner[element] = rank
                # The piece's position in the shard matches the buffer position.
                assert lo + piece.shard_start + k == start + piece.param_start + k
    assert len(owner) == sum(numels)
    for index in range(len(numels)):
        # A parameter's owners are consecutive: from the shard of its first element to
        # the shard of its last.
        start, end = layout.param_range(index)
        first, last = start // layout.shard_numel, (end - 1) // layout.shard_numel
        owners = sorted({owner[(index, e)] for e in range(numels[index])})
        assert owners == list(range(first, last + 1))


def test_offsets_are_contiguous():
    layout = FlatLayout((3, 5, 1), 2)
    assert layout.offsets == (0, 3, 8)
    assert layout.param_range(1) == (3, 8)
    assert (layout.shard_numel, layout.padded_numel, layout.padding) == (5, 10, 1)
    assert layout.shard_range(1) == (5, 10)


def test_one_element_param_has_one_owner():
    layout = FlatLayout((1,), 3)
    assert [len(layout.spans(r)) for r in range(3)] == [1, 0, 0]
    assert layout.padding == 2


@pytest.mark.parametrize("bad", [dict(numels=(0,), world_size=2), dict(numels=(3,), world_size=0)])
def test_invalid_layouts_raise(bad):
    with pytest.raises(ValueError):
        FlatLayout(**bad)
    with pytest.raises(ValueError):
        FlatLayout((3,), 2).shard_range(2)


@pytest.mark.parametrize(
    "sizes,capacity", list(itertools.product([[1, 2, 3, 4], [10, 1, 1, 10], [5]], [1, 3, 6, 100]))
)
def test_size_partition(sizes, capacity):
    runs = size_partition(sizes, capacity)
    assert [i for run in runs for i in run] == list(range(len(sizes)))
    for run in runs:
        assert run
        assert len(run) == 1 or sum(sizes[i] for i in run) <= capacity
    with pytest.raises(ValueError):
        size_partition(sizes, 0)
