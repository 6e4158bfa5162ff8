"""`skycap summary`: per record directory, the figures of docs/tools.md "skycap summary" as rich
tables or JSON."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

HELP = "Summarise record directories: statuses, paths, forks, bridging, failures and rewards."

BRIDGED_STATES = ("true", "false", "null", "absent")
REWARD_VALUES_LISTED = 12
REWARD_BUCKETS = 10


def configure(parser: argparse.ArgumentParser) -> None:
    from skycap.cli.sources import add_storage_options

    parser.add_argument(
        "dirs",
        metavar="DIR",
        nargs="+",
        help="record directories, folders of them (one per run, two levels down), or mirror "
        "URLs (s3://...)",
    )
    parser.add_argument(
        "--json", action="store_true", help="print the figures as JSON (default: tables)"
    )
    add_storage_options(parser)
    parser.set_defaults(summary_parser=parser)


# -- per document ----------------------------------------------------------------------------


def _bridged_state(call: Mapping[str, Any]) -> str | None:
    if "bridged" not in call:
        return "absent"
    return {True: "true", False: "false", None: "null"}.get(call["bridged"])


def _is_ended(document: Mapping[str, Any]) -> bool:
    """format.md §3: a document without `ended` is ended iff its status is not `open`."""
    ended = document.get("ended")
    return ended if isinstance(ended, bool) else document.get("status") != "open"


def _render_signs(nodes: Sequence[Mapping[str, Any]]) -> tuple[list[int], list[int]]:
    """Re-tokenized copies and model nodes inferred unbridged
    (docs/viewer.md "The rollout drawer")."""

    def is_model(i: Any) -> bool:
        return isinstance(i, int) and 0 <= i < len(nodes) and nodes[i].get("author") == "model"

    copies = {
        i
        for i, n in enumerate(nodes)
        if n.get("author") == "client" and is_model(n.get("shadowed_by"))
    }
    inferred = []
    for i, node in enumerate(nodes):
        if node.get("author") != "model":
            continue
        at = node.get("parent")
        while at is not None and nodes[at].get("author") == "client":
            if at in copies:
                inferred.append(i)
                break
            at = nodes[at].get("parent")
    return sorted(copies), inferred


def _token_count(document: Mapping[str, Any]) -> int:
    try:
        return int(document["sidecars"]["tokens"]["arrays"]["token_ids"]["shape"][0])
    except (KeyError, TypeError, IndexError, ValueError):
        return 0


def _reward(document: Mapping[str, Any]) -> float | None:
    annotations = document.get("annotations")
    reward = annotations.get("reward") if isinstance(annotations, Mapping) else None
    if isinstance(reward, bool) or not isinstance(reward, (int, float)):
        return None
    return reward if math.isfinite(reward) else None


def document_stats(document: Mapping[str, Any]) -> dict[str, Any]:
    """One trajectory's figures, from the document alone; MalformedDocument when nodes are bad."""
    from skycap.linearity import checked_nodes

    nodes = checked_nodes(document)
    calls = [c for n in nodes for c in n.get("calls", []) if isinstance(c, Mapping)]
    parents = Counter(n.get("parent") for n in nodes if n.get("parent") is not None)
    retokenized, inferred = _render_signs(nodes)
    bridged = Counter(s for s in map(_bridged_state, calls) if s is not None)
    capture = document.get("capture")
    mode = capture.get("mode") if isinstance(capture, Mapping) else None
    sidecars = document.get("sidecars")
    retries = document.get("retries") if isinstance(document.get("retries"), Mapping) else {}
    failures = document.get("failures")
    return {
        "id": str(document.get("id")),
        "status": str(document.get("status")),
        "ended": _is_ended(document),
        "mode": mode if isinstance(mode, str) else "unknown",
        "nodes": len(nodes),
        "calls": len(calls),
        "tokens": _token_count(document),
        "paths": sum(1 for i in range(len(nodes)) if i not in parents),
        "branch_points": sum(1 for count in parents.values() if count > 1),
        "bridged": {state: bridged[state] for state in BRIDGED_STATES},
        "shadowed": sum(1 for n in nodes if n.get("shadowed_by") is not None),
        "retokenized": len(retokenized),
        "inferred_unbridged": len(inferred),
        "failures": len(failures) if isinstance(failures, list) else 0,
        "retries": {k: _int(retries.get(k)) for k in ("replayed", "coalesced")},
        "sidecars": list(sidecars) if isinstance(sidecars, Mapping) else [],
        "reward": _reward(document),
    }


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


# -- per directory ---------------------------------------------------------------------------


def directory_stats(rows: Sequence[Mapping[str, Any]], unreadable: int) -> dict[str, Any]:
    """The `stats` object of `summary --json` (docs/tools.md "skycap summary") over per-document
    figures."""
    from skycap.record.sidecars import kind_order

    status: Counter[str] = Counter()
    modes: Counter[str] = Counter()
    sidecars: Counter[str] = Counter()
    histogram: Counter[int] = Counter()
    bridged = dict.fromkeys(BRIDGED_STATES, 0)
    paths_max: dict[str, Any] | None = None
    for row in rows:
        status[row["status"]] += 1
        modes[row["mode"]] += 1
        sidecars.update(row["sidecars"])
        histogram[row["paths"]] += 1
        for state, n in row["bridged"].items():
            bridged[state] += n
        if paths_max is None or row["paths"] > paths_max["paths"]:
            paths_max = {"paths": row["paths"], "id": row["id"]}
    rewards = [row["reward"] for row in rows if row["reward"] is not None]
    return {
        "trajectories": len(rows),
        "unreadable": unreadable,
        "status": dict(status),
        "not_ended": sum(1 for row in rows if not row["ended"]),
        "modes": dict(modes),
        "empty": sum(1 for row in rows if row["nodes"] == 0),
        "nodes": sum(row["nodes"] for row in rows),
        "calls": sum(row["calls"] for row in rows),
        "tokens": sum(row["tokens"] for row in rows),
        "paths": {
            "total": sum(row["paths"] for row in rows),
            "histogram": {str(k): histogram[k] for k in sorted(histogram)},
            "max": paths_max,
        },
        "forked": sum(1 for row in rows if row["paths"] > 1),
        "branch_points": sum(row["branch_points"] for row in rows),
        "bridged": bridged,
        "with_unbridged": sum(1 for row in rows if row["bridged"]["false"]),
        "with_bridged_absent": sum(1 for row in rows if row["bridged"]["absent"]),
        "shadowed_nodes": sum(row["shadowed"] for row in rows),
        "retokenized_copies": sum(row["retokenized"] for row in rows),
        "with_retokenized": sum(1 for row in rows if row["retokenized"]),
        "inferred_unbridged": sum(row["inferred_unbridged"] for row in rows),
        "with_inferred_unbridged": sum(1 for row in rows if row["inferred_unbridged"]),
        "failures": sum(row["failures"] for row in rows),
        "with_failures": sum(1 for row in rows if row["failures"]),
        "retries": {k: sum(row["retries"][k] for row in rows) for k in ("replayed", "coalesced")},
        "sidecars": {k: sidecars[k] for k in sorted(sidecars, key=kind_order)},
        "reward": reward_stats(rewards, len(rows)) if rewards else None,
    }


def number_text(value: float) -> str:
    """A number as JavaScript's String() writes it for ordinary values: `1`, `0.5`, `-2`."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e21:
        return str(int(value))
    return str(value)


def reward_stats(values: Sequence[float], of: int) -> dict[str, Any]:
    """count, missing, mean, min, p50 (index min(n-1, n//2)), max, then values or 10 buckets."""
    ordered = sorted(values)
    n = len(ordered)
    out: dict[str, Any] = {
        "count": n,
        "missing": of - n,
        "mean": math.fsum(ordered) / n,
        "min": ordered[0],
        "p50": ordered[min(n - 1, n // 2)],
        "max": ordered[-1],
    }
    distinct = Counter(ordered)
    if len(distinct) <= REWARD_VALUES_LISTED:
        out["values"] = {number_text(v): c for v, c in sorted(distinct.items())}
        return out
    lo = ordered[0]
    width = (ordered[-1] - lo) / REWARD_BUCKETS or 1
    buckets = [0] * REWARD_BUCKETS
    for v in ordered:
        buckets[min(REWARD_BUCKETS - 1, math.floor((v - lo) / width))] += 1
    out["histogram"] = [
        {"from": lo + i * width, "to": lo + (i + 1) * width, "n": count}
        for i, count in enumerate(buckets)
    ]
    return out


def summarise_directory(record_dir: Path) -> tuple[dict[str, Any], list[dict[str, str]]]:
    """(stats, errors) for one directory; unreadable documents become errors, never exceptions."""
    from skycap.cli.folders import Progress
    from skycap.linearity import MalformedDocument
    from skycap.record.reader import RecordError, document_path, read_document, record_ids

    rows, errors = [], []
    ids = record_ids(record_dir)
    with Progress(f"skycap summary {record_dir}", len(ids)) as progress:
        for trajectory_id in ids:
            progress.step()
            try:
                document = read_document(document_path(record_dir, trajectory_id))
                rows.append(document_stats(document))
            except (RecordError, MalformedDocument) as exc:
                errors.append({"id": trajectory_id, "error": str(exc)})
            except (OSError, ValueError, TypeError) as exc:
                errors.append({"id": trajectory_id, "error": f"{type(exc).__name__}: {exc}"})
    return directory_stats(rows, len(errors)), errors


# -- output ----------------------------------------------------------------------------------


def _percent(n: int, of: int) -> str:
    return f" ({100 * n / of:.1f}%)" if of else ""


def _counts(counts: Mapping[str, int]) -> str:
    return " ".join(f"{k}={v}" for k, v in counts.items())


def figure_rows(
    stats: Mapping[str, Any], errors: Sequence[Mapping[str, str]]
) -> list[tuple[str, str]]:
    """(figure, value) rows in the order of docs/tools.md "skycap summary"; optional lines only when
    they apply."""
    s = stats
    n = s["trajectories"]
    paths = s["paths"]
    histogram = " ".join(f"{k}:{v}" for k, v in paths["histogram"].items())
    largest = f", max {paths['max']['paths']} in {paths['max']['id']}" if paths["max"] else ""
    b = s["bridged"]
    rows = [
        (
            "trajectories",
            f"{n}" + (f"  (+{s['unreadable']} unreadable)" if s["unreadable"] else ""),
        ),
        (
            "status",
            _counts(s["status"]) + (f"  (not ended: {s['not_ended']})" if s["not_ended"] else ""),
        ),
        ("capture mode", _counts(s["modes"])),
        ("sidecars", _counts(s["sidecars"]) or "none"),
        ("nodes / calls / tokens", f"{s['nodes']} / {s['calls']} / {s['tokens']}"),
        ("empty (0 nodes)", f"{s['empty']}{_percent(s['empty'], n)}"),
        ("paths per trajectory", f"{histogram}  (total {paths['total']}{largest})"),
        (
            "forked (paths > 1)",
            f"{s['forked']}{_percent(s['forked'], n)}, {s['branch_points']} branch points",
        ),
        (
            "calls by bridged",
            f"true={b['true']} false={b['false']} null={b['null']} absent={b['absent']}",
        ),
        ("with unbridged calls", f"{s['with_unbridged']}{_percent(s['with_unbridged'], n)}"),
    ]
    if s["with_bridged_absent"]:
        rows.append(
            (
                "bridged field absent",
                f"{s['with_bridged_absent']} trajectories "
                "(written before the field existed: unknown)",
            )
        )
    rows += [
        ("shadowed nodes", str(s["shadowed_nodes"])),
        (
            "re-render signs",
            f"{s['retokenized_copies']} re-tokenized copies of a model node "
            f"(in {s['with_retokenized']}); {s['inferred_unbridged']} model calls inferred "
            f"unbridged (in {s['with_inferred_unbridged']})",
        ),
        ("failures", f"{s['failures']} in {s['with_failures']} trajectories"),
        ("retries", _counts(s["retries"])),
    ]
    rows += _reward_rows(s["reward"])
    rows += [("unreadable", f"{e['id']}: {e['error']}") for e in errors]
    return rows


def _reward_rows(reward: Mapping[str, Any] | None) -> list[tuple[str, str]]:
    if reward is None:
        return [("reward", "none in annotations")]
    missing = f" (missing {reward['missing']})" if reward["missing"] else ""
    head = (
        f"n={reward['count']}{missing} mean={reward['mean']:.4f} min={number_text(reward['min'])} "
        f"p50={number_text(reward['p50'])} max={number_text(reward['max'])}"
    )
    if "values" in reward:
        spread = "  ".join(f"{k}: {v}" for k, v in reward["values"].items())
    else:
        spread = " ".join(f"[{b['from']:.2f},{b['to']:.2f}):{b['n']}" for b in reward["histogram"])
    return [("reward", head), ("", spread)]


def _print_tables(results: Sequence[Mapping[str, Any]], elapsed_ms: Sequence[float]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False)
    for result, ms in zip(results, elapsed_ms, strict=True):
        table = Table(
            title=result["dir"],
            title_justify="left",
            caption=f"({ms:.0f} ms)",
            caption_justify="left",
            show_header=False,
        )
        table.add_column("figure", style="bold", no_wrap=True)
        table.add_column("value", overflow="fold")
        for figure, value in figure_rows(result["stats"], result["errors"]):
            table.add_row(figure, value)
        console.print(table)


def run(args: argparse.Namespace) -> int:
    from skycap.cli.folders import record_folders
    from skycap.cli.sources import SourceError, record_dir

    parser: argparse.ArgumentParser = args.summary_parser
    local = []
    for d in args.dirs:
        try:
            local.append(record_dir(d, args, sidecars=False))
        except SourceError as exc:
            parser.print_usage(sys.stderr)
            print(f"{parser.prog}: error: {exc}", file=sys.stderr)
            return 2
    folders = record_folders(list(zip(args.dirs, local, strict=True)))
    if isinstance(folders, str):
        parser.print_usage(sys.stderr)
        print(f"{parser.prog}: error: {folders}", file=sys.stderr)
        return 2
    labels = {path: d for d, path in zip(args.dirs, local, strict=True)}
    import skycap.record.reader  # noqa: F401  (imported before the clock starts)

    results, elapsed = [], []
    for folder in folders:
        label = labels.get(folder, str(folder))  # a mirror URL is named as given
        started = time.perf_counter()
        try:
            stats, errors = summarise_directory(folder)
        except OSError as exc:
            stats, errors = (
                directory_stats([], 0),
                [{"id": "-", "error": f"cannot list {label}: {exc}"}],
            )
        elapsed.append((time.perf_counter() - started) * 1000)
        results.append({"dir": label, "stats": stats, "errors": errors})
    if args.json:
        print(json.dumps(results, indent=1))
    else:
        _print_tables(results, elapsed)
    return 0
