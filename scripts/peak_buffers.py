"""What is live at the peak of a compiled step, or (--bytes) where its bytes accessed go, read from an XLA dump.

  XLA_FLAGS="--xla_dump_to=DUMP --xla_dump_hlo_as_text --xla_dump_hlo_module_re=jit_train_step" \\
    python -m laurel.main --config=configs/c4_ablation.py:baseline_24 --compile_only --topology=v6e:4x4 \\
    --config.data.name=synthetic
  python scripts/peak_buffers.py --dump=DUMP

The TPU compiler packs every temporary into one allocation (its size is the highest offset a buffer reaches). This
finds the instruction where the most bytes are live at once and lists those buffers, grouped by shape and the jax
operation that made them (the saved stacks of a scanned layer have the layer count as their leading dimension).

--bytes instead sums, over the optimized program, what each instruction reads and writes (a fusion's operands and
result; of an operand that it only slices, the slices; nothing for the buffer it updates in place), times its loops'
trip counts, and groups the sums by the jax operation's name, forward and backward apart. Tiling padding is not
counted, so the total is near the compiler's `bytes accessed`, not equal to it: compare groups and designs.
"""

import collections
import glob
import math
import re

from absl import app, flags

_DUMP = flags.DEFINE_string('dump', None, 'The --xla_dump_to directory.', required=True)
_MODULE = flags.DEFINE_string('module', 'jit_train_step', 'The dumped module to read.')
_TOP = flags.DEFINE_integer('top', 20, 'Groups of buffers to list.')
_BYTES = flags.DEFINE_bool('bytes', False, "List the bytes accessed by operation instead of the peak's buffers.")
_DEPTH = flags.DEFINE_integer('depth', 3, 'With --bytes: group by the first DEPTH names of the operation.')
_DROP = flags.DEFINE_string('drop', r'laurel|\w+_(attn|mlp|block)', 'With --bytes: scope names left out of the '
                            "groups (the sites a design wraps its sublayers in), so that two designs' groups compare.")
_BASE = flags.DEFINE_string('base', None, "With --bytes: another dump (Baseline-24's) whose bytes each group is "
                            'compared with; groups by the bytes they add.')


def read(suffix, dump=None, flag='--dump'):
  dump = dump or _DUMP.value
  paths = glob.glob(f'{dump}/*{_MODULE.value}*.{suffix}')
  if not paths:
    raise app.UsageError(f'{flag}={dump}: no *{_MODULE.value}*.{suffix} (dumped with --xla_dump_hlo_as_text?)')
  return open(sorted(paths)[-1]).read().splitlines()


def _covered(values) -> int:
  """Bytes of the allocation the values occupy; aliases of one buffer (same offsets) count once."""
  total, end = 0, 0
  for start, stop in sorted((offset, offset + n) for _, n, offset, _, _ in values):
    total += max(0, stop - max(start, end))
    end = max(end, stop)
  return total


def main(_):
  if _BYTES.value:
    return print_bytes()
  allocations = []  # (size, kind, [(value, size, offset, shape)])
  for line in read('after_optimizations-buffer-assignment.txt'):
    if m := re.match(r'allocation \d+: size (\d+), (.*):$', line):
      allocations.append((int(m[1]), m[2], []))
    elif allocations and (m := re.match(r' value: <\d+ (\S+)(?: \(phi\))? @\d+> \(size=(\d+),offset=(\d+)\): (\S+)',
                                        line)):
      allocations[-1][2].append((m[1], int(m[2]), int(m[3]), m[4].split('{')[0]))
  ranges, sequence, section = {}, [], None
  for line in read('after_optimizations-live-range.txt'):
    if not line.startswith('    '):
      section = line.strip()
    elif section == 'InstructionSequence:' and (m := re.match(r'\s+\d+:(\S+)', line)):
      sequence.append(m[1])
    elif section == 'BufferLiveRange:' and (m := re.match(r'\s+(\S+):(\d+)-(\d+)', line)):
      ranges[m[1].removesuffix('{}')] = (int(m[2]), int(m[3]))
  ops = {m[1]: m[2].removeprefix('jit(train_step)/') for line in read('after_optimizations.txt')
         if (m := re.match(r'\s*(?:ROOT )?%(\S+) = .*?op_name="([^"]+)"', line))}

  size, _, values = max((a for a in allocations if 'preallocated-temp' in a[1]), key=lambda a: a[0])
  values = [(name, n, offset, shape, ranges[name]) for name, n, offset, shape in values if name in ranges]
  live_at = lambda t: [v for v in values if v[4][0] <= t <= v[4][1]]
  used, t = max((_covered(live_at(t)), t) for t in range(len(sequence)))
  params = sum(a[0] for a in allocations if 'parameter' in a[1])
  print(f'parameters {params / 1e9:.3f} GB; temporaries {size / 1e9:.3f} GB as packed, of which at most '
        f'{used / 1e9:.3f} GB are live at once, at instruction {t} ({sequence[t]}: {ops.get(sequence[t], "")}):')
  groups, seen = collections.defaultdict(lambda: [0, 0]), set()
  for name, n, offset, shape, _ in live_at(t):
    if (offset, n) in seen:  # an alias (a loop's carry and its body's update share one buffer)
      continue
    seen.add((offset, n))
    group = groups[shape, ops.get(name.split('{')[0], name)]
    group[0] += n
    group[1] += 1
  for (shape, op), (n, count) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:_TOP.value]:
    print(f'{n / 1e9:8.3f} GB {count:3d} x {shape:28s} {op}')


DTYPE_BYTES = {'pred': 1, 's8': 1, 'u8': 1, 'f8e4m3fn': 1, 'f8e5m2': 1, 's16': 2, 'u16': 2, 'bf16': 2, 'f16': 2,
               's32': 4, 'u32': 4, 'f32': 4, 's64': 8, 'u64': 8, 'f64': 8, 'c64': 8, 'c128': 16}
CALLS = ('while', 'call', 'conditional', 'async-start')  # what runs the computations they name
NO_TRAFFIC = {*CALLS, 'parameter', 'constant', 'get-tuple-element', 'tuple', 'bitcast', 'async-update', 'async-done',
              'after-all', 'partition-id', 'replica-id', 'opt-barrier', 'copy-done', 'all-reduce-done',
              'all-gather-done', 'collective-permute-done'}
SLICES = {'dynamic-slice', 'slice', 'gather'}
GENERIC = {'LM', 'Block', 'while', 'body', 'cond', 'closed_call'}  # scopes every layer's operations share


def shape_bytes(shape: str) -> int:
  return sum(DTYPE_BYTES[t] * math.prod(int(d) for d in dims.split(',') if d)
             for t, dims in re.findall(r'\b([a-z]+\d*[a-z0-9]*)\[([\d,]*)\]', shape) if t in DTYPE_BYTES)


def parse_program(lines):
  """{computation: {instruction: (result bytes, opcode, [operands], line)}}, the entry's name."""
  programs, entry, current = {}, None, None
  for line in lines:
    if m := re.match(r'(ENTRY )?%(\S+) \(', line):
      current = programs.setdefault(m[2], {})
      entry = m[2] if m[1] else entry
    elif current is not None and (m := re.match(r'\s+(?:ROOT )?%(\S+) = (.+?) ([a-z][a-z0-9-]*)\(([^)]*)\)', line)):
      current[m[1]] = (shape_bytes(m[2]), m[3], re.findall(r'%([^\s,]+)', m[4]), line)
  return programs, entry


def fusion_bytes(programs, computation, fusion) -> int:
  """A fusion's traffic: each operand's bytes, or only those of its slices, or none where it is a buffer the
  fusion updates in place (a dynamic-update-slice at its root), whose update is then what it writes."""
  _, _, operands, line = computation[fusion]
  body = programs[re.search(r'calls=%(\S+?),', line + ',')[1]]
  params = {int(re.search(r'parameter\((\d+)\)', ln)[1]): name for name, (_, op, _, ln) in body.items()
            if op == 'parameter'}
  root = next(v for v in body.values() if v[3].lstrip().startswith('ROOT'))
  outputs = [body[name] for name in root[2]] if root[1] == 'tuple' else [root]
  in_place = {out[2][0] for out in outputs if out[1] == 'dynamic-update-slice'}
  total = sum(body[out[2][1]][0] if out[1] == 'dynamic-update-slice' else out[0] for out in outputs)
  for k, operand in enumerate(operands):
    param = params.get(k)
    users = [v for v in body.values() if param in v[2]]
    if param in in_place:
      continue
    if users and all(op in SLICES and ops[0] == param for _, op, ops, _ in users):
      total += sum(n for n, *_ in users)
    else:
      total += computation[operand][0] if operand in computation else 0
  return total


def bytes_by_operation(lines) -> collections.Counter:
  """{(forward or backward, the operation's first --depth names): bytes accessed}."""
  programs, entry = parse_program(lines)
  times = collections.Counter({entry: 1})
  order = [entry]
  for name in order:  # callers before callees: a loop's body runs its trip count times its caller's count
    for _, op, _, line in programs[name].values():
      for callee in re.findall(r'(?:body|condition|to_apply|calls|branch_computations)=\{?%([^\s,}]+)', line):
        if callee not in programs or op not in CALLS:
          continue
        trips = 1
        if op == 'while':
          condition = programs[re.search(r'condition=%([^\s,]+)', line)[1]]
          trips = max([int(c) for *_, ln in condition.values() for c in re.findall(r' constant\((\d+)\)', ln)] or [1])
        times[callee] += times[name] * trips
        order.append(callee)
  groups = collections.Counter()
  for name in order:
    computation = programs[name]
    for instruction, (result, op, operands, line) in computation.items():
      if op in NO_TRAFFIC:
        continue
      if op == 'fusion':
        n = fusion_bytes(programs, computation, instruction)
      elif op == 'dynamic-update-slice':
        n = 2 * computation[operands[1]][0]
      elif op in SLICES:
        n = 2 * result
      elif op == 'copy-start':  # its result holds the source, the copy and a context
        n = 2 * computation[operands[0]][0]
      else:
        n = result + sum(computation[o][0] for o in operands if o in computation)
      m = re.search(r'op_name="([^"]+)"', line)
      path = m[1].removeprefix('jit(train_step)/') if m else op
      direction = 'backward' if 'transpose(' in path else 'forward'
      while (unwrapped := re.sub(r'\w+\(([\w.]*)\)', r'\1', path)) != path:  # jvp(LM), transpose(jvp(Block))
        path = unwrapped
      names = [p for p in path.split('/') if p and p not in GENERIC and not p.startswith('layers')
               and not re.fullmatch(_DROP.value, p)]
      groups[direction, '/'.join(names[:_DEPTH.value])] += n * times[name]
  return groups


def print_bytes():
  groups = bytes_by_operation(read('after_optimizations.txt'))
  total = sum(groups.values())
  print(f'{total / 1e9:.4g} GB accessed in all (tiling padding not counted)')
  if _BASE.value is None:
    for (direction, group), n in groups.most_common(_TOP.value):
      print(f'{n / 1e9:9.4g} GB {100 * n / total:5.1f}% {direction:8s} {group}')
    return
  base = bytes_by_operation(read('after_optimizations.txt', _BASE.value, '--base'))
  print(f'{sum(base.values()) / 1e9:.4g} GB in --base; GB here, in --base, added:')
  added = collections.Counter({k: groups[k] - base[k] for k in groups.keys() | base.keys()})
  for (direction, group), n in added.most_common(_TOP.value):
    print(f'{groups[direction, group] / 1e9:9.4g} {base[direction, group] / 1e9:9.4g} {n / 1e9:+9.4g} '
          f'{direction:8s} {group}')


if __name__ == '__main__':
  app.run(main)
