"""The token lists kept between turns for the next plan's bridge, with shared ints.

Every int the tokenizer or the JSON parser makes is a separate 32-byte object; a kept
list whose ids are the shared objects of one table costs 8 bytes a token instead.
"""

from __future__ import annotations

import operator
import threading
from collections.abc import Sequence

from skycap.graph import Graph
from skycap.tokens.engine import EngineOutput
from skycap.tokens.plan import Plan, TurnLists

#: Token ids below this share one int object each in the lists kept between turns;
#: the table grows to the largest id seen, at most 2**18 entries (~10 MB), once per process.
SHARED_INT_LIMIT = 1 << 18
_SHARED_INTS: list[int] = []
_SHARED_INTS_GROWING = threading.Lock()


def turn_lists(
    graph: Graph, node_id: int, plan: Plan, output: EngineOutput, last: TurnLists | None
) -> TurnLists:
    """The committed turn's token lists for the next plan's bridge, with shared ints.

    A plan that bridged from `last`'s node got its first `reused` ids from `last`'s lists,
    so only the ids after them are new objects to replace.
    """
    extended = (
        last is not None and last.graph is graph and plan.bridged and plan.parent == last.node
    )
    return TurnLists(
        graph,
        node_id,
        interned(plan.prompt_ids, plan.reused if extended else 0),
        interned(output.completion_ids, 0),
    )


def interned(ids: Sequence[int], start: int) -> list[int]:
    """`ids` as a list whose ints from `start` on are the shared objects in `_SHARED_INTS`.

    A kept list then costs 8 bytes a token rather than ~40, as every int the tokenizer or
    the JSON parser makes is a separate 32-byte object. Only equal values are swapped in,
    so a `start` too high costs memory, never correctness.
    """
    ids = ids if isinstance(ids, list) else list(ids)
    tail = ids[start:]
    if not tail:
        return ids[:start]
    plain = set(map(type, tail)) == {int}  # the usual case, checked at C speed
    if plain:
        low, high = min(tail), max(tail)
    else:
        low, high = 0, max((t for t in tail if type(t) is int), default=-1)
    top = min(high, SHARED_INT_LIMIT - 1)
    if len(_SHARED_INTS) <= top:
        with _SHARED_INTS_GROWING:  # backends on other threads may grow it at the same time
            _SHARED_INTS.extend(range(len(_SHARED_INTS), top + 1))
    shared, size = _SHARED_INTS, len(_SHARED_INTS)
    if plain and low >= 0 and high < size and len(tail) > 1:
        # itemgetter looks every id up in one C loop: a list comprehension over 100k+ ids
        # was most of a cached first call's cost.
        return ids[:start] + list(operator.itemgetter(*tail)(shared))
    return ids[:start] + [shared[t] if type(t) is int and 0 <= t < size else t for t in tail]
