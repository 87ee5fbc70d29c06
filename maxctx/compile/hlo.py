"""The collectives of a compiled step, read from its HLO text: which instruction is which kind, whether it belongs to
the attention strategy, and how many bytes each device sends per step.

Bytes are counted per execution, not per instruction: an instruction inside a `while` body runs once per iteration,
so its bytes are multiplied by the loop's trip count, nested loops multiplied together. The trip count is XLA's
`known_trip_count` (in the while's backend_config, which XLA:CPU prints), or the count its op name carries
(`scopes.trips`: the ring's passes, whose bound is opaque to XLA on purpose), or, where the compiler printed neither
(the TPU compiler), read from the loop condition `i < N` with N a constant (the scan over layers, the ring's hops).
A loop whose bound is data-dependent (the blockwise kernel's inner loops, which hold no collectives) counts once;
collectives inside such loops are reported in `unknown_trip_counts`. Both branches of a `conditional` are counted, so
bytes there are an upper bound.

Collectives over groups of one device move nothing and are left out. Bytes sent per device follow the
bandwidth-optimal (ring) algorithm over a group of G devices, from the operand bytes b of one device: all-gather
b·(G−1), reduce-scatter and all-to-all b·(G−1)/G, all-reduce 2·b·(G−1)/G, collective-permute and collective-broadcast
b. That is what crosses a device's links, whatever algorithm the backend picks. Kind and scope are what the compiled
text says: the compiler may combine collectives of different scopes into one, and the TPU compiler rewrites
all-gathers as all-reduces whose metadata no longer names the attention scope, so on TPU only the total is reliable.
"""

from __future__ import annotations

import dataclasses
import math
import re

from maxctx import scopes

# Collective kinds as the compiled HLO names them; an async pair (`-start` / `-done`) counts once.
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute",
               "collective-broadcast", "ragged-all-to-all")
# An instruction whose source op ran inside the model's attention scope: the strategy's own communication. The rest
# is data parallelism (gradient reduction) and ZeRO-3 (parameter all-gathers, gradient reduce-scatters).
ATTENTION_SCOPE = scopes.marker(scopes.ATTENTION)

_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
          "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_ARRAY = re.compile(r"\b(pred|[suf]\d+|bf16|c64|c128|f8e\w+)\[([\d,]*)\]")
_COMPUTATION = re.compile(r"^(ENTRY\s+)?%([\w.\-]+)\s")
_INSTRUCTION = re.compile(r"^\s+(?:ROOT\s+)?%([\w.\-]+)\s*=\s*")
_OPCODE = re.compile(r"([a-z][\w\-]*)\(")
_CALLEES = re.compile(r"\b(?:body|calls|to_apply|branch_computations|true_computation|false_computation)="
                      r"(\{[^}]*\}|%[\w.\-]+)")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_SCOPED_TRIP = re.compile(r'op_name="[^"]*/' + scopes.TRIPS + r'(\d+)/while"')


def shape_bytes(shape: str) -> int:
  """Bytes of an HLO shape, a tuple's elements summed: `f32[2,4]{1,0}` → 32."""
  total = 0.0
  for dtype, dims in _ARRAY.findall(shape):
    size = _BYTES.get(dtype, 1 if dtype.startswith("f8") else 4)
    total += size * math.prod(int(d) for d in dims.split(",") if d)
  return int(total)


def _balanced(text: str, start: int) -> int:
  """Index just past the bracket that closes the one at text[start]."""
  depth = 0
  pairs = {"(": ")", "{": "}", "[": "]"}
  opener = text[start]
  for i in range(start, len(text)):
    if text[i] == opener:
      depth += 1
    elif text[i] == pairs[opener]:
      depth -= 1
      if depth == 0:
        return i + 1
  return len(text)


@dataclasses.dataclass
class Instruction:
  name: str
  shape: str
  opcode: str
  operands: list[str]
  args: str         # the text between the opcode's parentheses
  attributes: str
  is_root: bool = False


def _parse_instruction(line: str) -> Instruction | None:
  m = _INSTRUCTION.match(line)
  if not m:
    return None
  rest = line[m.end():]
  if rest.startswith("("):
    end = _balanced(rest, 0)
  else:
    end = rest.find(" ")
  shape, rest = rest[:end], rest[end:].lstrip()
  op = _OPCODE.match(rest)
  if not op:
    return None
  args_end = _balanced(rest, op.end() - 1)
  args = rest[op.end():args_end - 1]
  return Instruction(m.group(1), shape, op.group(1), re.findall(r"%([\w.\-]+)", args), args, rest[args_end:],
                     line.lstrip().startswith("ROOT "))


def _trip_count(loop: Instruction, bodies: dict[str, list[Instruction]], by_name: dict[str, Instruction]) -> int | None:
  """The iterations of a while loop: XLA's `known_trip_count` if recorded (XLA:CPU records it; the TPU compiler's
  output does not), else read from the condition `i < N` with N a constant and i's start a constant (or 0)."""
  if trip := _TRIP.search(loop.attributes):
    return int(trip.group(1))
  if trip := _SCOPED_TRIP.search(loop.attributes):
    return int(trip.group(1))
  cond = re.search(r"condition=%([\w.\-]+)", loop.attributes)
  root = next((i for i in bodies.get(cond.group(1), []) if i.is_root), None) if cond else None
  if root is None or root.opcode != "compare" or "direction=LT" not in root.attributes or len(root.operands) != 2:
    return None
  counter, bound = (by_name.get(o) for o in root.operands)
  if bound is None or bound.opcode != "constant" or counter is None or counter.opcode != "get-tuple-element":
    return None
  index = re.search(r"index=(\d+)", counter.attributes)
  init = by_name.get(loop.operands[0]) if loop.operands else None
  start = 0
  if index and init is not None and init.opcode == "tuple" and int(index.group(1)) < len(init.operands):
    first = by_name.get(init.operands[int(index.group(1))])
    if first is not None and first.opcode == "constant" and first.args.strip().lstrip("-").isdigit():
      start = int(first.args)
  try:
    return max(int(bound.args) - start, 0)
  except ValueError:
    return None


def _kind(opcode: str) -> str | None:
  """The collective kind of an opcode (`all-gather-start` → all-gather); None for `-done` halves and the rest."""
  if opcode.endswith("-done"):
    return None
  base = opcode[:-len("-start")] if opcode.endswith("-start") else opcode
  return base if base in COLLECTIVES else None


def _group_size(attributes: str, num_devices: int) -> int:
  m = re.search(r"replica_groups=(\S+)(?:\s+(\{[^}]*\}))?", attributes)
  if not m:
    return num_devices
  groups, axes = m.group(1), m.group(2)
  if groups.startswith("mesh["):
    # replica_groups=mesh['axis_0'=1,'axis_1'=8] {'axis_1'}: the named axes form each group.
    sizes = dict(re.findall(r"'([^']+)'=(\d+)", groups))
    named = re.findall(r"'([^']+)'", axes or "")
    return math.prod(int(sizes[a]) for a in named if a in sizes) or num_devices
  if iota := re.match(r"\[([\d,]+)\]<=", groups):
    return int(iota.group(1).split(",")[-1])
  first = re.match(r"\{\{([\d,]*)\}", groups)
  if first and first.group(1):
    return len(first.group(1).split(","))
  return num_devices


def _moves_data(kind: str, attributes: str, group: int) -> bool:
  """False for a collective over groups of one device (XLA keeps them, e.g. an all-gather over a context axis of size
  1): it is a local copy, not communication."""
  if kind == "collective-permute":
    pairs = re.findall(r"\{(\d+),(\d+)\}", attributes.partition("source_target_pairs=")[2].split("}}")[0] + "}")
    return any(a != b for a, b in pairs) or not pairs
  return group > 1


def _sent_bytes(kind: str, operand_bytes: int, group: int) -> float:
  if kind == "all-gather":
    return operand_bytes * (group - 1)
  if kind == "all-reduce":
    return 2 * operand_bytes * (group - 1) / group
  if kind in ("reduce-scatter", "all-to-all", "ragged-all-to-all"):
    return operand_bytes * (group - 1) / group
  return operand_bytes  # collective-permute, collective-broadcast: one send per device


@dataclasses.dataclass
class Collectives:
  """The collectives of one compiled module."""
  module: str                                    # HloModule name (what profiler events carry as hlo_module)
  kinds: dict[str, tuple[str, bool]]             # instruction name → (kind, in the attention scope)
  bytes_attention: dict[str, float]              # kind → bytes sent per device per step, attention scope
  bytes_other: dict[str, float]                  # kind → the same, outside it
  executions: dict[str, int]                     # kind → executions per step (instructions × trip counts)
  unknown_trip_counts: int                       # collectives inside a loop of unknown trip count (counted once)

  def summary(self) -> dict:
    return {"bytes_attention": _nonzero(self.bytes_attention), "bytes_other": _nonzero(self.bytes_other),
            "executions": _nonzero(self.executions), "unknown_trip_counts": self.unknown_trip_counts}


def _nonzero(d: dict) -> dict:
  return {k: (int(v) if isinstance(v, float) else v) for k, v in d.items() if v}


def _executed(hlo_text: str):
  """(module name, [(instruction, how many times a step runs it, whether a loop of unknown trip count holds it)], the
  instructions by name), every computation's instructions included."""
  module = ""
  computations: list[tuple[str, bool, list[Instruction]]] = []
  by_name: dict[str, Instruction] = {}
  for line in hlo_text.splitlines():
    if line.startswith("HloModule "):
      module = line.split()[1].rstrip(",")
    elif (m := _COMPUTATION.match(line)) and line.rstrip().endswith("{"):
      computations.append((m.group(2), bool(m.group(1)), []))
    elif computations and (inst := _parse_instruction(line)):
      computations[-1][2].append(inst)
      by_name[inst.name] = inst
  bodies = {name: instructions for name, _, instructions in computations}
  # Callees are printed before their callers, so walking the text backwards visits every caller first.
  runs: dict[str, int] = {name: 1 for name, entry, _ in computations if entry}
  uncounted: dict[str, bool] = {}  # inside a loop whose trip count could not be read
  out = []
  for name, _, instructions in reversed(computations):
    n = runs.get(name, 0)
    for inst in instructions:
      trips = _trip_count(inst, bodies, by_name) if inst.opcode == "while" else 1
      for callees in _CALLEES.findall(inst.attributes):
        for callee in re.findall(r"%([\w.\-]+)", callees):
          runs[callee] = runs.get(callee, 0) + n * (1 if trips is None else trips)
          uncounted[callee] = uncounted.get(callee, False) or uncounted.get(name, False) or trips is None
      out.append((inst, n, uncounted.get(name, False)))
  return module, out, by_name


def collectives(hlo_text: str, num_devices: int) -> Collectives:
  """Every collective of `hlo_text` (one compiled module), with its bytes per step (see the module docstring)."""
  module, executed, by_name = _executed(hlo_text)
  kinds: dict[str, tuple[str, bool]] = {}
  sent = {True: dict.fromkeys(COLLECTIVES, 0.0), False: dict.fromkeys(COLLECTIVES, 0.0)}
  executions = dict.fromkeys(COLLECTIVES, 0)
  unknown = 0
  for inst, n, uncounted in executed:
    kind = _kind(inst.opcode)
    group = _group_size(inst.attributes, num_devices)
    if kind is None or not _moves_data(kind, inst.attributes, group):
      continue
    in_attention = ATTENTION_SCOPE in inst.attributes
    kinds[inst.name] = (kind, in_attention)
    operand_bytes = sum(shape_bytes(by_name[o].shape) for o in inst.operands if o in by_name)
    sent[in_attention][kind] += n * _sent_bytes(kind, operand_bytes, group)
    executions[kind] += n
    unknown += uncounted
  return Collectives(module, kinds, sent[True], sent[False], executions, unknown)


def _dims(shape: str) -> list[int]:
  found = _ARRAY.search(shape)
  return [int(d) for d in found.group(2).split(",") if d] if found else []


def dot_flops(hlo_text: str) -> float:
  """The FLOPs of every `dot` a step runs, 2 per multiply-add, loops' trip counts included (one device's program).
  Unlike the compiler's cost analysis, which counts a loop's body once, this is what the step executes; a dot inside
  a loop of unknown trip count counts once."""
  _, executed, by_name = _executed(hlo_text)
  total = 0.0
  for inst, n, _ in executed:
    if inst.opcode != "dot" or not inst.operands or inst.operands[0] not in by_name:
      continue
    lhs = _dims(by_name[inst.operands[0]].shape)
    contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", inst.attributes)
    k = math.prod(lhs[int(i)] for i in contracting.group(1).split(",") if i) if contracting else 1
    total += n * 2.0 * math.prod(_dims(inst.shape)) * k
  return total


def instruction_counts(hlo_text: str, scope: str | None = None) -> dict[str, int]:
  """How many instructions of each collective kind the HLO holds (a loop body's count once, groups of one device
  included); with `scope`, only those whose source op ran inside `jax.named_scope(scope)`."""
  counts = dict.fromkeys(COLLECTIVES, 0)
  for line in hlo_text.splitlines():
    inst = _parse_instruction(line)
    if inst and (kind := _kind(inst.opcode)) and (scope is None or scopes.marker(scope) in inst.attributes):
      counts[kind] += 1
  return counts


def num_partitions(hlo_text: str, default: int) -> int:
  m = re.search(r"num_partitions=(\d+)", hlo_text.split("\n", 1)[0])
  return int(m.group(1)) if m else default

