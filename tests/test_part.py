"""``--part I/N`` (tests/conftest.py): the slices scripts/gpu_checks.sh runs one machine call
each cover every selected test exactly once, in order."""

from __future__ import annotations

import pytest

from tests.conftest import _part, part_of, selection_id


@pytest.mark.parametrize("count", [0, 1, 2, 7, 89, 267])
@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_parts_cover_every_item_once_in_order(count: int, n: int) -> None:
    items = [f"t{k}" for k in range(count)]
    slices = [part_of(items, i, n)[0] for i in range(1, n + 1)]  # type: ignore[arg-type]
    assert [x for s in slices for x in s] == items
    sizes = [len(s) for s in slices]
    assert max(sizes) - min(sizes) <= 1
    for i, s in enumerate(slices, start=1):
        kept, dropped = part_of(items, i, n)  # type: ignore[arg-type]
        assert kept == s and sorted(kept + dropped) == sorted(items)


@pytest.mark.parametrize("spec", ["0/3", "4/3", "1", "a/b", "1/0", "-1/2"])
def test_bad_part_is_a_usage_error(spec: str) -> None:
    with pytest.raises(pytest.UsageError, match="--part"):
        _part(spec)


def test_good_part() -> None:
    assert _part("2/3") == (2, 3)


class _Item:
    def __init__(self, nodeid: str) -> None:
        self.nodeid = nodeid


def test_selection_id_tells_selections_apart() -> None:
    """Parts that collected different sets (a file missing on one machine) show different ids."""
    full = [_Item(f"tests/test_{k}.py::t") for k in range(9)]
    ident = selection_id(full)  # type: ignore[arg-type]
    assert ident == selection_id([_Item(i.nodeid) for i in full])  # type: ignore[arg-type]
    assert ident != selection_id(full[:-1])  # type: ignore[arg-type]
    assert ident != selection_id(full[1:] + full[:1])  # type: ignore[arg-type]
