"""The token-mode commit: a planned turn plus the engine's answer become nodes
(docs/architecture.md "Token mode").

Everything is validated before the first node is added, so a CommitError leaves
the graph exactly as it was; the caller then records `token attribution: <message>` and
seals the trajectory `failed` (docs/tokens.md "Outcomes the harness sees").
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from skycap.arrays import rows_to_csr
from skycap.graph import CLIENT, MODEL, Node, Tokens
from skycap.hashing import token_client_delta, token_match, token_model_delta
from skycap.tokens.engine import EngineOutput
from skycap.tokens.plan import Plan
from skycap.trajectory import Trajectory

_TOKEN_FIELDS = frozenset(f.name for f in dataclasses.fields(Tokens))


class CommitError(ValueError):
    """The engine's answer cannot be attributed exactly to the planned tokens."""


def commit_turn(
    trajectory: Trajectory,
    plan: Plan,
    output: EngineOutput,
    message: dict[str, Any],
    call: dict[str, Any],
    *,
    tools: list[Any] | None,
    model: str,
    experts_shape: tuple[int, ...] | None = None,
) -> Node | None:
    """Add the turn's client nodes and model node; return the model node, or None if sealed.

    `message` is the reply as stored on the model node; `call` is the call record without
    `tools` and `bridged`, which are filled in here. `experts_shape` is (layers, k) fixed by
    the trajectory's first call with routed experts, or None before it.
    """
    if not trajectory.is_open:
        return None
    total = len(plan.prompt_ids) + len(output.completion_ids)
    _check_turn(plan, output, total, experts_shape)
    experts = _experts_rows(plan, output, total)
    graph = trajectory.graph
    tools_key = trajectory.register_tools(tools)
    key = tools_key or ""
    _replace_placeholder(trajectory, plan, output)
    parent = plan.parent
    for new, rows in zip(plan.new, experts[:-1], strict=True):
        parent = graph.add(
            parent,
            author=CLIENT,
            message=new.message,
            match_hash=new.match_hash,
            delta_hash=token_client_delta(new.match_hash, new.ids),
            created_at=call["t_start"],
            tokens=Tokens(ids=new.ids, experts=rows),
        ).id
    tokens = _model_tokens(plan, output, experts[-1])
    match = token_match(message, key, model)
    node = graph.add(
        parent,
        author=MODEL,
        message=message,
        match_hash=match,
        delta_hash=token_model_delta(match, call["sampling"], len(plan.scaffold), tokens.ids),
        created_at=call["t_end"],
        tokens=tokens,
    )
    node.calls.append({**call, "tools": tools_key, "bridged": plan.bridged})
    return node


def _check_turn(
    plan: Plan, output: EngineOutput, total: int, experts_shape: tuple[int, ...] | None
) -> None:
    """Every check of docs/architecture.md "Token mode" (attribution, expert rows), before anything
    is added."""
    planned = plan.reused + sum(len(new.ids) for new in plan.new) + len(plan.scaffold)
    if planned != len(plan.prompt_ids):
        raise CommitError(
            f"the plan attributes {planned} tokens but the prompt has {len(plan.prompt_ids)}"
        )
    count = len(output.completion_ids)
    if count == 0:
        raise CommitError("the engine returned an empty completion; there is no sample to store")
    if len(output.logprobs) != count:
        raise CommitError(f"{count} completion tokens but {len(output.logprobs)} logprobs")
    if output.sampling_mask is not None and len(output.sampling_mask) != count:
        raise CommitError(
            f"sampling mask has {len(output.sampling_mask)} rows for {count} completion tokens"
        )
    for name, rows in (output.extra or {}).items():
        if rows.ndim < 1 or rows.shape[0] != count:
            raise CommitError(f"{name} has shape {rows.shape} for {count} completion tokens")
    experts = output.routed_experts
    if experts is None:
        return
    start, rows = output.routed_start, int(experts.shape[0]) if experts.ndim else 0
    if experts.ndim != 3 or start < 0 or start + rows not in (total - 1, total) or rows == 0:
        raise CommitError(f"routed experts cover {start}+{rows} of {total} positions")
    if experts_shape is not None and tuple(experts.shape[1:]) != tuple(experts_shape):
        raise CommitError(
            f"routed experts have (layers, k) = {tuple(experts.shape[1:])}, but earlier calls "
            f"of this trajectory had {tuple(experts_shape)}"
        )


def _experts_rows(plan: Plan, output: EngineOutput, total: int) -> list[np.ndarray | None]:
    """Each new node's rows (client nodes in order, then the model node), copied out of the reply.

    A node starting before the first returned position gets none; the final position,
    which the engine never forwards, gets a copy of the last row (a placeholder).
    """
    experts = output.routed_experts
    count = len(plan.new) + 1
    if experts is None:
        return [None] * count
    start, rows = output.routed_start, int(experts.shape[0])
    covered = start + rows
    spans, position = [], plan.reused
    for new in plan.new:
        spans.append((position, position + len(new.ids)))
        position += len(new.ids)
    spans.append((position, total))
    out: list[np.ndarray | None] = []
    for begin, end in spans:
        if begin < start:
            out.append(None)
            continue
        block = np.empty((end - begin, *experts.shape[1:]), dtype=experts.dtype)
        stop = min(end, covered)
        block[: max(stop - begin, 0)] = experts[begin - start : max(stop, begin) - start]
        if stop < end:
            block[stop - begin :] = experts[-1]
        out.append(block)
    return out


def _model_tokens(plan: Plan, output: EngineOutput, experts: np.ndarray | None) -> Tokens:
    scaffold = len(plan.scaffold)
    ids = np.concatenate([plan.scaffold, np.asarray(output.completion_ids, dtype=np.int32)])
    logprobs = np.zeros(ids.shape[0], dtype=np.float64)
    logprobs[scaffold:] = output.logprobs
    mask_ids = mask_offsets = None
    if output.sampling_mask is not None:
        mask_ids, mask_offsets = rows_to_csr(output.sampling_mask)
    covered = (
        output.routed_start + int(output.routed_experts.shape[0])
        if output.routed_experts is not None
        else 0
    )
    tokens = Tokens(
        ids=ids,
        sampled_start=scaffold,
        logprobs=logprobs,
        experts=experts,
        mask_ids=mask_ids,
        mask_offsets=mask_offsets,
        experts_placeholder=experts is not None
        and covered < len(plan.prompt_ids) + len(output.completion_ids),
    )
    _add_extra(tokens, scaffold, output)
    return tokens


def _add_extra(tokens: Tokens, scaffold: int, output: EngineOutput) -> None:
    """The model node's rows of each kind in `output.extra`: zeros over the scaffold, then
    the engine's, in the `Tokens` field of that name or else in `Tokens.extra`."""
    for name, rows in (output.extra or {}).items():
        block = np.zeros((scaffold + rows.shape[0], *rows.shape[1:]), dtype=rows.dtype)
        block[scaffold:] = rows
        if name in _TOKEN_FIELDS:
            setattr(tokens, name, block)
        else:
            tokens.extra = {**(tokens.extra or {}), name: block}


def _replace_placeholder(trajectory: Trajectory, plan: Plan, output: EngineOutput) -> None:
    """Give the tail's parent the real row of its final position, now that it was forwarded."""
    experts = output.routed_experts
    if experts is None or plan.parent is None:
        return
    tokens = trajectory.graph[plan.parent].tokens
    position = plan.reused - 1 - output.routed_start
    if (
        tokens is None
        or not tokens.experts_placeholder
        or tokens.experts is None
        or tokens.experts.shape[0] == 0
        or not 0 <= position < experts.shape[0]
        or tokens.experts.shape[1:] != experts.shape[1:]
    ):
        return
    tokens.experts[-1] = experts[position].astype(tokens.experts.dtype, copy=False)
    tokens.experts_placeholder = False
