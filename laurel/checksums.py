"""Content checksums of a checkpoint's files, so that a flipped byte is damage, not a silently different model.

Orbax, and tensorstore below it, checksum no array data: a corrupted byte in an array file is restored as it is.
After each save has finished, every host records the CRC-32 and size of the files it wrote (its own
state/ocdbt.process_<i>/ shard files; process 0 also the rest of state/) in <step>/checksums.process_<i>.json;
before a restore, every host verifies its own list. A checkpoint saved before this module has no list and is taken
as it is.
"""

import json
import os
import zlib

import jax
from etils import epath

from laurel.files import write_text_atomic

CHUNK_BYTES = 16 * 2**20


def _name(process: int) -> str:
  return f'checksums.process_{process}.json'


def _own_files(step_dir: epath.Path, process: int, process_count: int) -> list[epath.Path]:
  """The files of step_dir/state that `process` wrote."""
  state = step_dir / 'state'
  if process:
    return _files_under(state / f'ocdbt.process_{process}')
  others = tuple(f'ocdbt.process_{i}' for i in range(1, process_count))
  return [p for p in _files_under(state) if p.relative_to(state).parts[0] not in others]


def _files_under(folder: epath.Path) -> list[epath.Path]:
  return sorted(root / name for root, _, names in folder.walk() for name in names)


def crc32(path: epath.Path) -> int:
  value = 0
  with path.open('rb') as f:
    while chunk := f.read(CHUNK_BYTES):
      value = zlib.crc32(chunk, value)
  return value


def record(step_dir) -> None:
  """Writes this host's checksums of a finished save in `step_dir`."""
  step_dir = epath.Path(step_dir)
  process, count = jax.process_index(), jax.process_count()
  sums = {os.fspath(p.relative_to(step_dir)): [crc32(p), p.stat().length]
          for p in _own_files(step_dir, process, count)}
  write_text_atomic(step_dir / _name(process), json.dumps(sums, indent=0, sort_keys=True) + '\n')


def mismatch(step_dir) -> str | None:
  """Why this host's files in `step_dir` differ from its recorded checksums, as a phrase; None where they match
  or none were recorded."""
  step_dir = epath.Path(step_dir)
  listing = step_dir / _name(jax.process_index())
  if not listing.exists():
    return None
  try:
    sums = json.loads(listing.read_text())
  except json.JSONDecodeError:
    return f'{listing.name} is not JSON'
  for name, (checksum, size) in sums.items():
    path = step_dir / name
    if not path.exists():
      return f'{name} is missing'
    if path.stat().length != size:
      return f'{name} has {path.stat().length} bytes, {size} when saved'
    if crc32(path) != checksum:
      return f'{name}: content checksum mismatch (CRC-32 {crc32(path):08x}, {checksum:08x} when saved)'
  return None
