"""The token lists kept between turns for the next plan's bridge, with shared ints.

Every int the tokenizer or the JSON parser makes is a separate 32-byte object; a kept
list whose ids are the shared objects of one table (skycap.tokens.renderer's) costs 8 bytes
a token instead.
"""

from __future__ import annotations

import numpy as np

from skycap.graph import Graph
from skycap.tokens.engine import EngineOutput
from skycap.tokens.plan import Plan, TurnLists
from skycap.tokens.renderer import interned, shared_ids


def turn_lists(
    graph: Graph, node_id: int, plan: Plan, output: EngineOutput, last: TurnLists | None
) -> TurnLists:
    """The committed turn's token lists for the next plan's bridge, with shared ints.

    A plan from a render cache hit has shared ids already: its list is kept as it is. A
    plan that bridged from `last`'s node got its first `reused` ids from `last`'s lists, so
    they are shared already. The ids after them are the plan's new chunks and scaffold, the
    int32 arrays the new nodes hold, read from those arrays: their range is checked at C
    speed, where a list of ints must be checked one object at a time.
    """
    completion = interned(output.completion_ids, 0)
    if plan.shared:
        return TurnLists(graph, node_id, plan.prompt_ids, completion)
    extended = (
        last is not None and last.graph is graph and plan.bridged and plan.parent == last.node
    )
    kept = plan.prompt_ids[: plan.reused]
    if not extended:
        kept = interned(kept, 0)
    added = np.concatenate([*(new.ids for new in plan.new), plan.scaffold])
    return TurnLists(graph, node_id, kept + shared_ids(added), completion)
