"""Dependencies point one way (design.md): the core never imports a tool, and no two modules import each other.

Read from the source with ast, so every import counts, at the top of a module or inside a function: a function-level
import is still a dependency, only a deferred one.
"""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "maxctx"
CORE = ("maxctx.data", "maxctx.model", "maxctx.attention", "maxctx.trainer", "maxctx.checkpoint", "maxctx.config",
        "maxctx.mesh", "maxctx.sharding")
TOOLS = ("maxctx.eval", "maxctx.bench", "maxctx.compile", "maxctx.plan")


def module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def within(name: str, prefixes) -> bool:
  return any(name == p or name.startswith(p + ".") or name.startswith(p + "_") for p in prefixes)


def imports(name: str) -> set[str]:
  """The maxctx modules `name` imports: `from maxctx.x import y` names maxctx.x.y where that is a module."""
  path = MODULES[name]
  package = name if path.name == "__init__.py" else name.rpartition(".")[0]
  found = set()
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      found.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
      for a in node.names:
        found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base)
  return {m for m in found if m in MODULES and m != name}


GRAPH = {name: imports(name) for name in MODULES}


def test_the_graph_is_read():
  # Guards the reader itself: known edges must be found, or the checks below would pass on an empty graph.
  assert "maxctx.attention.registry" in GRAPH["maxctx.attention.ring"]
  assert "maxctx.trainer" in GRAPH["maxctx.train"]
  assert "maxctx.data.tasks" in GRAPH["maxctx.data.dataset"]


@pytest.mark.parametrize("core", CORE)
def test_core_imports_no_tool(core):
  bad = sorted(f"{m} imports {t}" for m in GRAPH if within(m, (core,)) for t in GRAPH[m] if within(t, TOOLS))
  assert not bad, "; ".join(bad)


def test_no_import_cycles():
  # A package's __init__ importing its own submodules is how packages expose them, not a cycle between modules.
  def edges(m):
    return {t for t in GRAPH[m] if not (MODULES[t].name == "__init__.py" and m.startswith(t + "."))}

  state: dict[str, int] = {}   # 1: on the current path, 2: done
  cycles = []

  def visit(m, path):
    state[m] = 1
    for t in sorted(edges(m)):
      if state.get(t) == 1:
        cycles.append(" -> ".join(path[path.index(t):] + [t]))
      elif t not in state:
        visit(t, path + [t])
    state[m] = 2

  for m in sorted(GRAPH):
    if m not in state:
      visit(m, [m])
  assert not cycles, "import cycles: " + "; ".join(cycles)
