"""GRPO-style groups and the two tables built on them: filters, sorting, health counts, pages.

Groups follow docs/viewer.md "Groups" (keys, repetitions, attempts, superseded rollouts,
modal size, group flags); the tables follow docs/viewer.md "The page" (server-side sort with nulls
last, 100 rows a page, a
health band counted before the flag filter, reward colours over the whole run).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from skycap.viewer.derive import FLAG_LEVELS, GROUP_FLAGS, QUIET_FLAGS, as_number
from skycap.viewer.index import Summary, group_value, lookup

SORTS = (
    "step",
    "task",
    "reward",
    "turns",
    "tokens",
    "health",
    "created",
    "paths",
    "trainable",
    "status",
    "stop_reason",
)
#: `sort=meta.<key>` sorts by that meta key (numbers before text, nulls last).
META_SORT = "meta."
#: Meta keys offered as rollouts-table columns, at most this many (the most common first).
META_KEYS_LISTED = 40
ORDERS = ("asc", "desc")
PAGE_SIZE = 100
DEFAULT_GROUP_BY = ("step", "instance_id")
MASKING_STOPS = ("agent_timeout", "error")
FILTERS = ("step", "task", "status", "ann", "q", "flag")


class QueryError(ValueError):
    """A listing query the server answers with HTTP 400; the message says what to send."""


@dataclass(frozen=True, slots=True)
class Query:
    """A table request: view-independent filters, sort and page (all from the URL)."""

    sort: str | None = None
    order: str = "desc"
    page: int = 1
    step: str | None = None
    task: str | None = None
    status: str | None = None
    ann: str | None = None
    q: str | None = None
    flag: str | None = None
    group_by: tuple[str, ...] = DEFAULT_GROUP_BY


def parse_group_by(text: str) -> tuple[str, ...]:
    keys = tuple(part.strip() for part in text.split(",") if part.strip())
    if not keys:
        raise QueryError(f"group_by {text!r} names no key; send e.g. group_by=step,instance_id")
    return keys


def parse_query(params: Mapping[str, str], group_by: tuple[str, ...] = DEFAULT_GROUP_BY) -> Query:
    """A Query from URL parameters (first value each); bad values raise QueryError."""
    sort = params.get("sort") or None
    if sort is not None and sort not in SORTS and not _meta_sort(sort):
        raise QueryError(f"unknown sort {sort!r}; sort by one of {', '.join(SORTS)} or meta.<key>")
    textual = sort in ("task", "status", "stop_reason") or _meta_sort(sort)
    order = params.get("order") or ("asc" if textual else "desc")
    if order not in ORDERS:
        raise QueryError(f"unknown order {order!r}; send asc or desc")
    try:
        page = int(params.get("page") or 1)
    except ValueError:
        raise QueryError(f"page {params['page']!r} is not a number; pages start at 1") from None
    if page < 1:
        raise QueryError(f"page {page} is out of range; pages start at 1")
    flag = params.get("flag") or None
    if flag is not None and flag not in FLAG_LEVELS:
        raise QueryError(f"unknown flag {flag!r}; flags are {', '.join(FLAG_LEVELS)}")
    ann = params.get("ann") or None
    if ann is not None and "=" not in ann:
        raise QueryError(f"annotation filter {ann!r} needs the form key=value")
    step = params.get("step") or None
    if step is not None and any(as_number(p) is None for p in step.split(",")):
        raise QueryError(f"step filter {step!r} is not a number (or comma-separated numbers)")
    return Query(
        sort=sort,
        order=order,
        page=page,
        step=step,
        task=params.get("task") or None,
        status=params.get("status") or None,
        ann=ann,
        q=(params.get("q") or "").strip().lower() or None,
        flag=flag,
        group_by=parse_group_by(params["group_by"]) if params.get("group_by") else group_by,
    )


def matches(summary: Summary, query: Query) -> bool:
    """Every filter but the flag filter (the health band counts before that one applies)."""
    if query.step is not None:
        steps = {as_number(p) for p in query.step.split(",")}
        if summary.step not in steps:
            return False
    if query.task is not None and not matches_task(summary, query.task):
        return False
    if query.status is not None and summary.status != query.status:
        return False
    if query.ann is not None:
        key, _, value = query.ann.partition("=")
        if key not in summary.annotations or group_value(summary.annotations[key]) != value:
            return False
    return query.q is None or query.q in summary.search


def _meta_sort(sort: str | None) -> bool:
    return sort is not None and sort.startswith(META_SORT) and len(sort) > len(META_SORT)


def matches_task(summary: Summary, wanted: str) -> bool:
    """The task filter: the shown task, or the raw `task`, `task_id` or `instance_id` in meta
    (so `tasks/alpha` finds a task shown as `alpha`)."""
    wanted = wanted.lower()
    names = [summary.task, *(summary.meta.get(k) for k in ("task", "task_id", "instance_id"))]
    return any(wanted in str(name).lower() for name in names if name is not None)


def reward_mean(rewards: Iterable[float | None]) -> float | None:
    values = [r for r in rewards if r is not None]
    return sum(values) / len(values) if values else None


def _repetition_order(value: str) -> tuple[int, float, str]:
    number = as_number(value)
    return (0, number, "") if number is not None else (1, 0.0, value)


@dataclass(slots=True)
class Group:
    """One prompt of one step: counting rollouts by repetition, each with its superseded ones."""

    key: str
    counting: list[Summary] = field(default_factory=list)
    superseded: dict[str, list[Summary]] = field(default_factory=dict)
    flags: list[str] = field(default_factory=list)

    @property
    def members(self) -> list[Summary]:
        return self.counting + [s for group in self.superseded.values() for s in group]

    @property
    def step(self) -> float | None:
        return self.counting[0].step

    @property
    def task(self) -> str | None:
        return self.counting[0].task

    @property
    def rewards(self) -> list[float | None]:
        return [s.reward for s in self.counting]

    def rollout_flags(self) -> Counter[str]:
        return Counter(f for s in self.counting for f in s.flags if f not in QUIET_FLAGS)

    def all_flags(self) -> set[str]:
        return set(self.flags) | set(self.rollout_flags())

    def sort_value(self, sort: str) -> Any:
        if sort == "reward":
            return reward_mean(self.rewards)
        if sort == "health":
            return len(self.flags) + sum(self.rollout_flags().values())
        if sort == "created":
            return _max(s.created_at for s in self.members)
        if sort in ("turns", "tokens", "paths", "trainable"):
            return _max(rollout_value(s, sort) for s in self.counting)
        return rollout_value(self.counting[0], sort)


def _max(values: Iterable[Any]) -> Any:
    present = [v for v in values if v is not None]
    return max(present) if present else None


def rollout_value(summary: Summary, sort: str) -> Any:
    if _meta_sort(sort):
        return _sortable(summary.meta.get(sort[len(META_SORT) :]))
    if sort == "stop_reason":
        return _sortable(summary.stop_reason)
    if sort == "created":
        return summary.created_at
    if sort == "health":
        return summary.health
    return getattr(summary, sort)


@dataclass(slots=True)
class GroupSet:
    """A run's groups under one key: by key, by member id, the modal size and the ungrouped."""

    groups: dict[str, Group]
    of: dict[str, Group]
    modal: int
    ungrouped: list[Summary]

    @property
    def groupable(self) -> bool:
        total = len(self.of) + len(self.ungrouped)
        return total > 0 and 2 * len(self.of) >= total

    def group_flags(self, summary: Summary) -> list[str]:
        """The flags of the group a rollout counts in (a superseded one carries none)."""
        group = self.of.get(summary.id)
        return group.flags if group is not None and summary in group.counting else []


def _counting(rollouts: list[Summary]) -> Summary:
    """The highest attempt counts; ties go to the newer `created_at` (docs/viewer.md "Groups")."""
    return max(rollouts, key=lambda s: (s.attempt, s.created_at or -math.inf, s.id))


def build_groups(summaries: Iterable[Summary], keys: tuple[str, ...]) -> GroupSet:
    by_key: dict[str, dict[str, list[Summary]]] = {}
    ungrouped = []
    for summary in summaries:
        key = summary.group_key(keys)
        if key is None:
            ungrouped.append(summary)
        else:
            by_key.setdefault(key, {}).setdefault(summary.repetition, []).append(summary)
    groups: dict[str, Group] = {}
    of: dict[str, Group] = {}
    for key, repetitions in by_key.items():
        group = Group(key=key)
        for repetition in sorted(repetitions, key=_repetition_order):
            attempts = repetitions[repetition]
            counting = _counting(attempts)
            group.counting.append(counting)
            others = sorted(
                (s for s in attempts if s is not counting),
                key=lambda s: (-s.attempt, -(s.created_at or 0.0)),
            )
            if others:
                group.superseded[counting.id] = others
        groups[key] = group
        of.update((s.id, group) for s in group.members)
    sizes = Counter(len(group.counting) for group in groups.values())
    modal = max(sizes, key=lambda size: (sizes[size], size)) if sizes else 0
    for group in groups.values():
        group.flags = _group_flags(group, modal)
    return GroupSet(groups=groups, of=of, modal=modal, ungrouped=ungrouped)


def _group_flags(group: Group, modal: int) -> list[str]:
    rewards = group.rewards
    holds = {
        "no-signal": all(r is not None for r in rewards) and len(set(rewards)) == 1,
        "masked": any(s.stop_reason in MASKING_STOPS for s in group.counting),
        "short": len(group.counting) < modal,
        "retried": bool(group.superseded),
    }
    return [flag for flag in GROUP_FLAGS if holds[flag]]


def _sortable(value: Any) -> tuple[int, Any] | None:
    """A meta or annotation value made comparable: numbers first, then text; else None."""
    number = as_number(value) if not isinstance(value, str) else None
    if number is not None:
        return (0, number)
    text = group_value(value)
    return None if text is None else (1, text)


def sort_items(items: list[Any], value: Callable[[Any], Any], order: str) -> list[Any]:
    """Stable sort by `value`, nulls last in either order (ties keep the incoming order)."""
    present = [item for item in items if value(item) is not None]
    missing = [item for item in items if value(item) is None]
    return sorted(present, key=value, reverse=order == "desc") + missing


def _page(items: list[Any], page: int) -> tuple[list[Any], int]:
    pages = max(1, math.ceil(len(items) / PAGE_SIZE))
    start = (min(page, pages) - 1) * PAGE_SIZE
    return items[start : start + PAGE_SIZE], pages


def reward_range(summaries: Iterable[Summary]) -> dict[str, float] | None:
    rewards = [s.reward for s in summaries if s.reward is not None]
    return {"min": min(rewards), "max": max(rewards)} if rewards else None


def health_band(flag_sets: Iterable[Iterable[str]]) -> list[dict[str, Any]]:
    """Each flag with its count and level, in display order (zero counts left out)."""
    counts = Counter(flag for flags in flag_sets for flag in set(flags))
    return [
        {"flag": flag, "level": level, "count": counts[flag]}
        for flag, level in FLAG_LEVELS.items()
        if counts[flag]
    ]


def meta_keys(summaries: Iterable[Summary]) -> list[str]:
    """The meta keys with a scalar value somewhere in the run, most common first."""
    counts = Counter(
        key for s in summaries for key, value in s.meta.items() if group_value(value) is not None
    )
    return [key for key, _ in counts.most_common(META_KEYS_LISTED)]


def rollout_row(summary: Summary, groups: GroupSet) -> dict[str, Any]:
    row = summary.row()
    group = groups.of.get(summary.id)
    row["group"] = group.key if group is not None else None
    row["group_flags"] = groups.group_flags(summary)
    return row


def rollouts_table(summaries: list[Summary], groups: GroupSet, query: Query) -> dict[str, Any]:
    """The rollouts view: newest first by default, flags include the rollout's group flags."""

    def flags(s: Summary) -> list[str]:
        return s.flags + groups.group_flags(s)

    base = [s for s in summaries if matches(s, query)]
    band = health_band(flags(s) for s in base)
    # docs/viewer.md "The page" as built: reward colours span the run, so a filter does not
    # recolour.
    listed = [s for s in base if query.flag is None or query.flag in flags(s)]
    listed = sort_items(sorted(listed, key=lambda s: s.id), lambda s: s.created_at, "desc")
    if query.sort is not None:
        listed = sort_items(listed, lambda s: rollout_value(s, query.sort), query.order)
    page, pages = _page(listed, query.page)
    return {
        "view": "rollouts",
        "total": len(listed),
        "page": min(query.page, pages),
        "pages": pages,
        "health": band,
        "reward_range": reward_range(summaries),
        "groupable": groups.groupable,
        "meta_keys": meta_keys(summaries),
        "rows": [rollout_row(s, groups) for s in page],
    }


def _range(values: Iterable[Any]) -> list[Any] | None:
    present = [v for v in values if v is not None]
    return [min(present), max(present)] if present else None


def group_row(group: Group, groups: GroupSet, query: Query) -> dict[str, Any]:
    """One group with its rollouts, each counting one followed by what it supersedes."""
    rewards = group.rewards
    binary = bool(rewards) and all(r in (0.0, 1.0) for r in rewards)
    inner_sort = query.sort if query.sort not in (None, "step", "task") else "reward"
    inner_order = query.order if query.sort == inner_sort else "desc"
    rows = []
    for summary in sort_items(group.counting, lambda s: rollout_value(s, inner_sort), inner_order):
        rows.append({**rollout_row(summary, groups), "superseded_by": None})
        rows += [
            {**rollout_row(other, groups), "superseded_by": summary.id}
            for other in group.superseded.get(summary.id, [])
        ]
    return {
        "key": group.key,
        "step": group.step,
        "task": group.task,
        "label": group_label(group, query.group_by),
        "size": len(group.counting),
        "modal": groups.modal,
        "rewards": rewards,
        "dots": [
            {
                "id": s.id,
                "reward": s.reward,
                "repetition": s.repetition,
                "stop_reason": s.stop_reason,
            }
            for s in group.counting
        ],
        "mean_reward": reward_mean(rewards),
        "binary": binary,
        "pass": sum(1 for r in rewards if r == 1.0) if binary else None,
        "turns": _range(s.turns for s in group.counting),
        "tokens": _range(s.tokens for s in group.counting),
        "flags": group.flags,
        "rollup": dict(sorted(group.rollout_flags().items(), key=lambda kv: _flag_order(kv[0]))),
        "attempts": len(group.members),
        "rollouts": rows,
    }


def group_label(group: Group, keys: tuple[str, ...]) -> str:
    """What tells this group apart besides its step and task: the other group-key values
    (the instance id, by default), so groups of one task do not all read the same."""
    first = group.counting[0]
    parts = [group_value(lookup(first.meta, first.annotations, key)) for key in keys]
    shown = [p for key, p in zip(keys, parts, strict=True) if key != "step" and p is not None]
    return " · ".join(p for p in shown if p != group.task)


def _flag_order(flag: str) -> int:
    return list(FLAG_LEVELS).index(flag)


def _default_group_order(group: Group) -> tuple[Any, ...]:
    """Step descending (missing last), then task, then key."""
    step = group.step
    return (step is None, -(step or 0.0), group.task or "", group.key)


def groups_table(summaries: list[Summary], groups: GroupSet, query: Query) -> dict[str, Any]:
    """The groups view: a group matches when any of its rollouts does
    (docs/viewer.md "The page")."""
    selected = {s.id for s in summaries if matches(s, query)}
    base = [g for g in groups.groups.values() if any(s.id in selected for s in g.members)]
    ungrouped = [s for s in groups.ungrouped if s.id in selected]
    # Rollouts without a group key are not rows here, but their flags count in the band:
    # a failure among them must show where the user looks (docs/viewer.md "Health band").
    ungrouped_flags = [[f for f in s.flags if f not in QUIET_FLAGS] for s in ungrouped]
    band = health_band([*(g.all_flags() for g in base), *ungrouped_flags])
    listed = [g for g in base if query.flag is None or query.flag in g.all_flags()]
    listed.sort(key=_default_group_order)
    if query.sort is not None:
        listed = sort_items(listed, lambda g: g.sort_value(query.sort), query.order)
    page, pages = _page(listed, query.page)
    return {
        "view": "groups",
        "total": len(listed),
        "page": min(query.page, pages),
        "pages": pages,
        "health": band,
        "reward_range": reward_range(s for g in groups.groups.values() for s in g.counting),
        "groupable": groups.groupable,
        "group_by": list(query.group_by),
        "modal": groups.modal,
        "ungrouped": len(ungrouped),
        "ungrouped_health": health_band(ungrouped_flags),
        "groups": [group_row(g, groups, query) for g in page],
    }
