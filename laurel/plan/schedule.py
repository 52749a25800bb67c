"""The TPU compiler's own schedule estimate of a compiled program, per chip: every instruction's `estimated_cycles`
(its backend config), a loop's body counted as many times as the loop runs.

What the compiler does not estimate is counted apart and said: a Pallas kernel carries no cycles, only the
pl.CostEstimate its author gave (counted at the compiler's own rate for a large matmul and at the chip's HBM
bandwidth); a kernel without one counts by FLOPs its caller states (`kernel_flops`: the attention's), else not at
all; collectives carry no estimate (their bytes are listed).
"""

import dataclasses
import json
import re

# Where an instruction's time goes, by the module path in its op_name (the first group that matches; a fusion is
# named by one of the operations it fuses). A scope that opens a transformation's trace reads 'jvp(loss)/...'.
GROUPS = (
    ('loss', r'[/(]loss[/)]|cross_entropy'),
    ('optimizer', r'/optimizer/'),
    ('embedding', r'/lookup/'),
    ('norms', r'norm[^/]*/'),
    ('matmuls', r'/attn/(query|key|value|out)/|/mlp/|/share/'),
    ('attention', r'/attn/|flash|splash'),
    ('residual stream', r'/layers(_\d+)?/[^/]+/'),  # the design's sites: all but their sublayers, matched above
    ('matmuls', r'dot_general|conv_general_dilated'),
    ('layer stacks', r'dynamic_update_index_in_dim|dynamic_index_in_dim'),  # a scan's saved activations
)
COLLECTIVES = ('all-reduce', 'all-gather', 'reduce-scatter', 'all-to-all', 'collective-permute')
_INSTRUCTION = re.compile(r'\s*(?:ROOT )?%(\S+) = (.*?) ([a-z][a-z0-9-]*)\(')
_SHAPE = re.compile(r'(pred|[subf]\d+|bf16)\[([\d,]*)\]')
_BYTES = {'pred': 1, 'bf16': 2}


@dataclasses.dataclass(frozen=True)
class Op:
  """One instruction as the program runs it: `trips` times per step, each `cycles` (None: no estimate)."""
  name: str
  opcode: str
  cycles: int | None
  trips: int
  op_name: str
  kernel_flops: int | None = None  # a Pallas kernel's pl.CostEstimate
  kernel_bytes: int | None = None
  result_bytes: int = 0
  target: str = ''  # a custom call's

  @property
  def group(self) -> str:
    return next((g for g, pattern in GROUPS if re.search(pattern, self.op_name)), 'other')


def computations(text: str) -> tuple[str, dict[str, list[str]]]:
  """(the entry computation's name, {computation: its instructions}) of `compiled.as_text()`. An instruction's
  backend config may run over several lines (a kernel's metadata): they join the instruction."""
  comps, current, entry = {}, None, None
  for line in text.splitlines():
    if current is None:
      if (m := re.match(r'(ENTRY )?%(\S+) ', line)) and line.rstrip().endswith('{'):
        current, comps[m.group(2)] = m.group(2), []
        entry = m.group(2) if m.group(1) else entry
    elif line == '}':
      current = None
    elif re.match(r'\s+(ROOT )?%', line) or not comps[current]:
      comps[current].append(line)
    elif line.strip():
      comps[current][-1] += '\n' + line
  if entry is None:
    raise ValueError('no ENTRY computation: not the text of a compiled XLA program')
  return entry, comps


def _trip_count(instruction: str, comps: dict, caller: list[str]) -> int | None:
  """A while loop's trip count: the compiler's known_trip_count, else its condition `i < N` (or `<=`) with i's start
  where the loop's initial tuple sets it to a constant (0 where it cannot be read)."""
  if m := re.search(r'"known_trip_count":\{"n":"(\d+)"', instruction):
    return int(m.group(1))
  cond = comps[re.search(r'condition=%([^,\s]+)', instruction).group(1)]
  root = next((line for line in cond if line.lstrip().startswith('ROOT')), '')
  direction = re.search(r'direction=(LT|LE|GT|GE)', root)
  constants = {m.group(1): int(m.group(2)) for line in cond
               if (m := re.match(r'\s*%(\S+) = s32\[\]\S* constant\((-?\d+)\)', line))}
  operands = re.findall(r'%([^,\s)]+)', root.split('compare(', 1)[-1].split(')', 1)[0])
  if not direction or len(operands) != 2 or not any(o in constants for o in operands):
    return None
  bound_first = operands[0] in constants
  bound = constants[operands[0] if bound_first else operands[1]]
  op = {'LT': 'GT', 'LE': 'GE', 'GT': 'LT', 'GE': 'LE'}[direction.group(1)] if bound_first else direction.group(1)
  start = _loop_start(instruction, caller)
  if op in ('LT', 'LE'):
    return max(0, bound - start + (op == 'LE'))
  return None  # counting down: no loop of ours does


def _loop_start(instruction: str, caller: list[str]) -> int:
  """The constant a while loop's counter (tuple element 0) starts from, else 0."""
  init = re.search(r' while\(%([^,\s)]+)\)', instruction)
  tuple_line = next((line for line in caller if init and re.match(rf'\s*(ROOT )?%{re.escape(init.group(1))} = ',
                                                                   line)), '')
  first = re.search(r' tuple\(%([^,\s)]+)', tuple_line)
  constant = next((line for line in caller if first and re.match(rf'\s*%{re.escape(first.group(1))} = ', line)), '')
  value = re.search(r' constant\((-?\d+)\)', constant)
  return int(value.group(1)) if value else 0


def _result_bytes(result_type: str) -> int:
  """Bytes of an instruction's result type (a tuple: all of its shapes)."""
  total = 0
  for dtype, dims in _SHAPE.findall(result_type):
    size = _BYTES.get(dtype) or int(re.sub(r'\D', '', dtype)) // 8 or 1
    for d in filter(None, dims.split(',')):
      size *= int(d)
    total += size
  return total


def executed_ops(text: str) -> tuple[list[Op], list[str]]:
  """(every instruction the program runs, with its trips per run; the loops whose trip count could not be read,
  counted once)."""
  entry, comps = computations(text)
  unknown = []

  def ops_of(name: str, trips: int) -> list[Op]:
    ops, lines = [], comps[name]
    for line in lines:
      if not (m := _INSTRUCTION.match(line)):
        continue
      opcode = m.group(3)
      cycles = re.search(r'"estimated_cycles":"(\d+)"', line)
      op_name = re.search(r'op_name="([^"]*)"', line)
      target = re.search(r'custom_call_target="([^"]+)"', line)
      estimate = re.search(r'"cost_estimate":\{"flops":"(\d+)","transcendentals":"\d+","bytes_accessed":"(\d+)"',
                           line)
      ops.append(Op(m.group(1), opcode, int(cycles.group(1)) if cycles else None, trips,
                    op_name.group(1) if op_name else '', int(estimate.group(1)) if estimate else None,
                    int(estimate.group(2)) if estimate else None, _result_bytes(m.group(2)),
                    target.group(1) if target else ''))
      if opcode == 'while':
        n = _trip_count(line, comps, lines)
        if n is None:
          unknown.append(m.group(1))
        ops += ops_of(re.search(r'body=%([^,\s]+)', line).group(1), trips * (1 if n is None else n))
      elif opcode == 'conditional':  # the most expensive branch
        branches = re.search(r'branch_computations=\{([^}]*)\}', line)
        runs = [ops_of(b, trips) for b in re.findall(r'%([^,\s]+)', branches.group(1) if branches else '')]
        ops += max(runs, key=lambda run: sum((o.cycles or 0) * o.trips for o in run), default=[])
      elif opcode in ('call', 'async-start'):
        for callee in re.findall(r'(?:to_apply|calls)=%([^,\s}]+)', line):
          ops += ops_of(callee, trips)
    return ops

  return ops_of(entry, 1), unknown


@dataclasses.dataclass(frozen=True)
class Estimate:
  """A program's estimated cycles per chip and what they leave out."""
  cycles: float  # the compiler's + the kernels'
  compiler_cycles: int  # the compiler's own estimate, alone
  kernel_cycles: float  # the Pallas kernels', from their cost estimates or `kernel_flops`
  groups: dict  # {group: cycles}, largest first
  uncounted_kernels: int  # kernel calls per step with no estimate and no stated FLOPs
  collective_bytes: int  # results of collectives per step (no estimate)
  unknown_loops: tuple
  top: tuple  # (cycles, op_name, trips) of the most expensive instructions


def estimate(text: str, flops_per_cycle: float, bytes_per_cycle: float, kernel_flops: float = 0.0,
             kernel_group: str = 'attention') -> Estimate:
  """The estimate of `compiled.as_text()`. A kernel with a pl.CostEstimate costs max(its FLOPs / flops_per_cycle,
  its bytes / bytes_per_cycle); `kernel_flops` (per step) stands for the kernels without one, at flops_per_cycle,
  in `kernel_group`."""
  ops, unknown = executed_ops(text)
  groups, kernels, uncounted, estimated, collective = {}, 0.0, 0, 0, 0
  costed = []
  for op in ops:
    cycles = (op.cycles or 0) * op.trips
    estimated += cycles
    if op.kernel_flops is not None:
      cycles = max(op.kernel_flops / flops_per_cycle, op.kernel_bytes / bytes_per_cycle) * op.trips
      kernels += cycles
    elif op.target == 'tpu_custom_call':
      uncounted += op.trips
    if any(op.opcode.startswith(c) for c in COLLECTIVES) and not op.opcode.endswith('-done'):
      collective += op.result_bytes * op.trips
    if cycles:
      groups[op.group] = groups.get(op.group, 0) + cycles
      costed.append((cycles, op.op_name or op.name, op.trips))
  if uncounted and kernel_flops:
    stated = kernel_flops / flops_per_cycle
    groups[kernel_group] = groups.get(kernel_group, 0) + stated
    kernels, uncounted = kernels + stated, 0
  total = sum(groups.values())
  return Estimate(total, estimated, kernels, dict(sorted(groups.items(), key=lambda kv: -kv[1])), uncounted,
                  collective, tuple(unknown), tuple(sorted(costed, reverse=True)[:20]))


def group_shares(groups: dict, top: int = 6) -> str:
  """'matmuls 50%, attention 12%, ...' of the largest `groups` ({group: cycles}, largest first)."""
  total = sum(groups.values())
  return ', '.join(f'{g} {100 * c / total:.0f}%' for g, c in list(groups.items())[:top])


def as_dict(est: Estimate) -> dict:
  return json.loads(json.dumps(dataclasses.asdict(est)))
