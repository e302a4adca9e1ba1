"""The shape of eventbus/: its import graph and its module sizes (issue 12, DESIGN.md "Layout").

Every `eventbus` module is parsed with `ast`; every import of ours counts, lazy ones inside
functions included. The graph must have

- no import cycle. A lazy import only hides a cycle, so lazy imports count; imports under
  `if TYPE_CHECKING:` never run and do not;
- no upward import against the layers below, `if TYPE_CHECKING:` included: a lower layer that
  needs a higher one's type depends on a protocol of its own (`eventbus.core.BusHandle`);
- no core module naming a concrete subscriber (sinks, monitors, integrations);
- no sink or monitor importing another package's private (`_name`) module.

Layers, lowest first; a module imports only from its own layer or those to its left:

    events  <-  core  <-  subscribers (sinks/, monitors/)  <-  top (the face, config/, cli/,
                      <-  facade (bus.py, replay.py, ...)  <-       integrations/)

`subscribers` and `facade` both sit on the core and know nothing of each other: sinks and
monitors reach the bus through the core's public API (`eventbus.core`), and the bus names no
concrete subscriber. LAYERS places every module by hand, so a new module is placed on purpose.
"""

from __future__ import annotations

import ast
import tomllib
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "eventbus"
MAX_LINES = 400

EVENTS, CORE, SUBSCRIBERS, FACADE, TOP = "events", "core", "subscribers", "facade", "top"

# What each layer may import (its own layer included).
MAY_IMPORT: dict[str, frozenset[str]] = {
    EVENTS: frozenset({EVENTS}),
    CORE: frozenset({EVENTS, CORE}),
    SUBSCRIBERS: frozenset({EVENTS, CORE, SUBSCRIBERS}),
    FACADE: frozenset({EVENTS, CORE, FACADE}),
    TOP: frozenset({EVENTS, CORE, SUBSCRIBERS, FACADE, TOP}),
}

LAYERS: dict[str, str] = {
    # the event types: import nothing of ours
    "eventbus.events": EVENTS,
    "eventbus._event_base": EVENTS,
    # the delivery engine and what it stands on
    "eventbus.core": CORE,
    "eventbus.core.delivery": CORE,
    "eventbus.core.checkpoint": CORE,
    "eventbus.core.busy": CORE,
    "eventbus.core.cost": CORE,
    "eventbus.core.ending": CORE,
    "eventbus.core.markers": CORE,
    "eventbus.core.fork": CORE,
    "eventbus.core.handle": CORE,
    "eventbus.core.inbox": CORE,
    "eventbus.core.strict": CORE,
    "eventbus.core.loop": CORE,
    "eventbus.core.shutdown": CORE,
    "eventbus.core.queue": CORE,
    "eventbus.core.router": CORE,
    "eventbus.core.signals": CORE,
    "eventbus.core.sizing": CORE,
    "eventbus.core.subscriber": CORE,
    "eventbus.core.subscription": CORE,
    "eventbus.core.worker": CORE,
    "eventbus.agreement": CORE,
    "eventbus.capture": CORE,
    "eventbus._capture_intake": CORE,
    "eventbus._compiling": CORE,
    "eventbus._torch_ops": CORE,
    "eventbus._capture_pending": CORE,
    "eventbus._capture_pools": CORE,
    "eventbus._capture_ring": CORE,
    "eventbus.codec": CORE,
    "eventbus._codec_classes": CORE,
    "eventbus._codec_values": CORE,
    "eventbus.control": CORE,
    "eventbus.dist": CORE,
    "eventbus.ranks": CORE,
    "eventbus.loader": CORE,
    "eventbus.log": CORE,
    "eventbus.logformat": CORE,
    "eventbus.runs": CORE,
    "eventbus.version": EVENTS,
    "eventbus.stats": CORE,
    "eventbus.steps": CORE,
    "eventbus.process": CORE,
    "eventbus.process.channel": CORE,
    "eventbus.process.child": FACADE,  # the sidecar's own bus
    "eventbus.process.closing": FACADE,  # the sidecar's ending, driven by the bus's close
    "eventbus.process.handle": FACADE,  # what a sidecar subscriber gets as its bus
    "eventbus.process.errors": CORE,
    "eventbus.process.logrelay": CORE,
    "eventbus.process.proxy": CORE,
    "eventbus.process.remote": CORE,
    "eventbus.process.reports": FACADE,  # the sidecar's reader side
    "eventbus.process.sidecar": FACADE,  # the bus's process: it drives the bus's parts
    "eventbus.process.spawn": CORE,
    "eventbus.process.wire": CORE,
    # the concrete subscribers: use the core's public API, never the bus
    "eventbus.sinks": SUBSCRIBERS,
    "eventbus.sinks._files": SUBSCRIBERS,
    "eventbus.sinks._jsonl_file": SUBSCRIBERS,
    "eventbus.sinks._jsonl_records": SUBSCRIBERS,
    "eventbus.sinks._prometheus": SUBSCRIBERS,
    "eventbus.monitors._memory_summary": SUBSCRIBERS,
    "eventbus.monitors._oom_snapshots": SUBSCRIBERS,
    "eventbus.sinks._runs": SUBSCRIBERS,
    "eventbus.sinks._scalars": SUBSCRIBERS,
    "eventbus.sinks._trackers": SUBSCRIBERS,
    "eventbus.sinks._tracking_uri": SUBSCRIBERS,
    "eventbus.sinks._text": SUBSCRIBERS,
    "eventbus.sinks._tb_summaries": SUBSCRIBERS,
    "eventbus.sinks.console": SUBSCRIBERS,
    "eventbus.sinks.jsonl": SUBSCRIBERS,
    "eventbus.sinks.mlflow": SUBSCRIBERS,
    "eventbus.sinks.prometheus": SUBSCRIBERS,
    "eventbus.sinks.tensorboard": SUBSCRIBERS,
    "eventbus.sinks.wandb": SUBSCRIBERS,
    "eventbus.monitors": SUBSCRIBERS,
    "eventbus.monitors._divergence_rule": SUBSCRIBERS,
    "eventbus.monitors._windows": SUBSCRIBERS,
    "eventbus.monitors._leak_rule": SUBSCRIBERS,
    "eventbus.monitors._rank_link": SUBSCRIBERS,
    "eventbus.monitors._rank_monitor": SUBSCRIBERS,
    "eventbus.monitors._straggler_rule": SUBSCRIBERS,
    "eventbus.monitors.reducer": SUBSCRIBERS,
    "eventbus.monitors.stragglers": SUBSCRIBERS,
    "eventbus.monitors._memory_read": SUBSCRIBERS,
    "eventbus.monitors._memory_leaks": SUBSCRIBERS,
    "eventbus.monitors._memory_samples": SUBSCRIBERS,
    "eventbus.monitors.divergence": SUBSCRIBERS,
    "eventbus.monitors.memory": SUBSCRIBERS,
    "eventbus.monitors.speed": SUBSCRIBERS,
    "eventbus.monitors._job_run": SUBSCRIBERS,
    "eventbus.monitors._metric": SUBSCRIBERS,
    "eventbus.monitors.checkpoint_jobs": SUBSCRIBERS,
    "eventbus.monitors.stoppers": SUBSCRIBERS,
    "eventbus.monitors.watchdog": SUBSCRIBERS,
    # eventbus ctl: the wire, sockets and client (core), the server a user subscribes
    "eventbus.ctl": SUBSCRIBERS,
    "eventbus.ctl.client": CORE,
    "eventbus.ctl.listen": CORE,
    "eventbus.ctl.protocol": CORE,
    "eventbus.ctl.serve": CORE,
    "eventbus.ctl.server": SUBSCRIBERS,
    "eventbus.ctl.view": CORE,
    # the public objects over the core: the bus, the default bus, replay, watch()
    "eventbus.bus": FACADE,
    "eventbus._globals": FACADE,
    "eventbus.replay": FACADE,
    "eventbus.load": FACADE,
    "eventbus.subscriber": FACADE,
    "eventbus.torch": FACADE,
    "eventbus._torch_hooks": FACADE,
    "eventbus._torch_stats": FACADE,
    "eventbus._torch_reduce": FACADE,
    "eventbus._torch_watch": FACADE,
    "eventbus._torch_profile": FACADE,
    "eventbus._torch_profile_table": FACADE,
    # on top: the package face, configuration, the command line, framework bridges, tools
    "eventbus": TOP,
    "eventbus._catalogue": TOP,
    "eventbus.config": TOP,
    "eventbus.config._bus": TOP,
    "eventbus.config._entries": TOP,
    "eventbus.config._sources": TOP,
    "eventbus.cli": TOP,
    "eventbus.cli.__main__": TOP,
    "eventbus.cli.bench": TOP,
    "eventbus.cli._checks": TOP,
    "eventbus.cli._errors": TOP,
    "eventbus.cli._format": TOP,
    "eventbus.cli.compare": TOP,
    "eventbus.cli.ctl": TOP,
    "eventbus.cli.plot": TOP,
    "eventbus.cli.cost": TOP,
    "eventbus.cli.replay": TOP,
    "eventbus.cli.report": TOP,
    "eventbus.cli.runs": TOP,
    "eventbus.cli.summary": TOP,
    "eventbus.cli.tail": TOP,
    "eventbus.bench": TOP,
    "eventbus.bench.inline": TOP,
    "eventbus.bench.measure": TOP,
    "eventbus.bench.report": TOP,
    "eventbus.bench.sources": TOP,
    "eventbus.bench.variants": TOP,
    "eventbus.integrations": TOP,
    "eventbus.integrations._common": TOP,
    "eventbus.integrations.lightning": TOP,
    "eventbus.integrations.transformers": TOP,
}

# Packages whose modules may not import another package's private module.
NO_FOREIGN_PRIVATE = ("eventbus.sinks", "eventbus.monitors")
BRIDGES = "eventbus.integrations"  # subscribers too, on top: the core names none of them


@dataclass(frozen=True)
class Import:
    """One edge of the graph: `source` imports `target` at `path:line`."""

    source: str
    source_package: str  # the package `source` belongs to (itself, for an __init__)
    target: str
    path: str
    line: int
    text: str
    lazy: bool  # inside a function: runs when called
    type_checking: bool  # under `if TYPE_CHECKING:`: never runs

    def where(self) -> str:
        how = " (under TYPE_CHECKING)" if self.type_checking else " (lazy)" if self.lazy else ""
        return f"{self.path}:{self.line}: `{self.text}`{how}"


def module_name(path: Path, root: Path) -> str:
    parts = [root.name, *path.relative_to(root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _resolve(name: str, known: Iterable[str]) -> str:
    """The longest known module that `name` starts with (`a.b.C` -> `a.b`)."""
    best = ""
    for mod in known:
        if (name == mod or name.startswith(mod + ".")) and len(mod) > len(best):
            best = mod
    return best


def scan(root: Path) -> list[Import]:
    """Every import of a module under `root` by a module under `root`."""
    files = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    found: list[Import] = []
    for source, path in files.items():
        found += _scan_file(source, path, str(path.relative_to(root.parent)), files.keys())
    return found


def _scan_file(source: str, path: Path, shown: str, known: Collection[str]) -> list[Import]:
    is_pkg = path.name == "__init__.py"
    package = source if is_pkg else source.rpartition(".")[0]
    found: list[Import] = []

    def visit(node: ast.AST, lazy: bool, tc: bool) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, lazy, True)
            for child in node.orelse:
                visit(child, lazy, tc)
            return
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            lazy = True
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [_resolve(a.name, known) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            for alias in node.names:
                sub = f"{base}.{alias.name}"  # `from pkg import module` names the module
                targets.append(sub if sub in known else _resolve(base, known))
        if isinstance(node, ast.Import | ast.ImportFrom):
            for target in dict.fromkeys(t for t in targets if t):
                found.append(
                    Import(source, package, target, shown, node.lineno, ast.unparse(node), lazy, tc)
                )
        for inner in ast.iter_child_nodes(node):
            visit(inner, lazy, tc)

    visit(ast.parse(path.read_text(encoding="utf-8"), filename=shown), False, False)
    return found


def find_cycles(imports: Iterable[Import]) -> list[str]:
    """One message per strongly connected component of the runtime graph (Tarjan)."""
    edges: dict[str, dict[str, Import]] = {}
    for imp in imports:
        if not imp.type_checking:
            edges.setdefault(imp.source, {}).setdefault(imp.target, imp)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, {})):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in edges.get(v, {}):
                components.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            connect(v)
    return [_describe_cycle(c, edges) for c in sorted(components)]


def _describe_cycle(component: list[str], edges: Mapping[str, Mapping[str, Import]]) -> str:
    """The shortest cycle through the component's first module, edge by edge."""
    start, members = component[0], set(component)
    came: dict[str, Import] = {}
    frontier = [start]
    while frontier and start not in came:
        nxt = []
        for v in frontier:
            for w, imp in sorted(edges.get(v, {}).items()):
                if w in members and w not in came:
                    came[w] = imp
                    nxt.append(w)
        frontier = nxt
    path: list[Import] = []
    node = start
    while True:
        imp = came[node]
        path.append(imp)
        node = imp.source
        if node == start:
            break
    steps = "\n".join(f"    {imp.where()}" for imp in reversed(path))
    others = ""
    if len(component) > len(path):
        others = f" (the cycle's component: {', '.join(component)})"
    return (
        f"import cycle through {start}{others}:\n{steps}\n"
        "  break it: move what both need into the lower module, or pass it in as an argument; "
        "making an import lazy only hides a cycle"
    )


def find_upward(imports: Iterable[Import], layers: Mapping[str, str]) -> list[str]:
    """Imports against MAY_IMPORT, each with what to do instead."""
    problems = []
    for imp in imports:
        low, high = layers.get(imp.source), layers.get(imp.target)
        if low is None or high is None or high in MAY_IMPORT[low]:
            continue
        if low in (CORE, FACADE) and (high == SUBSCRIBERS or imp.target.startswith(BRIDGES)):
            advice = (
                f"the {low} names no concrete subscriber: it runs what subscribe() is given, "
                "and a built-in is named by a string for eventbus.loader"
            )
        elif imp.target == "eventbus":
            advice = (
                "import the name from the module that defines it, not the package face "
                "(which imports everything)"
            )
        elif low == SUBSCRIBERS and high == FACADE:
            advice = (
                "sinks and monitors use the core's public API (eventbus.core, e.g. BusHandle "
                "in on_start), never the bus itself"
            )
        else:
            advice = (
                "depend on a protocol in the lower layer (as eventbus.core.BusHandle does "
                "for the bus), or move this code up a layer"
            )
        problems.append(
            f"{imp.where()}: {imp.source} ({low}) imports {imp.target} ({high}); "
            f"{low} may import only {', '.join(sorted(MAY_IMPORT[low]))}. {advice}"
        )
    return problems


def find_foreign_private(imports: Iterable[Import], packages: tuple[str, ...]) -> list[str]:
    """Modules of `packages` importing a `_private` module of another package."""
    problems = []
    for imp in imports:
        if not imp.source.startswith(packages):
            continue
        last = imp.target.rpartition(".")[2]
        if not last.startswith("_") or last.startswith("__"):
            continue
        target_pkg = imp.target.rpartition(".")[0]
        if imp.source_package != target_pkg:
            problems.append(
                f"{imp.where()}: {imp.source} imports {imp.target}, a private module of "
                f"{target_pkg}; import a public module, or make what it needs public there"
            )
    return problems


def _fail(problems: list[str], heading: str) -> None:
    if problems:
        pytest.fail(f"{heading} ({len(problems)}):\n" + "\n".join(problems), pytrace=False)


# ---- the package itself -------------------------------------------------------------------


@pytest.fixture(scope="module")
def imports() -> list[Import]:
    return scan(PACKAGE)


def test_every_module_is_placed_in_a_layer() -> None:
    modules = {module_name(p, PACKAGE) for p in PACKAGE.rglob("*.py")}
    unplaced = sorted(modules - LAYERS.keys())
    stale = sorted(LAYERS.keys() - modules)
    _fail(
        [f"{m}: not in LAYERS; add it with its layer ({', '.join(MAY_IMPORT)})" for m in unplaced]
        + [f"{m}: in LAYERS but no such module; remove it" for m in stale],
        "tests/test_architecture.py LAYERS does not match eventbus/",
    )


def test_no_import_cycle(imports: list[Import]) -> None:
    _fail(find_cycles(imports), "import cycles in eventbus/, lazy imports included")


def test_no_upward_import(imports: list[Import]) -> None:
    _fail(find_upward(imports, LAYERS), "upward imports in eventbus/")


def test_sinks_and_monitors_import_no_private_module_of_another_package(
    imports: list[Import],
) -> None:
    _fail(find_foreign_private(imports, NO_FOREIGN_PRIVATE), "private modules imported")


def test_no_module_over_max_lines() -> None:
    too_long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        n = len(path.read_text(encoding="utf-8").splitlines())
        if n > MAX_LINES:
            too_long.append(f"{path.relative_to(PACKAGE.parent)}: {n} lines")
    _fail(too_long, f"modules over {MAX_LINES} lines; split each along a seam it already has")


# ---- the checker can fail -----------------------------------------------------------------


def _write(root: Path, files: Mapping[str, str]) -> Path:
    for rel, text in files.items():
        path = root / "pkg" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return root / "pkg"


def test_checker_finds_a_lazy_cycle_and_ignores_type_checking(tmp_path: Path) -> None:
    pkg = _write(
        tmp_path,
        {
            "__init__.py": "",
            "a.py": "import pkg.b\n",
            "b.py": "def f():\n    from pkg import a\n",
            "c.py": "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    import pkg.a\n",
            "d.py": "from . import c\n",
        },
    )
    found = scan(pkg)
    (cycle,) = find_cycles(found)
    assert "pkg/a.py:1: `import pkg.b`" in cycle
    assert "pkg/b.py:2: `from pkg import a` (lazy)" in cycle
    assert [i.target for i in found if i.source == "pkg.d"] == ["pkg.c"]  # relative import
    assert [i.type_checking for i in found if i.source == "pkg.c"] == [True]


def test_checker_finds_upward_and_private_imports(tmp_path: Path) -> None:
    pkg = _write(
        tmp_path,
        {
            "__init__.py": "",
            "events.py": "",
            "core.py": "import typing\nif typing.TYPE_CHECKING:\n    from pkg.bus import B\n",
            "loop.py": "def f():\n    import pkg.sinks\n",
            "bus.py": "from pkg.core import C\nfrom pkg.sinks import S\n",
            "sinks/__init__.py": "from pkg.sinks._own import x\nfrom pkg.mon._rule import r\n",
            "sinks/_own.py": "from pkg.bus import B\n",
            "mon/__init__.py": "",
            "mon/_rule.py": "",
        },
    )
    layers = {
        "pkg": TOP,
        "pkg.events": EVENTS,
        "pkg.core": CORE,
        "pkg.loop": CORE,
        "pkg.bus": FACADE,
        "pkg.sinks": SUBSCRIBERS,
        "pkg.sinks._own": SUBSCRIBERS,
        "pkg.mon": SUBSCRIBERS,
        "pkg.mon._rule": SUBSCRIBERS,
    }
    found = scan(pkg)
    upward = find_upward(found, layers)
    assert len(upward) == 4
    assert upward[0].startswith("pkg/bus.py:2: `from pkg.sinks import S`: pkg.bus (facade)")
    assert upward[1].startswith("pkg/core.py:3: `from pkg.bus import B` (under TYPE_CHECKING)")
    assert upward[2].startswith("pkg/loop.py:2: `import pkg.sinks` (lazy)")
    assert "the core names no concrete subscriber" in upward[2]
    assert "the facade names no concrete subscriber" in upward[0]
    assert upward[3].startswith("pkg/sinks/_own.py:1: `from pkg.bus import B`")
    assert "the core's public API" in upward[3]
    (cycle,) = find_cycles(found)  # bus -> sinks -> sinks._own -> bus
    assert "pkg/sinks/_own.py:1: `from pkg.bus import B`" in cycle
    assert "pkg/core.py" not in cycle  # core -> bus under TYPE_CHECKING closes no runtime cycle
    (private,) = find_foreign_private(found, ("pkg.sinks",))
    assert private.startswith("pkg/sinks/__init__.py:2: `from pkg.mon._rule import r`")


def test_py_typed_ships() -> None:
    """PEP 561: the marker exists and the wheel carries it (pyproject's package-data)."""
    pyproject = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text(encoding="utf-8"))
    assert (PACKAGE / "py.typed").is_file()
    assert "py.typed" in pyproject["tool"]["setuptools"]["package-data"]["eventbus"]
