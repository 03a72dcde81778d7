"""Structure of the package, read from its source: no import cycles (function
level imports included), backend-specific imports only in the modules named
for it."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "keras_mhf"


def module_name(path):
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def package_modules():
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imported_modules(path, modules):
    """Every `keras_mhf` module that `path` imports anywhere in its body."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in modules:
                    found.add(alias.name)
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.level:
                raise AssertionError(
                    f"{path}: relative import of {node.module}"
                )
            if not node.module.startswith("keras_mhf"):
                continue
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                found.add(submodule if submodule in modules else node.module)
    return found


def import_graph():
    modules = package_modules()
    return {
        name: imported_modules(path, modules) - {name}
        for name, path in modules.items()
    }


def cycles(graph):
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_two_modules_import_each_other():
    graph = import_graph()
    assert graph[
        "keras_mhf.models.multi_hash_former.multi_hash_former_causal_lm"
    ]  # the reader works
    assert cycles(graph) == []


def test_the_cycle_finder_finds_cycles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_layers_and_models_use_keras_ops_only():
    """No backend imports in layers/ and models/ (backend-specific code lives
    in export.py and distribution.py)."""
    backends = ("jax", "torch", "tensorflow")
    for name, path in package_modules().items():
        if not name.startswith(("keras_mhf.layers", "keras_mhf.models")):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for imported in names:
                assert imported.split(".")[0] not in backends, (
                    f"{name} imports {imported}"
                )


# Application modules: what the recipes and tools run. Nothing in layers/ or
# models/ imports one at module level (a method that delegates to one imports
# it inside itself, as KerasHub's `CausalLM.export_to_transformers` does).
APPLICATION_PREFIXES = (
    "keras_mhf.evaluation",
    "keras_mhf.export",
    "keras_mhf.pretraining",
    "keras_mhf.data",
    "keras_mhf.expansion",
    "keras_mhf.cli",
    "keras_mhf.serving",
)
# What layers/ and models/ may import at module level.
LOWER_PREFIXES = (
    "keras_mhf.layers",
    "keras_mhf.losses",
    "keras_mhf.optimizers",
    "keras_mhf.utils",
    "keras_mhf.signatures",
)


def module_level_imports(path, modules):
    """The `keras_mhf` modules imported by top-level statements of `path`
    (not inside a function or class body)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    body = ast.Module(
        body=[
            node
            for node in tree.body
            if isinstance(node, (ast.Import, ast.ImportFrom))
        ],
        type_ignores=[],
    )
    found = set()
    for node in ast.walk(body):
        if isinstance(node, ast.ImportFrom) and node.module:
            if not node.module.startswith("keras_mhf"):
                continue
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                found.add(submodule if submodule in modules else node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in modules)
    return found


def layering_violations(graph_of_module_level_imports):
    """`(importer, imported)` pairs where a module of layers/ or models/
    imports, at module level, anything that is not below it."""
    violations = []
    for name, imported in sorted(graph_of_module_level_imports.items()):
        if name.startswith("keras_mhf.layers"):
            allowed = LOWER_PREFIXES
        elif name.startswith("keras_mhf.models"):
            allowed = LOWER_PREFIXES + ("keras_mhf.models",)
        else:
            continue
        for target in sorted(imported):
            if not target.startswith(allowed):
                violations.append((name, target))
    return violations


def test_layers_and_models_import_only_downward():
    modules = package_modules()
    graph = {
        name: module_level_imports(path, modules) - {name}
        for name, path in modules.items()
    }
    assert graph[
        "keras_mhf.models.multi_hash_former.multi_hash_former_causal_lm"
    ]
    assert layering_violations(graph) == []


def test_the_layering_check_finds_upward_imports():
    graph = {
        "keras_mhf.models.a": {
            "keras_mhf.evaluation.calibration",
            "keras_mhf.layers.b",
        },
        "keras_mhf.layers.b": {"keras_mhf.models.a", "keras_mhf.utils.c"},
        "keras_mhf.evaluation": {"keras_mhf.models.a"},
    }
    assert layering_violations(graph) == [
        ("keras_mhf.layers.b", "keras_mhf.models.a"),
        ("keras_mhf.models.a", "keras_mhf.evaluation.calibration"),
    ]
    assert all(p.startswith("keras_mhf.") for p in APPLICATION_PREFIXES)


def test_the_top_level_holds_only_pipeline_folders():
    """Each step of the pipeline or application is a folder; nothing else
    sits at the top of the package but `__init__.py`."""
    loose = sorted(
        p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py"
    )
    assert loose == []
    folders = sorted(
        p.name
        for p in PACKAGE.iterdir()
        if p.is_dir() and (p / "__init__.py").exists()
    )
    assert folders == [
        "cli",
        "data",
        "evaluation",
        "expansion",
        "export",
        "layers",
        "losses",
        "models",
        "optimizers",
        "pretraining",
        "serving",
        "settings",
        "signatures",
        "utils",
    ]


# Private names of other modules that the package may use, each for a reason
# (`keras_mhf/utils/keras_private.py` holds every Keras and KerasHub one).
ALLOWED_PRIVATE = {
    ("keras_mhf.cli.common", "_load"): "the package's own lazy loader",
    ("keras_mhf.cli.common", "_exit"): "os._exit is public",
    ("keras_mhf.pretraining.peer_watch", "_exit"): "os._exit is public",
    ("keras_mhf.data.prepare", "_replace"): "a namedtuple's public method",
    ("keras_mhf.utils.torch_compile", "_dynamo"): "PyTorch's compiler",
    ("keras_mhf.pretraining.peer_watch", "jax._src"): (
        "JAX's distributed client: the peer watch shuts it down itself"
    ),
}


def private_reaches(name, path):
    """`(module, private name)` for each use in `path` of another object's
    or module's private name: `x._name` where `x` is not `self`, `cls` or
    `super()` and `_name` is not defined in the module itself, and imports
    of `_name`, `*._private` modules, `keras.src` or `keras_hub.src`."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    own = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            own.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(
            node.ctx, ast.Store
        ):
            own.add(node.attr)
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            value = node.value
            if not node.attr.startswith("_") or node.attr.startswith("__"):
                continue
            if isinstance(value, ast.Name) and value.id in ("self", "cls"):
                continue
            if isinstance(value, ast.Call) and ast.unparse(value) == "super()":
                continue
            if node.attr not in own:
                found.add((name, node.attr))
        elif isinstance(node, ast.ImportFrom) and node.module:
            module = node.module
            parts = module.split(".")
            hidden = [p for p in parts if p[:1] == "_" and p[:2] != "__"]
            if hidden or module.startswith(("keras.src", "keras_hub.src")):
                found.add((name, module))
            found.update(
                (name, a.name)
                for a in node.names
                if a.name.startswith("_") and not a.name.startswith("__")
            )
    return found


def test_private_names_stay_home():
    """No module reaches into another's private names; every Keras and
    KerasHub private name lives in `keras_mhf.utils.keras_private`."""
    found = set()
    for name, path in package_modules().items():
        if name != "keras_mhf.utils.keras_private":
            found |= private_reaches(name, path)
    assert sorted(found - set(ALLOWED_PRIVATE)) == []


def test_the_private_reach_finder_finds_reaches(tmp_path):
    path = tmp_path / "m.py"
    path.write_text(
        "from keras.src.losses import loss\n"
        "from a import _hidden\n"
        "def f(lm, config):\n"
        "    lm._verified = 1\n"
        "    config._checkpoints.save()\n"
        "    self._mine = 2\n"
        "    layer._flatten_layers()\n"
    )
    assert private_reaches("m", path) == {
        ("m", "keras.src.losses"),
        ("m", "_hidden"),
        ("m", "_checkpoints"),
        ("m", "_flatten_layers"),
    }
