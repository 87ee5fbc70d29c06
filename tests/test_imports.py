"""Dependencies point one way (design.md): config -> mesh -> data/model/attention -> trainer -> checkpoint/metrics ->
the training entry. The tools (the eval CLI, bench, compile, plan) stand on top of that core, in an order of their own,
and nothing imports an entry point (a `__main__` module).

Read from the source with ast, so every import counts, at the top of a module or inside a function: a function-level
import is still a dependency, only a deferred one. The one deferred import the core makes of a tool is listed in
DEFERRED with its reason and checked to stay deferred; and the training path is also checked as Python loads it, in a
subprocess.
"""

import ast
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "maxctx"
# The training path: `python -m maxctx.train` and what it stands on.
CORE = ("maxctx.train", "maxctx.trainer", "maxctx.checkpoint", "maxctx.data", "maxctx.model", "maxctx.attention",
        "maxctx.config", "maxctx.mesh", "maxctx.sharding", "maxctx.scoring")
# The scoring library (the sweep a run evaluates with) is core; the eval command, all of maxctx.eval, is a tool.
TOOLS = ("maxctx.eval", "maxctx.bench", "maxctx.compile", "maxctx.plan", "maxctx.launch", "maxctx.convert",
         "maxctx.train_tokenizer")
# The tools' own order, lowest first: bench compiles with the compile library; the planner measures and compiles with
# bench; the launcher asks the compile library whether a step fits. Their entry points stand above all of them
# (`python -m maxctx.compile` plans `auto` for its slice).
TOOL_ORDER = ("maxctx.compile", "maxctx.bench", "maxctx.plan", "maxctx.launch")
# (core module, tool module) -> why the core imports that tool inside a function, only when a run asks for it.
DEFERRED = {("maxctx.train", "maxctx.plan.auto"): "attention.strategy or model.remat `auto` asks the planner to "
                                                  "measure candidates on the devices present"}


def module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def within(name: str, prefixes) -> bool:
  # `_`: the flat plan_*.py and compile_report.py files count with the packages they belong to.
  return any(name == p or name.startswith(p + ".") or name.startswith(p + "_") for p in prefixes)


def _names(node, package: str) -> set[str]:
  found = set()
  if isinstance(node, ast.Import):
    found.update(a.name for a in node.names)
  elif isinstance(node, ast.ImportFrom):
    base = node.module or ""
    if node.level:
      base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
    for a in node.names:
      found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base)
  return found


def imports(name: str, top_only: bool = False) -> set[str]:
  """The maxctx modules `name` imports: `from maxctx.x import y` names maxctx.x.y where that is a module. With
  `top_only`, those imported when the module loads (not inside a function)."""
  path = MODULES[name]
  package = name if path.name == "__init__.py" else name.rpartition(".")[0]
  found = set()
  stack = [ast.parse(path.read_text(), str(path))]
  while stack:
    node = stack.pop()
    found |= _names(node, package)
    for child in ast.iter_child_nodes(node):
      if not (top_only and isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))):
        stack.append(child)
  return {m for m in found if m in MODULES and m != name}


GRAPH = {name: imports(name) for name in MODULES}
TOP = {name: imports(name, top_only=True) for name in MODULES}


def closure(start: str, graph, skip=frozenset()) -> set[str]:
  """Every module `start` reaches in `graph`, not following the edges in `skip`."""
  seen, stack = set(), [start]
  while stack:
    m = stack.pop()
    for t in graph[m]:
      if t not in seen and (m, t) not in skip:
        seen.add(t)
        stack.append(t)
  return seen


def test_the_graph_is_read():
  # Guards the reader itself: known edges must be found, or the checks below would pass on an empty graph.
  assert "maxctx.attention.registry" in GRAPH["maxctx.attention.ring"]
  assert "maxctx.trainer" in TOP["maxctx.train"]
  assert "maxctx.data.tasks" in GRAPH["maxctx.data.dataset"]
  assert all(any(within(m, (c,)) for m in MODULES) for c in CORE + TOOLS)


@pytest.mark.parametrize("core", CORE)
def test_core_imports_no_tool(core):
  bad = sorted(f"{m} imports {t}" for m in GRAPH if within(m, (core,)) for t in GRAPH[m]
               if within(t, TOOLS) and (m, t) not in DEFERRED)
  assert not bad, "; ".join(bad)


def test_no_library_imports_a_tool():
  # The modules beside the core (metrics, chips, topology, the scoring library, ...) are below the tools too.
  bad = sorted(f"{m} imports {t}" for m in GRAPH if not within(m, TOOLS) for t in GRAPH[m]
               if within(t, TOOLS) and (m, t) not in DEFERRED)
  assert not bad, "; ".join(bad)


def test_deferred_imports_stay_deferred():
  # Each allowed exception exists (none goes stale) and happens inside a function, never when the module loads.
  for (m, t), why in DEFERRED.items():
    assert t in GRAPH[m], f"{m} no longer imports {t}; drop it from DEFERRED ({why})"
    assert t not in TOP[m], f"{m} imports {t} when it loads; import it only where {why}"


def test_the_training_path_reaches_no_tool():
  # What `python -m maxctx.train` loads (every module-level import, transitively), and what it could ever import
  # but for DEFERRED: none is a tool.
  loaded = sorted(m for m in closure("maxctx.train", TOP) if within(m, TOOLS))
  assert not loaded, f"maxctx.train loads {loaded}"
  reachable = sorted(m for m in closure("maxctx.train", GRAPH, skip=DEFERRED) if within(m, TOOLS))
  assert not reachable, f"maxctx.train may import {reachable}"


def test_the_training_entry_loads_no_tool():
  # Python's own account of what `python -m maxctx.train --help` imports (-X importtime lists every module).
  done = subprocess.run([sys.executable, "-X", "importtime", "-m", "maxctx.train", "--help"], cwd=ROOT,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-2000:]
  loaded = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
  ours = {m for m in loaded if m == "maxctx" or m.startswith("maxctx.")}
  assert {"maxctx.trainer", "maxctx.checkpoint", "maxctx.data"} <= ours   # the listing was read
  tools = sorted(m for m in ours if within(m, TOOLS))
  assert not tools, f"python -m maxctx.train loads {tools}"


def test_nothing_imports_an_entry_point():
  bad = sorted(f"{m} imports {t}" for m in GRAPH for t in GRAPH[m] if t.endswith(".__main__"))
  assert not bad, "; ".join(bad)


def test_tools_stand_in_order():
  # A lower tool never imports a higher one (the entry points, which stand above all tools, aside).
  bad = sorted(f"{m} imports {t}" for i, low in enumerate(TOOL_ORDER) for m in GRAPH
               if within(m, (low,)) and not m.endswith(".__main__") for t in GRAPH[m]
               if within(t, TOOL_ORDER[i + 1:]))
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
