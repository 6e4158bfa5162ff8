"""The house rules hold: modules import only from their own layer or below, with no cycles,
the client side never loads mitmproxy, and every file says what it is on its first line."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "skycap"

# docs/architecture.md: each module may import only from its own layer or below.
LAYERS = [
    (
        "skycap.hashing",
        "skycap.arrays",
        "skycap.wire",
        "skycap.weights",
        "skycap.dialects",
        "skycap.episodes",
        "skycap.logqueue",
    ),
    ("skycap.graph",),
    ("skycap.trajectory", "skycap.calls"),
    ("skycap.record", "skycap.text", "skycap.tokens"),
    ("skycap.samples", "skycap.linearity"),
    (
        "skycap.client",
        "skycap.loader",
        "skycap.server",
        "skycap.service",
        "skycap.mock",
        "skycap.dashboard",
        "skycap.viewer",
        "skycap.local_http",
        "skycap.certs",
        "skycap.control_token",
        "skycap.demo",
        "skycap.rollout",
        "skycap.compose",
        "skycap.index",
        "skycap.ray",
    ),
    ("skycap.integrations",),
    ("skycap.cli",),
]

# docs/architecture.md "Inside a package": where a large module was cut into pieces, each
# piece sits below what it was cut from, in ranks read bottom up; a module imports only
# modules of its own rank or below in its chain.
INNER_LAYERS = [
    [
        ("skycap.server.answer", "skycap.server.live", "skycap.server.records"),
        ("skycap.server.store",),
    ],
    [  # the server: the gate asks the call mode, which never asks the gate's caller
        (
            "skycap.server.flowstate",
            "skycap.server.loopback",
            "skycap.server.earlier",
            "skycap.server.routes",
            "skycap.server.messages",
        ),
        ("skycap.server.mode",),
        ("skycap.server.harness",),
        (
            "skycap.server.textmode",
            "skycap.server.tokenmode",
            "skycap.server.websocket",
            "skycap.server.frontdoor",
        ),
        ("skycap.server.addon",),
    ],
    [  # a dialect's writer is cut from its reply pieces; the dialect object sits on both
        (
            "skycap.dialects.chat_writer",
            "skycap.dialects.messages_reply",
            "skycap.dialects.responses_reply",
        ),
        ("skycap.dialects.messages_writer", "skycap.dialects.responses_writer"),
        ("skycap.dialects.chat", "skycap.dialects.messages", "skycap.dialects.responses"),
        ("skycap.dialects.responses_compact", "skycap.dialects.responses_socket"),
    ],
    [  # the record: the sidecar kinds sit between the layout and what reads and writes records
        ("skycap.record.layout", "skycap.record.frames"),
        ("skycap.record.sidecar_kind",),
        ("skycap.record.tokens_kind",),
        ("skycap.record.sidecars",),
        ("skycap.record.reader", "skycap.record.writer"),
        ("skycap.record.journal",),
    ],
    [
        ("skycap.mock.vllm_rules", "skycap.mock.engine_wire", "skycap.mock.weight_clock"),
        ("skycap.mock.engine_http",),
        ("skycap.mock.engine",),
    ],
    [
        ("skycap.mock.replies", "skycap.mock.h11_io"),
        ("skycap.mock.chat_wire",),
        ("skycap.mock.upstream",),
        ("skycap.mock.anthropic", "skycap.mock.responses"),
    ],
    [  # token mode: the renderer protocol knows no renderer; only the backend runs a turn
        (
            "skycap.tokens.tokenizer_env",
            "skycap.tokens.provenance",
            "skycap.tokens.renderer",
            "skycap.tokens.engine",
            "skycap.tokens.sampling",
            "skycap.tokens.deltas",
            "skycap.tokens.models",
            "skycap.tokens.outcome",
            "skycap.tokens.options",
            "skycap.tokens.render_cache",
        ),
        (
            "skycap.tokens.memo_tokenizer",
            "skycap.tokens.library",
            "skycap.tokens.library_renderer",
            "skycap.tokens.renderer_pool",
            "skycap.tokens.reproduce",
        ),
        (
            "skycap.tokens.client",
            "skycap.tokens.stops",
            "skycap.tokens.plan",
            "skycap.tokens.commit",
            "skycap.tokens.interned",
            "skycap.tokens.reply",
            "skycap.tokens.settings",
        ),
        ("skycap.tokens.streaming", "skycap.tokens.relay"),
        ("skycap.tokens.turn",),
        ("skycap.tokens.backend",),
    ],
    [  # the SkyRL generator: the facade re-exports the generator, its config and runtime
        ("skycap.integrations.skyrl_output", "skycap.integrations.skyrl_config"),
        ("skycap.integrations.skyrl_generator",),
        ("skycap.integrations.skyrl_runtime",),
        ("skycap.integrations.skyrl",),
    ],
    [
        ("skycap.dashboard.layout", "skycap.dashboard.poll"),
        ("skycap.dashboard.entries",),
        ("skycap.dashboard.columns", "skycap.dashboard.view"),
        ("skycap.dashboard.detail",),
        ("skycap.dashboard.frames",),
    ],
]


def layer_of(module: str) -> int:
    for level, prefixes in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return level
    if module == "skycap":
        return len(LAYERS)
    raise AssertionError(f"{module} is in no layer of tests/test_layers.py: add it")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def skycap_imports(path: Path) -> set[str]:
    imported = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            imported |= {a.name for a in node.names if a.name.startswith("skycap")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("skycap"):
            imported.add(node.module)
            # `from skycap.tokens import inference` imports that module too
            imported |= {f"{node.module}.{a.name}" for a in node.names} & MODULES.keys()
    return imported


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def test_every_module_imports_only_its_layer_or_below() -> None:
    wrong = []
    for name, path in MODULES.items():
        if name == "skycap":
            continue
        for target in skycap_imports(path):
            if layer_of(target) > layer_of(name):
                wrong.append(f"{name} (layer {layer_of(name)}) imports {target}")
    assert not wrong, "\n".join(wrong)


def test_the_pieces_of_a_cut_module_sit_below_it() -> None:
    wrong = []
    for chain in INNER_LAYERS:
        rank = {name: level for level, names in enumerate(chain) for name in names}
        missing = [name for name in rank if name not in MODULES]
        assert not missing, f"tests/test_layers.py INNER_LAYERS names no module: {missing}"
        for name, level in rank.items():
            for target in skycap_imports(MODULES[name]):
                if rank.get(target, -1) > level:
                    wrong.append(f"{name} (rank {level}) imports {target} (rank {rank[target]})")
    assert not wrong, "\n".join(wrong)


def test_no_import_cycles() -> None:
    graph = {name: {t for t in skycap_imports(p) if t in MODULES} for name, p in MODULES.items()}
    state: dict[str, int] = {}

    def visit(name: str, trail: list[str]) -> None:
        state[name] = 1
        for target in graph[name]:
            assert state.get(target) != 1, "import cycle: " + " -> ".join([*trail, target])
            if target not in state:
                visit(target, [*trail, target])
        state[name] = 2

    for name in graph:
        if name not in state:
            visit(name, [name])


def test_client_side_and_records_never_load_mitmproxy() -> None:
    code = (
        "import sys, skycap, skycap.client, skycap.loader, skycap.samples\n"
        "import skycap.dashboard.frames, skycap.rollout, skycap.compose, skycap.index\n"
        "import skycap.integrations.skyrl\n"
        "assert 'torch' not in sys.modules and 'skyrl' not in sys.modules\n"
        "from skycap import CapturePool, Sample, load\n"
        "assert 'mitmproxy' not in sys.modules, sorted(m for m in sys.modules if 'mitm' in m)"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


def test_graph_and_record_code_know_nothing_of_http() -> None:
    for name, path in MODULES.items():
        if layer_of(name) <= 2 or name.startswith("skycap.record"):
            source = path.read_text()
            for word in ("mitmproxy", "httpx", "http.server"):
                assert f"import {word}" not in source and f"from {word}" not in source, (
                    f"{name} imports {word}"
                )


def test_every_file_opens_with_a_sentence_saying_what_it_is() -> None:
    tracked = subprocess.run(
        ["git", "ls-files", "*.py", "*.js", "*.css", "*.html"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    missing = []
    for name in tracked:
        path = ROOT / name
        if not path.exists():
            continue
        text = path.read_text()
        if name.endswith(".py"):
            body = text.split("\n", 1)[1] if text.startswith("#!") else text
            ok = body.lstrip().startswith('"""') and len(body.split('"""')[1].strip()) > 10
        else:
            lines = [line for line in text.splitlines()[:3] if line.strip()]
            ok = any(line.lstrip().startswith(("//", "/*", "<!--")) for line in lines)
        if not ok:
            missing.append(name)
    assert not missing, f"files without an opening sentence: {missing}"
