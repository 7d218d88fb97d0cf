"""The package's modules import one another without a circle.

A circle (``engine`` importing ``sparse`` importing ``engine``) works only while
the late imports that break it stay late; it also ties the modules' order of
initialisation to whoever imports first.  Imports inside functions count too:
they are the usual way a circle is hidden.
"""

import ast
import pathlib

import switchml

PACKAGE = pathlib.Path(switchml.__file__).parent


def modules() -> dict:
    """Dotted module name -> (path, is a package)."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if package else parts)] = (path, package)
    return found


def import_graph() -> dict:
    """Module -> the package's modules it imports anywhere in its body.

    ``from pkg import name`` is an edge to ``pkg.name`` when that is a module,
    else to ``pkg``; a package's parent is not counted (Python imports it before
    any submodule, whoever asks).
    """
    found = modules()
    graph = {}
    for name, (path, package) in found.items():
        here = name.split(".") if package else name.split(".")[:-1]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges |= {a.name for a in node.names if a.name in found}
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here[:len(here) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                for a in node.names:
                    if f"{source}.{a.name}" in found:
                        edges.add(f"{source}.{a.name}")
                    elif source in found:
                        edges.add(source)
        edges.discard(name)
        graph[name] = edges
    return graph


def find_cycle(graph: dict) -> list | None:
    """One circle of the graph as a list of modules, or None."""
    state: dict = {}  # module -> "open" while on the path, "done" once explored
    path: list = []

    def visit(node):
        state[node] = "open"
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_the_checker_sees_a_circle_and_function_level_imports():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    graph = import_graph()
    # dense.Membership starts every kind of call; none of them imports dense back
    assert {"switchml.worker.engine.sparse", "switchml.worker.engine.compiled",
            "switchml.worker.engine.stream"} <= graph["switchml.worker.engine.dense"]
    assert "switchml.worker.engine.dense" not in graph["switchml.worker.engine.sparse"]
    # an import inside a function is an edge (cli imports the switch in _switch)
    assert "switchml.switch.server" in graph["switchml.cli"]


def test_no_module_of_the_package_imports_itself_back():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


#: A source checkout's folders beside the package: an installed package has none of them.
CHECKOUT_FOLDERS = {"bench", "tests", "examples", "conftest"}


def upward_imports(source: str) -> list:
    """The names ``source`` imports from a source checkout's folders (absolute
    imports, and ``importlib.import_module`` of a literal name)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant)):
            names = [str(node.args[0].value)]
        found += [n for n in names if n.split(".")[0] in CHECKOUT_FOLDERS]
    return found


def test_no_module_of_the_package_imports_the_checkouts_folders():
    """The package works installed: nothing in it imports bench/, tests/ or examples/."""
    assert upward_imports("import bench.suite\nfrom tests import x\n"
                          "importlib.import_module('bench.suite')\nfrom . import bench\n") == [
        "bench.suite", "tests", "bench.suite"]
    offenders = {name: found for name, (path, _) in modules().items()
                 if (found := upward_imports(path.read_text()))}
    assert offenders == {}


#: The package's layers, lowest first: a module imports only from its own layer or
#: a lower one.  A part is named by its folder (every module in it) or a module; the
#: longest name that matches a module decides its layer.
LAYERS = [
    ["errors", "config", "auth", "netutil", "ethtool", "wire", "quant", "protocol", "buffers"],
    # the host records the rendezvous exchanges are the local stage's lowest part
    ["switch.dataplane", "worker.engine", "switch.gather", "switch.lobby", "worker.local.hosts"],
    ["switch.xdp", "switch.control", "switch.descriptors", "worker.control",
     "worker.rendezvous", "worker.calls"],
    ["switch.racks", "worker.multi"],
    ["switch.server", "switch.connections", "switch.sockets", "switch.process",
     "switch.metrics", "worker.local"],
    ["worker.client", "switch", "worker"],
    ["", "sim", "torch", "testbed", "bench", "demo", "cli"],
]


def layer(module: str, layers=LAYERS) -> int:
    """The layer of a dotted module name of the package (``switchml.`` dropped)."""
    name = module.removeprefix("switchml").removeprefix(".")
    best = max((part for parts in layers for part in parts
                if part == "" or name == part or name.startswith(part + ".")), key=len)
    return next(i for i, parts in enumerate(layers) if best in parts)


def upward_edges(graph: dict) -> list:
    return sorted((a, b) for a, edges in graph.items() for b in edges if layer(b) > layer(a))


def test_no_import_runs_upward():
    """Lower layers never import upper ones: the engine and the data planes know
    nothing of the sockets' owners, the local stage nothing of torch."""
    assert layer("switchml.worker.engine.dense") == 1
    assert layer("switchml.switch.server") == 4 and layer("switchml.torch.staging") == 6
    assert upward_edges({"switchml.wire": {"switchml.worker.client"},
                         "switchml.worker.client": {"switchml.wire"}}) == [
        ("switchml.wire", "switchml.worker.client")]
    assert upward_edges(import_graph()) == []
