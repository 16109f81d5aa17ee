"""Import rules of the four Python rooms (/work/shared/ARCHITECTURE.md, docs/development.md).

::

    manifest ◀── engines ◀── gateway          loadtests ──▶ (the network)

- ``manifest`` is pure: the standard library's pure modules, cbor2, msgspec, pydantic,
  numpy; never asyncio, httpx, fastapi, vllm, and none of our other packages.
- ``engines`` imports ``manifest`` (and itself); ``gateway`` imports ``manifest`` and
  ``engines``; none of the three imports ``loadtests``.
- Inside ``gateway`` a stage imports itself and the stages below it, never one beside
  or above it::

    http, grpc ──▶ service ──▶ local, providers, sessions, state ──▶ core ──▶ engines, manifest

  (``sessions`` never sees ``providers`` or ``local``; the edges reach the engines only
  through ``service``).  The composition roots at the top of gateway/ (``app``, ``cli``,
  ``session_cli``, ...) wire everything together.
- ``loadtests`` drives a gateway through the network (HTTP, gRPC, the processes it
  starts).  What it takes from the other packages is listed in :data:`LOADTESTS_REACH`,
  each with its importers and its reason; the provider emulator (``loadtests.emulator``)
  is a stand-in for a hosted provider and imports nothing of ours outside itself.
- No module of the four packages imports another in a circle, directly or through others.

An import is an edge to the module it names: ``from a.b import c`` is an edge to
``a.b.c`` when that is a module, to ``a.b`` otherwise; relative imports are resolved;
function-level and ``TYPE_CHECKING`` imports count (they hide a dependency, they do not
cut it).
"""

from __future__ import annotations

import ast
from collections import deque
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("manifest", "engines", "gateway", "loadtests")
OURS = {*PACKAGES, "tests", "scripts"}  # top-level names that are this repository's code
# generated from protos/ at setup (scripts/gen_protos.sh): modules whether or not this
# checkout has generated them yet
GENERATED = {"gateway.grpc.api.gateway_pb2", "gateway.grpc.api.gateway_pb2_grpc"}

PURE = {
    "__future__",
    "base64",
    "bisect",
    "collections",
    "contextlib",
    "dataclasses",
    "enum",
    "hashlib",
    "itertools",
    "json",
    "math",
    "operator",
    "re",
    "struct",
    "typing",
    "cbor2",
    "msgspec",
    "pydantic",
    "numpy",
    "manifest",
}
ROOMS: dict[str, set[str]] = {  # what each room may import of ours besides itself
    "manifest": set(),
    "engines": {"manifest"},
    "gateway": {"manifest", "engines"},
}
STAGES: dict[str, set[str]] = {
    "core": set(),
    "state": {"core"},
    "local": {"core"},
    "providers": {"core"},
    "sessions": {"core"},
    "service": {"core", "local", "providers", "sessions", "state"},
    "batches": {"core", "service", "sessions"},
    "http": {"batches", "core", "service"},
    "grpc": {"core", "service"},
}
ROOTS = {"app", "cli", "session_cli", "plan_cli", "workers", "__init__"}

# What loadtests/ imports of the other packages: module -> (its importers, why not the
# network).  Anything else of gateway, engines or manifest is reached over the network.
LOADTESTS_REACH: dict[str, tuple[set[str], str]] = {
    "gateway.grpc.api.gateway_pb2": (
        {"loadtests.locustfile"},
        "the gRPC user's messages: stubs generated from protos/, the wire contract",
    ),
    "gateway.grpc.api.gateway_pb2_grpc": (
        {"loadtests.locustfile"},
        "the gRPC user's client stub, generated from protos/",
    ),
    "engines.sse": (
        {"loadtests.locustfile", "loadtests.agents_locust"},
        "the sans-I/O SSE decoder parses the streams the users read off the network",
    ),
    "engines.tokenizer": (
        {"loadtests.run", "loadtests.bench_render", "loadtests.bench_routes"},
        "the workloads are sized in the model's tokens (counted client-side); the render "
        "benchmark tokenizes in process; the routes benchmark's gateways tokenize with it",
    ),
    "engines.vllm.demo_lora": (
        {"loadtests.lora_routing"},
        "builds the demo adapters the gateways it starts load from their resolver directory",
    ),
    "engines.vllm.demo_model": (
        {"loadtests.bench_render", "loadtests.bench_workers", "loadtests.bench_routes"},
        "builds the demo model the processes they start load",
    ),
    "gateway.core.keys": (
        {"loadtests.admin_key"},
        "the api_keys setting of the gateways the load tests start, built by the model "
        "that reads it, so the key they send is one the gateway accepts",
    ),
    "gateway.core.config": (
        {
            "loadtests.agent_sessions",
            "loadtests.routing_pressure",
            "loadtests.batch_local",
            "loadtests.bench_routes",
        },
        "the vllm-router arm serves the model the gateway would (resolve_model(Settings())); "
        "the routes benchmark's in-process gateways are configured by it",
    ),
    "gateway.local.build": (
        {"loadtests.agent_sessions", "loadtests.routing_pressure", "loadtests.batch_local"},
        "resolve_model: the model path (or the demo model) exactly as the gateway resolves it",
    ),
    "gateway.service.render_thread": (
        {"loadtests.bench_render"},
        "the render benchmark measures the render thread itself, in process",
    ),
    "manifest.hashing": (
        {"loadtests.bench_manifest", "loadtests.bench_kv_events"},
        "the manifest benchmark, in process; the KV-event benchmark's prompts' block hashes",
    ),
    "manifest.identity": ({"loadtests.bench_manifest"}, "the manifest benchmark, in process"),
    "manifest.index": (
        {"loadtests.bench_manifest", "loadtests.bench_kv_events"},
        "the manifest benchmark, in process; the KV-event benchmark folds into the index",
    ),
    "manifest.records": ({"loadtests.bench_manifest"}, "the manifest benchmark, in process"),
    "gateway.batches.plan": (
        {"loadtests.batch_workload"},
        "the batch workload orders its items as the batch runner does, in process",
    ),
    "gateway.batches.provider_plan": (
        {"loadtests.batch_workload"},
        "the batch workload prints the provider plan's prediction beside what it measured",
    ),
    "gateway.batches.targets": (
        {"loadtests.batch_workload"},
        "the provider plan's option for each provider, from its documented profile",
    ),
    "gateway.service.journal": (
        {"loadtests.bench_session_log"},
        "the session-log benchmark drives the journal in process, as the service loop does",
    ),
    "gateway.sessions.log": ({"loadtests.bench_session_log"}, "the log under the journal"),
    "gateway.sessions.store": ({"loadtests.bench_session_log"}, "the log's SQLite store"),
    "gateway.sessions.reconstruct": ({"loadtests.bench_session_log"}, "the log's rebuild"),
    "gateway.sessions.render": ({"loadtests.bench_session_log"}, "the vLLM payload's bytes"),
    "gateway.core.outputs": ({"loadtests.bench_session_log"}, "an answer's usage"),
    "manifest.sessionlog": ({"loadtests.bench_session_log"}, "the requests' header and turns"),
    "manifest.prefix_dag": ({"loadtests.batch_workload"}, "the batch's DAG order, in process"),
    "manifest.economics": (
        {"loadtests.batch_workload", "loadtests.batch_local"},
        "H(7,s)/H(V,s) beside the measured",
    ),
    # the KV-event and routing micro-benchmark drives the subscriber's decode, the index's
    # fold and Dispatcher.route in process (loadtests/bench_kv_events.py)
    "engines.base": ({"loadtests.bench_kv_events"}, "the routed requests"),
    "engines.vllm.kv_stream": ({"loadtests.bench_kv_events"}, "the events' decode and order"),
    "gateway.core.metrics": ({"loadtests.bench_kv_events"}, "the dispatcher's metrics"),
    "gateway.local.dispatch": ({"loadtests.bench_kv_events"}, "Dispatcher.route, measured"),
    "gateway.local.kv_sync": ({"loadtests.bench_kv_events"}, "the fold of a replica's events"),
    "gateway.local.leases": ({"loadtests.bench_kv_events"}, "the fold's lease book"),
    "gateway.local.replica_set": ({"loadtests.bench_kv_events"}, "the routed replica set"),
    "gateway.local.replicas": ({"loadtests.bench_kv_events"}, "the routed replica"),
    "gateway.local.routing": ({"loadtests.bench_kv_events"}, "the router"),
    "gateway.local.spans": ({"loadtests.bench_kv_events"}, "the spans the hold goes through"),
    # the HTTP-layer micro-benchmark builds two gateways in process over the in-memory
    # engine, one with the direct routes and one without (loadtests/bench_routes.py)
    "gateway.app": ({"loadtests.bench_routes"}, "the gateways, built as the server builds them"),
    "gateway.http.direct": ({"loadtests.bench_routes"}, "taken out of one of them"),
    "engines.fake": ({"loadtests.bench_routes"}, "the in-memory engine they serve from"),
}


def _module_name(path: Path, root: Path = ROOT) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _sources(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the four packages and its file (the generated stubs left out)."""
    return {
        _module_name(p, root): p
        for pkg in PACKAGES
        for p in sorted((root / pkg).rglob("*.py"))
        if "_pb2" not in p.name
    }


SOURCES = _sources()
KNOWN = set(SOURCES) | GENERATED


def _imports(path: Path, name: str, known: set[str]) -> set[str]:
    """The modules ``path`` (module ``name``) imports, resolved as the module docstring says."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in known else base)
    return found


def _relative(path: Path) -> bool:
    return any(
        isinstance(n, ast.ImportFrom) and n.level for n in ast.walk(ast.parse(path.read_text()))
    )


EDGES: dict[str, set[str]] = {n: _imports(p, n, KNOWN) for n, p in SOURCES.items()}


def _ours(modules: set[str]) -> set[str]:
    return {m for m in modules if m.split(".")[0] in OURS}


def _room(name: str) -> str:
    return name.split(".")[0]


def _in(room: str) -> list[str]:
    return sorted(n for n in SOURCES if _room(n) == room)


# --- the rooms ------------------------------------------------------------------------


@pytest.mark.parametrize("name", _in("manifest"))
def test_manifest_imports_only_pure_modules(name: str) -> None:
    top = {m.split(".")[0] for m in EDGES[name]}
    assert top <= PURE, f"{name} imports {sorted(top - PURE)}"


@pytest.mark.parametrize("name", [*_in("manifest"), *_in("engines"), *_in("gateway")])
def test_each_room_imports_only_the_rooms_below_it(name: str) -> None:
    room = _room(name)
    allowed = ROOMS[room] | {room}
    used = {_room(m) for m in _ours(EDGES[name])}
    assert used <= allowed, f"{name} ({room}) may not import {sorted(used - allowed)}"


@pytest.mark.parametrize("name", [*_in("manifest"), *_in("engines"), *_in("gateway")])
def test_the_installed_packages_use_absolute_imports(name: str) -> None:
    assert not _relative(SOURCES[name]), f"{name}: relative import"


# --- loadtests ------------------------------------------------------------------------


@pytest.mark.parametrize("name", _in("loadtests"))
def test_loadtests_reach_the_other_packages_only_as_listed(name: str) -> None:
    outside = {m for m in _ours(EDGES[name]) if _room(m) != "loadtests"}
    unlisted = sorted(m for m in outside if name not in LOADTESTS_REACH.get(m, (set(), ""))[0])
    assert not unlisted, (
        f"{name} imports {unlisted}: reach the gateway through the network, or add the "
        "module to LOADTESTS_REACH with its importer and the reason"
    )


def test_every_listed_reach_is_still_used() -> None:
    """The list is the truth, not a leftover: each importer named imports its module."""
    stale = sorted(
        (importer, module)
        for module, (importers, _) in LOADTESTS_REACH.items()
        for importer in importers
        if module not in EDGES.get(importer, set())
    )
    assert not stale, f"listed but not imported: {stale}"


@pytest.mark.parametrize(
    "name", [n for n in _in("loadtests") if n.startswith("loadtests.emulator")]
)
def test_the_emulator_imports_nothing_of_ours_outside_itself(name: str) -> None:
    outside = {m for m in _ours(EDGES[name]) if not m.startswith("loadtests.emulator")}
    assert not outside, f"{name} imports {sorted(outside)}"


LOADTESTS_TOP = {n.split(".")[1] for n in _in("loadtests") if n.count(".") >= 1}


@pytest.mark.parametrize("name", _in("loadtests"))
def test_loadtests_import_their_own_modules_through_the_package(name: str) -> None:
    """``from loadtests.report import ...``, never ``from report import ...`` (which works
    only with loadtests/ itself on sys.path, and loads a second copy of the module)."""
    bare = {m for m in EDGES[name] if m.split(".")[0] in LOADTESTS_TOP}
    assert not bare, f"{name} imports {sorted(bare)}: import them as loadtests.<module>"


@pytest.mark.parametrize(
    "path",
    sorted([*(ROOT / "loadtests").rglob("*.py"), *(ROOT / "scripts").rglob("*.py")]),
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_no_script_edits_sys_path(path: Path) -> None:
    """loadtests is a package and the scripts run as modules (``python -m loadtests.run``):
    nothing puts a folder on ``sys.path`` to find its neighbours."""
    edits = [
        n.lineno
        for n in ast.walk(ast.parse(path.read_text()))
        if isinstance(n, ast.Attribute)
        and n.attr == "path"
        and isinstance(n.value, ast.Name)
        and n.value.id == "sys"
    ]
    assert not edits, f"sys.path at lines {edits}"


# --- gateway's stages -------------------------------------------------------------------


def _stage(name: str) -> str:
    return name.split(".")[1] if "." in name else "__init__"


def test_every_gateway_module_has_a_stage() -> None:
    unknown = {_stage(n) for n in _in("gateway")} - set(STAGES) - ROOTS
    assert not unknown, f"modules outside the stages: {unknown}"


@pytest.mark.parametrize("name", _in("gateway"))
def test_gateway_imports_only_down_its_stages(name: str) -> None:
    stage = _stage(name)
    if stage in ROOTS:
        return
    allowed = STAGES[stage] | {stage}
    used = {_stage(m) for m in EDGES[name] if m.startswith("gateway.")}
    assert used <= allowed, f"{stage} may not import {sorted(used - allowed)}"
    assert "gateway" not in EDGES[name], "import the stage's modules, not the package"


# --- circles --------------------------------------------------------------------------


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import circle in ``graph`` (one per strongly connected component of more
    than one module, or a module that imports itself), found by Tarjan's algorithm."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph.get(v, ()):
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _circle(graph: dict[str, set[str]], members: list[str]) -> list[str]:
    """One shortest circle through the first of ``members`` (a strongly connected
    component), as the path of imports that closes it."""
    start, inside = members[0], set(members)
    came: dict[str, str] = {}
    todo = deque([start])
    while todo:
        v = todo.popleft()
        for w in sorted(graph.get(v, ())):
            if w == start:
                path = [v]
                while path[-1] != start:
                    path.append(came[path[-1]])
                return [start, *reversed(path[:-1]), start]
            if w in inside and w not in came:
                came[w] = v
                todo.append(w)
    raise AssertionError(f"no circle through {start}")


def _named(graph: dict[str, set[str]]) -> list[str]:
    return [" -> ".join(_circle(graph, c)) for c in _cycles(graph)]


def test_no_import_circle_in_the_four_packages() -> None:
    """No modules of gateway/, engines/, manifest/ or loadtests/ import each other in a
    loop, directly or through others; a failure names each circle."""
    graph = {n: {m for m in edges if m in SOURCES and m != n} for n, edges in EDGES.items()}
    assert _named(graph) == []


# --- the rules catch what they are for --------------------------------------------------


def _package(tmp_path: Path, files: dict[str, str]) -> tuple[set[str], dict[str, set[str]]]:
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    paths = {_module_name(p, tmp_path): p for p in tmp_path.rglob("*.py")}
    return set(paths), {n: _imports(p, n, set(paths)) for n, p in paths.items()}


def test_from_a_package_import_a_module_is_an_edge_to_the_module(tmp_path: Path) -> None:
    _, edges = _package(
        tmp_path,
        {
            "a/__init__.py": "",
            "a/b/__init__.py": "",
            "a/b/c.py": "X = 1\n",
            "a/b/d.py": "from a.b import c, helper\nfrom a.b.c import X\n",
            "a/b/e.py": "from . import c\nfrom .c import X\nfrom .. import b\n",
            "a/b/f.py": "def late() -> None:\n    import a.b.c\n",
        },
    )
    assert edges["a.b.d"] == {"a.b.c", "a.b"}  # helper is no module: the package
    assert edges["a.b.e"] == {"a.b.c", "a.b"}
    assert edges["a.b.f"] == {"a.b.c"}  # function-level imports count


def test_the_stage_rule_catches_a_violation() -> None:
    edges = {"gateway.providers.path"}
    assert not {_stage(m) for m in edges} <= STAGES["sessions"] | {"sessions"}


def test_the_room_rule_catches_a_violation(tmp_path: Path) -> None:
    _, edges = _package(
        tmp_path, {"manifest/__init__.py": "", "manifest/x.py": "import engines.base\n"}
    )
    assert {_room(m) for m in _ours(edges["manifest.x"])} == {"engines"}


def test_the_circle_rule_catches_a_circle_and_names_it() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _named(graph) == ["a -> b -> c -> a"]
    assert _named({"a": {"b", "c"}, "b": {"a"}, "c": {"b"}}) == ["a -> b -> a"]
    assert _cycles({"a": {"b"}, "b": set()}) == []
