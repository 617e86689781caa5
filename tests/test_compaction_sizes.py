"""The context's size as the fold changes `recent`: the running sum kept by
`compaction._ItemSizes` equals the sum of every exchange's `tokens_of`, for
any sequence of the fold's changes (appends, the oldest deleted) and of the
changes it never makes (a new list, the same list cleared and refilled)."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from actors.kernel import compaction

OPS = st.lists(st.one_of(
    st.tuples(st.just("append"), st.text(max_size=40)),
    st.tuples(st.just("drop"), st.integers(min_value=0, max_value=5)),
    st.tuples(st.just("copy"), st.just("")),
    st.tuples(st.just("refill"), st.text(max_size=10)),
), max_size=60)


@settings(max_examples=300, deadline=None)
@given(OPS)
def test_the_running_sum_equals_the_sum_of_every_exchange(ops: list[tuple[str, Any]]) -> None:
    sizes = compaction._ItemSizes()
    recent: list[dict[str, Any]] = []
    for op, arg in ops:
        if op == "append":
            recent.append({"turn": len(recent), "text": arg})
        elif op == "drop":
            del recent[:arg]
        elif op == "copy":  # a rebuild's list: other objects, equal values
            recent = [dict(item) for item in recent]
        else:  # never done by the fold: the same list, other exchanges
            recent.clear()
            recent.extend({"turn": i, "text": arg * i} for i in range(3))
        assert sizes.total(recent) == sum(compaction.tokens_of(i) for i in recent)


class _Walked(list):  # type: ignore[type-arg]
    """A list that counts how often it is walked from its start."""

    walks = 0

    def __iter__(self) -> Any:
        self.walks += 1
        return super().__iter__()


def test_a_turn_costs_the_exchanges_added_not_the_history() -> None:
    """Asked once a turn, the sum does not walk every exchange again (what
    made it O(history) a turn): only the first time, and after a change the
    fold never makes."""
    sizes = compaction._ItemSizes()
    recent = _Walked({"turn": i} for i in range(200))
    recent.walks = 0
    sizes.total(recent)
    assert recent.walks == 1
    for turn in range(200, 210):
        recent.append({"turn": turn})
        del recent[:1]
        assert sizes.total(recent) == sum(compaction.tokens_of(i) for i in list.__iter__(recent))
    assert recent.walks == 1
    recent.clear()
    recent.append({"turn": 0})
    sizes.total(recent)
    assert recent.walks == 2
