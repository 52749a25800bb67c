"""What is live at the peak of a compiled step, read from an XLA dump of it (buffer assignment and live ranges).

  XLA_FLAGS="--xla_dump_to=DUMP --xla_dump_hlo_as_text --xla_dump_hlo_module_re=jit_train_step" \\
    python -m laurel.main --config=configs/c4_ablation.py:baseline_24 --compile_only --topology=v6e:4x4 \\
    --config.data.name=synthetic
  python scripts/experiments/peak_buffers.py --dump=DUMP

The TPU compiler packs every temporary into one allocation (its size is the highest offset a buffer reaches). This
finds the instruction where the most bytes are live at once and lists those buffers, grouped by shape and the jax
operation that made them (the saved stacks of a scanned layer have the layer count as their leading dimension).
"""

import collections
import glob
import re

from absl import app, flags

_DUMP = flags.DEFINE_string('dump', None, 'The --xla_dump_to directory.', required=True)
_MODULE = flags.DEFINE_string('module', 'jit_train_step', 'The dumped module to read.')
_TOP = flags.DEFINE_integer('top', 20, 'Groups of buffers to list.')


def read(suffix):
  paths = glob.glob(f'{_DUMP.value}/*{_MODULE.value}*.{suffix}')
  if not paths:
    raise app.UsageError(f'--dump={_DUMP.value}: no *{_MODULE.value}*.{suffix} (dumped with --xla_dump_hlo_as_text?)')
  return open(sorted(paths)[-1]).read().splitlines()


def _covered(values) -> int:
  """Bytes of the allocation the values occupy; aliases of one buffer (same offsets) count once."""
  total, end = 0, 0
  for start, stop in sorted((offset, offset + n) for _, n, offset, _, _ in values):
    total += max(0, stop - max(start, end))
    end = max(end, stop)
  return total


def main(_):
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


if __name__ == '__main__':
  app.run(main)
