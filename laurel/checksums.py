"""Content checksums of a checkpoint's files (orbax checksums no array data): after a save each host records the XXH3
hash and size of the files it wrote in <step>/checksums.process_<i>.json, and checks them before a restore."""

from concurrent import futures
import functools
import json
import mmap
import os
import zlib

import jax
import xxhash
from etils import epath

from laurel.files import is_remote, write_text_atomic

ALGORITHM = 'xxh3_64'
LISTING = 'checksums.process_{}.json'  # this host's list, by process index
CHUNK = 2**24  # a gs:// file is hashed as it streams, 16 MiB at a time


def _own_files(step_dir: epath.Path, process: int, process_count: int) -> list[epath.Path]:
  """The files of step_dir/state that `process` wrote: its ocdbt.process_<i> shards; process 0 the rest."""
  state = step_dir / 'state'
  if process:
    return sorted(root / name for root, _, names in (state / f'ocdbt.process_{process}').walk() for name in names)
  others = tuple(f'ocdbt.process_{i}' for i in range(1, process_count))
  return sorted(root / name for root, _, names in state.walk() for name in names
                if (root / name).relative_to(state).parts[0] not in others)


def _size(path: epath.Path) -> int:
  return path.stat().length if is_remote(path) else os.path.getsize(path)


def _hash(chunks, algorithm: str) -> int:
  """The hash of the bytes of `chunks` in order. 'crc32': lists written before XXH3 (they name no algorithm)."""
  if algorithm == 'crc32':
    return functools.reduce(lambda value, chunk: zlib.crc32(chunk, value), chunks, 0)
  hasher = xxhash.xxh3_64()
  for chunk in chunks:
    hasher.update(chunk)  # XXH3 hashes without the GIL
  return hasher.intdigest()


def checksum(path: epath.Path, algorithm: str = ALGORITHM) -> str:
  if is_remote(path):  # gs://: streamed, not held whole
    with path.open('rb') as f:
      return f'{_hash(iter(lambda: f.read(CHUNK), b""), algorithm):08x}'
  with open(path, 'rb') as f:
    if not os.fstat(f.fileno()).st_size:  # no memory map of an empty file
      return f'{_hash([], algorithm):08x}'
    with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
      return f'{_hash([data], algorithm):08x}'


def record(step_dir) -> None:
  """Writes this host's checksums of a finished save in `step_dir`."""
  step_dir = epath.Path(step_dir)
  paths = _own_files(step_dir, jax.process_index(), jax.process_count())
  sizes = [_size(p) for p in paths]
  threads = min(4, os.cpu_count() or 1) if sum(sizes) >= 2**26 else 1  # XXH3 hashes without the GIL
  with futures.ThreadPoolExecutor(threads) as pool:
    hashes = list(pool.map(checksum, paths))
  files = {os.fspath(p.relative_to(step_dir)): [h, n] for p, h, n in zip(paths, hashes, sizes)}
  write_text_atomic(step_dir / LISTING.format(jax.process_index()),
                    json.dumps({'algorithm': ALGORITHM, 'files': files}, indent=0, sort_keys=True) + '\n')


def mismatch(step_dir) -> str | None:
  """Why this host's files in `step_dir` differ from its checksums, as a phrase; None if they match or none exist."""
  listing_path = epath.Path(step_dir) / LISTING.format(jax.process_index())
  if not listing_path.exists():
    return None
  try:
    listing = json.loads(listing_path.read_text())
  except json.JSONDecodeError:
    return f'{listing_path.name} is not JSON'
  algorithm = listing.get('algorithm', 'crc32')
  files = listing['files'] if 'algorithm' in listing else {k: [f'{v:08x}', n] for k, (v, n) in listing.items()}
  for name, (saved, size) in files.items():
    path = listing_path.parent / name
    if not path.exists():
      return f'{name} is missing'
    if (now_size := _size(path)) != size:
      return f'{name} has {now_size} bytes, {size} when saved'
    if (now := checksum(path, algorithm)) != saved:
      return f'{name}: content checksum mismatch ({algorithm} {now}, {saved} when saved)'
  return None
