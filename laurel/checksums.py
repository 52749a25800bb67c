"""Content checksums of a checkpoint's files, so that a flipped byte is damage, not a silently different model.

Orbax, and tensorstore below it, checksum no array data: a corrupted byte in an array file is restored as it is.
After each save has finished, every host records the XXH3 hash and size of the files it wrote (its own
state/ocdbt.process_<i>/ shard files; process 0 also the rest of state/) in <step>/checksums.process_<i>.json;
before a restore, every host verifies its own list. A checkpoint saved before this module has no list and is taken
as it is. XXH3 over a memory map hashes at memory speed (9 GB/s here, where zlib's CRC-32 reads and hashes at
2 GB/s): scripts/experiments/benchmark_checksums.py measures it against the save.
"""

from concurrent import futures
import json
import mmap
import os
import zlib

import jax
import xxhash
from etils import epath

from laurel.files import write_text_atomic

ALGORITHM = 'xxh3_64'


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


def _is_remote(path) -> bool:
  return '://' in os.fspath(path)


def _size(path: epath.Path) -> int:
  return path.stat().length if _is_remote(path) else os.path.getsize(path)


def _mapped(path: epath.Path, hash_bytes) -> str:
  with open(path, 'rb') as f:
    if not os.fstat(f.fileno()).st_size:
      return f'{hash_bytes(b""):08x}'
    with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
      return f'{hash_bytes(data):08x}'


# A list written before XXH3 names no algorithm and holds CRC-32s as integers.
_HASHES = {ALGORITHM: lambda data: xxhash.xxh3_64(data).intdigest(), 'crc32': zlib.crc32}


def checksum(path: epath.Path, algorithm: str = ALGORITHM) -> str:
  if _is_remote(path):  # gs://: read it whole
    return f'{_HASHES[algorithm](path.read_bytes()):08x}'
  return _mapped(path, _HASHES[algorithm])


def record(step_dir) -> None:
  """Writes this host's checksums of a finished save in `step_dir`."""
  step_dir = epath.Path(step_dir)
  process, count = jax.process_index(), jax.process_count()
  paths = _own_files(step_dir, process, count)
  sizes = [_size(p) for p in paths]
  if sum(sizes) < 2**26:
    hashes = [checksum(p) for p in paths]
  else:
    with futures.ThreadPoolExecutor(min(4, os.cpu_count() or 1)) as pool:  # XXH3 hashes without the GIL
      hashes = list(pool.map(checksum, paths))
  files = {os.fspath(p.relative_to(step_dir)): [h, n] for p, h, n in zip(paths, hashes, sizes)}
  listing = {'algorithm': ALGORITHM, 'files': files}
  write_text_atomic(step_dir / _name(process), json.dumps(listing, indent=0, sort_keys=True) + '\n')


def mismatch(step_dir) -> str | None:
  """Why this host's files in `step_dir` differ from its recorded checksums, as a phrase; None where they match
  or none were recorded."""
  step_dir = epath.Path(step_dir)
  listing_path = step_dir / _name(jax.process_index())
  if not listing_path.exists():
    return None
  try:
    listing = json.loads(listing_path.read_text())
  except json.JSONDecodeError:
    return f'{listing_path.name} is not JSON'
  algorithm = listing.get('algorithm', 'crc32')
  files = listing['files'] if 'algorithm' in listing else {k: [f'{v:08x}', n] for k, (v, n) in listing.items()}
  for name, (saved, size) in files.items():
    path = step_dir / name
    if not path.exists():
      return f'{name} is missing'
    if (now_size := _size(path)) != size:
      return f'{name} has {now_size} bytes, {size} when saved'
    if (now := checksum(path, algorithm)) != saved:
      return f'{name}: content checksum mismatch ({algorithm} {now}, {saved} when saved)'
  return None
