"""The package's layering, read from its source with `ast` (nothing is imported): the rules of
docs/layout.md, "Layering rules".

Every import of a package module counts: at module level and inside function bodies, `import`, `from . import`,
relative and absolute, `importlib.import_module("hf_chainflow...")` with a literal name, and the lazy exports
(`_EXPORTS`) of a package `__init__`; `from hf_chainflow import Name` counts as an import of the module that defines
`Name` (the package top's `_EXPORTS`). The package's own `hf_chainflow/__init__.py` (lazy exports, the hook
installer) may import anything and is left out.

- Each top-level module or folder of the package sits in one layer (`LAYERS`); a module imports its own layer or a
  lower one, never a higher one.
- Within one layer a module imports its own folder, and another folder of that layer only where `PEERS` lists the
  pair (one direction each).
- No module under `models/` imports `generation/` or `training/`.
- No import cycle between modules.
- Every module is at most 600 lines, every class at most 400.
- The modules `hf-chainflow --help` imports (`hf_chainflow.commands` and what it imports at module level) import
  neither torch nor transformers at module level (tests/test_package.py runs the command and checks the same at
  run time).

Each failure names the module, the import as written, its line and the rule.
"""

import ast
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hf_chainflow"
MAP = ROOT / "docs" / "layout.md"

# layer -> the top-level modules and folders of the package in it (lower layers never import higher ones)
LAYERS = {
    0: ("_lazy", "fileio", "cli_args", "checks", "machine", "checkpoints"),
    1: ("models",),
    2: ("generation",),
    3: ("training", "targets"),
    4: ("bench", "vllm", "testing"),
    5: ("commands", "cli"),
}
LAYER = {part: layer for layer, parts in LAYERS.items() for part in parts}
# The imports allowed between two different folders or modules of one layer: (importer, imported), one direction.
PEERS = {
    ("fileio", "checks"), ("cli_args", "checks"),  # the integer checks, stdlib only
    ("cli_args", "fileio"),  # an option naming a Hub id or a folder is checked with fileio's pattern and test
    ("training", "targets"),  # the workflows load the real target they prepare, train or evaluate for
    ("vllm", "bench"),  # the serving bench reuses the bench's prompts, machine record and report
    ("cli", "commands"),  # the alias
}
MAX_MODULE_LINES, MAX_CLASS_LINES = 600, 400
HEAVY = ("torch", "transformers")


@dataclass(frozen=True)
class Import:
    importer: str  # the importing module, dotted
    target: str  # the package module it reaches, dotted ("" when the named module does not exist)
    written: str  # the import as written (one name of a `from` import)
    line: int
    scope: str  # "module level" or "in `function`"
    missing: str = ""  # the module name that resolves to no module of the package

    def where(self, root=ROOT):
        return f"{path_of(self.importer, root)}:{self.line}: `{self.written}` ({self.scope})"


def module_name(path: Path, root=ROOT) -> str:
    return ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")


def modules(root=ROOT) -> dict[str, Path]:
    return {module_name(p, root): p for p in sorted((root / "hf_chainflow").rglob("*.py"))
            if "__pycache__" not in p.parts}


def path_of(name: str, root=ROOT) -> str:
    base = root.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.exists():
            return str(path.relative_to(root))
    return name


def part_of(name: str) -> str | None:
    """The top-level module or folder of the package a module belongs to (None for the package top)."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else None


def lazy_exports(tree: ast.Module) -> dict[str, tuple[str, int]]:
    """A package `__init__`'s `_EXPORTS = {"Name": "submodule", **dict.fromkeys(["A", "B"], "submodule"), ...}`:
    name -> (submodule, line)."""
    found = {}
    for node in tree.body:
        if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict)
                and any(isinstance(t, ast.Name) and t.id == "_EXPORTS" for t in node.targets)):
            continue
        for key, value in zip(node.value.keys, node.value.values):
            if isinstance(key, ast.Constant) and isinstance(value, ast.Constant):
                found[key.value] = (value.value, key.lineno)
            elif key is None and isinstance(value, ast.Call) and len(value.args) == 2 \
                    and isinstance(value.args[0], (ast.List, ast.Tuple)) and isinstance(value.args[1], ast.Constant):
                found.update({k.value: (value.args[1].value, value.lineno) for k in value.args[0].elts
                              if isinstance(k, ast.Constant)})
    return found


class _Reader(ast.NodeVisitor):
    """The imports of one module, each with its line and the function it sits in."""

    def __init__(self, name: str, is_package: bool):
        self.name, self.found, self.scope = name, [], []
        self.package = name if is_package else name.rpartition(".")[0]

    def _add(self, dotted, names, line, written):
        self.found.append((dotted, names, line, written, f"in `{self.scope[-1]}`" if self.scope else "module level"))

    def _function(self, node):
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = _function

    def visit_Import(self, node):
        for alias in node.names:
            self._add(alias.name, None, node.lineno, f"import {alias.name}")

    def visit_ImportFrom(self, node):
        base = self.package.rsplit(".", node.level - 1)[0] if node.level else ""
        dotted = ".".join(p for p in (base, node.module) if p)
        for alias in node.names:
            self._add(dotted, alias.name, node.lineno, f"from {'.' * node.level}{node.module or ''} import {alias.name}")

    def visit_Call(self, node):
        func = node.func
        called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        if called in ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            self._add(node.args[0].value, None, node.lineno, f"{called}({node.args[0].value!r})")
        self.generic_visit(node)


def parse(path: Path) -> ast.Module | None:
    """The module's syntax tree, or None where it does not parse (reported by its own test)."""
    try:
        return ast.parse(path.read_text(), str(path))
    except SyntaxError:
        return None


def imports(root=ROOT, top=False) -> list[Import]:
    """Every import of a package module by a package module; by the package top too if `top`."""
    known = modules(root)
    trees = {name: tree for name, path in known.items() if (tree := parse(path)) is not None}
    exports = {name: lazy_exports(tree) for name, tree in trees.items() if known[name].name == "__init__.py"}

    def resolve(dotted, name):
        """(target module, missing name) for `import dotted` or `from dotted import name`."""
        if name is not None and f"{dotted}.{name}" in known:
            return f"{dotted}.{name}", ""
        if name is not None and name in exports.get(dotted, {}):
            return f"{dotted}.{exports[dotted][name][0]}", ""
        return (dotted, "") if dotted in known else ("", dotted)

    found = []
    for importer, tree in trees.items():
        if importer == "hf_chainflow" and not top:
            continue  # the package top: lazy exports and the hook installer may import anything
        reader = _Reader(importer, known[importer].name == "__init__.py")
        reader.visit(tree)
        for submodule, line in exports.get(importer, {}).values():
            reader.found.append((f"{importer}.{submodule}", None, line, f'_EXPORTS "{submodule}"', "lazy export"))
        statements = {}  # (line, written up to `import`, target, missing) -> names: one entry per module reached
        for dotted, name, line, written, scope in reader.found:
            if dotted != "hf_chainflow" and not dotted.startswith("hf_chainflow."):
                continue
            target, missing = resolve(dotted, name)
            head, _, names = written.partition(" import ") if name is not None else (written, "", "")
            statements.setdefault((line, head, scope, target, missing), []).append(names)
        for (line, head, scope, target, missing), names in statements.items():
            written = f"{head} import {', '.join(names)}" if any(names) else head
            found.append(Import(importer, target, written, line, scope, missing))
    return found


def external_imports(path: Path) -> list[tuple[str, int]]:
    """The modules outside the package that `path` imports at module level (top-level statements, and those under
    a module-level `if`/`try`), with their lines."""
    found = []

    def walk(body):
        for node in body:
            if isinstance(node, ast.Import):
                found.extend((a.name, node.lineno) for a in node.names)
            elif isinstance(node, ast.ImportFrom) and not node.level:
                found.append((node.module, node.lineno))
            elif isinstance(node, (ast.If, ast.Try, ast.With)):
                for field in ("body", "orelse", "finalbody"):
                    walk(getattr(node, field, []))
                for handler in getattr(node, "handlers", []):
                    walk(handler.body)

    walk((parse(path) or ast.Module(body=[], type_ignores=[])).body)
    return found


# --- the rules, each returning its violations as lines -------------------------------------------------------


def unparsed(root=ROOT):
    problems = []
    for path in modules(root).values():
        try:
            ast.parse(path.read_text(), str(path))
        except SyntaxError as err:
            problems.append(f"{path.relative_to(root)}:{err.lineno}: does not parse ({err.msg}), so its imports "
                            f"are not checked (rule: every module is read)")
    return problems


def unknown_parts(root=ROOT):
    parts = {part_of(name) for name in modules(root)} - {None}
    return [f"hf_chainflow/{part}: in no layer (rule: every top-level module or folder has a layer; add it to "
            f"LAYERS in tests/test_layout.py and to docs/layout.md, \"Layering rules\")"
            for part in sorted(parts - set(LAYER))]


def missing_modules(root=ROOT):
    return [f"{i.where(root)}: {i.missing} is no module of the package (rule: every import names a module)"
            for i in imports(root) if i.missing]


def layer_violations(root=ROOT):
    problems = []
    for i in imports(root):
        a, b = part_of(i.importer), part_of(i.target)
        if not i.target or b is None or a == b or a not in LAYER or b not in LAYER:
            continue
        if LAYER[a] < LAYER[b]:
            problems.append(f"{i.where(root)}: layer {LAYER[a]} ({a}) imports layer {LAYER[b]} ({b}: {i.target}) "
                            f"(rule: no import from a higher layer)")
        elif LAYER[a] == LAYER[b] and (a, b) not in PEERS:
            problems.append(f"{i.where(root)}: {a} imports its layer-{LAYER[a]} peer {b} ({i.target}) "
                            f"(rule: within a layer, only the peer imports PEERS lists)")
    return problems


def models_violations(root=ROOT):
    return [f"{i.where(root)}: models/ imports {i.target} (rule: no module under models/ imports generation/ or "
            f"training/)" for i in imports(root)
            if part_of(i.importer) == "models" and part_of(i.target) in ("generation", "training")]


def cycles(root=ROOT):
    """Each import cycle between modules (a strongly connected set of more than one module), shown as one closed
    path with the import and line of each step."""
    edges = {}
    for i in imports(root):
        if i.target and i.target != i.importer and i.target != "hf_chainflow":
            edges.setdefault(i.importer, {}).setdefault(i.target, i)
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def connect(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, {}):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10_000))
    try:
        for v in sorted(edges):
            if v not in index:
                connect(v)
    finally:
        sys.setrecursionlimit(limit)
    problems = []
    for group in groups:
        start = min(group)
        paths, seen = {start: []}, {start}  # a shortest path back to `start` inside the group
        frontier, closing = [start], None
        while frontier and closing is None:
            nxt = []
            for v in frontier:
                for w, imp in sorted(edges.get(v, {}).items()):
                    if w == start and closing is None:
                        closing = paths[v] + [imp]
                    elif w in group and w not in seen:
                        seen.add(w)
                        paths[w] = paths[v] + [imp]
                        nxt.append(w)
            frontier = nxt
        steps = "\n".join(f"    {i.where(root)} -> {i.target}" for i in closing)
        problems.append(f"import cycle through {', '.join(sorted(group))} (rule: no import cycle between "
                        f"modules):\n{steps}")
    return problems


def size_violations(root=ROOT):
    problems = []
    for name, path in modules(root).items():
        n = len(path.read_text().splitlines())
        if n > MAX_MODULE_LINES:
            problems.append(f"{path.relative_to(root)}: {n} lines (rule: every module at most {MAX_MODULE_LINES} "
                            f"lines)")
        for node in ast.walk(parse(path) or ast.Module(body=[], type_ignores=[])):
            if isinstance(node, ast.ClassDef):
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                length = node.end_lineno - first + 1
                if length > MAX_CLASS_LINES:
                    problems.append(f"{path.relative_to(root)}:{first}: class {node.name}, {length} lines (rule: "
                                    f"every class at most {MAX_CLASS_LINES} lines)")
    return problems


def help_path_violations(root=ROOT):
    """Module-level torch / transformers imports in the modules `hf-chainflow --help` imports: `hf_chainflow.commands`
    and, transitively, the package modules imported at its module level (and their packages' `__init__`)."""
    known = modules(root)
    eager = {}
    for i in imports(root, top=True):
        if i.target and i.scope == "module level":
            eager.setdefault(i.importer, set()).add(i.target)
    todo, seen = ["hf_chainflow", "hf_chainflow.commands"], set()
    while todo:
        name = todo.pop()
        if name in seen or name not in known:
            continue
        seen.add(name)
        parents = [".".join(name.split(".")[:k]) for k in range(1, len(name.split(".")))]
        todo.extend([*eager.get(name, ()), *parents])
    problems = []
    for name in sorted(seen):
        for external, line in external_imports(known[name]):
            if external.split(".")[0] in HEAVY:
                problems.append(f"{known[name].relative_to(root)}:{line}: `{external}` at module level, on the path "
                                f"of `hf-chainflow --help` (rule: the command line parses without torch or "
                                f"transformers; import it inside the function that needs it)")
    return problems


def _check(problems, what):
    assert not problems, f"{len(problems)} {what}:\n" + "\n".join(problems)


def test_every_module_parses():
    _check(unparsed(), "modules that do not parse")


def test_every_top_level_module_and_folder_has_a_layer():
    _check(unknown_parts(), "parts of the package without a layer")


def test_every_package_import_names_a_module():
    _check(missing_modules(), "imports of modules that do not exist")


def test_no_module_imports_a_higher_layer_or_an_unlisted_peer():
    _check(layer_violations(), "imports against the layering")


def test_models_import_neither_generation_nor_training():
    _check(models_violations(), "imports from models/ into generation/ or training/")


def test_no_import_cycle_between_modules():
    _check(cycles(), "import cycles")


def test_modules_and_classes_stay_small():
    _check(size_violations(), "modules or classes over their size")


def test_help_imports_neither_torch_nor_transformers_at_module_level():
    _check(help_path_violations(), "heavy imports on the command line's path")


def test_the_rules_are_the_documented_ones():
    """docs/layout.md names every layer's parts in its layering table and every allowed peer import."""
    text = MAP.read_text()
    section = text.partition("## Layering rules")[2].partition("\n## ")[0]
    assert section, "docs/layout.md has no section \"Layering rules\""
    for layer, parts in LAYERS.items():
        row = next((line for line in section.splitlines() if line.startswith(f"| {layer} |")), "")
        assert row, f"docs/layout.md, \"Layering rules\": no table row for layer {layer}"
        for part in parts:
            assert f"`{part}`" in row, f"docs/layout.md, \"Layering rules\": layer {layer} does not name `{part}`"
    for a, b in PEERS:
        assert f"`{a}` → `{b}`" in section, f"docs/layout.md, \"Layering rules\": the peer import {a} → {b}"
    assert f"{MAX_MODULE_LINES} lines" in section and f"{MAX_CLASS_LINES} lines" in section


def test_every_package_module_is_named_on_the_map():
    """docs/layout.md, "The modules" names each module of the package by its path inside the package
    (`generation/loop.py`), and no module that is gone, so the map cannot go stale when a module is created, moved,
    split or removed."""
    section = MAP.read_text().partition("## The modules")[2].partition("\n## ")[0]
    named = set(re.findall(r"^\| `([\w/]+\.py)` \|", section, flags=re.M))
    actual = {p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts}
    problems = [f"{m}: a module not named in the table" for m in sorted(actual - named)]
    problems += [f"{m}: named in the table, but no such module" for m in sorted(named - actual)]
    assert not problems, "docs/layout.md, \"The modules\":\n" + "\n".join(problems)


# --- the checks catch what they are for ------------------------------------------------------------------------


def _write(root, files):
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_checks_catch_each_kind_of_violation(tmp_path):
    _write(tmp_path, {
        "hf_chainflow/__init__.py": "_EXPORTS = {'Trainer': 'training.trainer'}\nimport hf_chainflow.commands\n",
        "hf_chainflow/fileio.py": "import os\n",
        "hf_chainflow/cli_args.py": "from hf_chainflow import fileio\n",  # a listed peer: allowed
        "hf_chainflow/models/__init__.py": "",
        "hf_chainflow/models/chainflow/__init__.py": "",
        "hf_chainflow/models/chainflow/modeling.py": ("import torch\n\n\ndef f():\n"
                                                      "    from ...generation import loop\n"),
        "hf_chainflow/generation/__init__.py": "",
        "hf_chainflow/generation/loop.py": "from hf_chainflow import Trainer\nfrom . import search\n",
        "hf_chainflow/generation/search.py": "import importlib\nimportlib.import_module('hf_chainflow.generation.loop')\n",
        "hf_chainflow/training/__init__.py": "",
        "hf_chainflow/training/trainer.py": ("from hf_chainflow.generation.gone import x\n"
                                             "class Big:\n" + "    x = 1\n" * 400 + "\n" * 200),
        "hf_chainflow/targets.py": "from hf_chainflow.training import trainer\n",  # an unlisted peer
        "hf_chainflow/extra.py": "",
        "hf_chainflow/generation/broken.py": "def f(:\n",
        "hf_chainflow/commands/__init__.py": "from hf_chainflow.models.chainflow import modeling\nimport argparse\n",
    })
    layers = "\n".join(layer_violations(tmp_path))
    assert "generation/loop.py:1: `from hf_chainflow import Trainer` (module level): layer 2 (generation) imports " \
           "layer 3 (training: hf_chainflow.training.trainer) (rule: no import from a higher layer)" in layers
    assert "models/chainflow/modeling.py:5: `from ...generation import loop` (in `f`): layer 1 (models)" in layers
    assert "targets.py:1: `from hf_chainflow.training import trainer` (module level): targets imports its layer-3 " \
           "peer training (hf_chainflow.training.trainer) (rule: within a layer" in layers
    assert "cli_args.py" not in layers
    assert "modeling.py:5" in "\n".join(models_violations(tmp_path))
    (cycle,) = cycles(tmp_path)
    assert "hf_chainflow.generation.loop, hf_chainflow.generation.search" in cycle
    assert "search.py:2: `import_module('hf_chainflow.generation.loop')`" in cycle and "loop.py:2" in cycle
    assert [p.split(": ")[0] for p in unknown_parts(tmp_path)] == ["hf_chainflow/extra"]
    assert unparsed(tmp_path) == ["hf_chainflow/generation/broken.py:1: does not parse (invalid syntax), so its "
                                  "imports are not checked (rule: every module is read)"]
    assert "hf_chainflow.generation.gone is no module" in "\n".join(missing_modules(tmp_path))
    sizes = "\n".join(size_violations(tmp_path))
    assert "training/trainer.py: 602 lines" in sizes and "trainer.py:2: class Big, 401 lines" in sizes
    heavy = help_path_violations(tmp_path)
    assert heavy == [f"hf_chainflow/models/chainflow/modeling.py:1: `torch` at module level, on the path of "
                     "`hf-chainflow --help` (rule: the command line parses without torch or transformers; import "
                     "it inside the function that needs it)"]
