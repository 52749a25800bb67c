"""Content checksums of a checkpoint's files (orbax checksums no array data): as soon as a save completes each host
records the XXH3 hash and size of the files it wrote in <step>/checksums.process_<i>.json, and checks them before a
restore."""

from concurrent import futures
import functools
import json
import mmap
import os
import re
import zlib

import jax
import xxhash
from etils import epath

from laurel.config_lib import io_error_reason
from laurel.run.files import is_remote, remove_temporaries, write_text_atomic

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


def _read_listing(path: epath.Path) -> tuple[str, dict]:
  """(algorithm, {file name: [hash, size]}) of the checksum list at `path`; a ValueError, its message a phrase, where
  it cannot be read or is no checksum list."""
  try:
    listing = json.loads(path.read_bytes())  # random bytes: a UnicodeDecodeError, a ValueError as JSON's errors
  except (IsADirectoryError, ValueError) as e:  # another OSError (permissions, storage) is raised: it moves nothing
    raise ValueError(f'{path.name} is unreadable ({io_error_reason(e)})') from None
  if not isinstance(listing, dict):
    raise ValueError(f'{path.name} is no checksum list (a JSON {type(listing).__name__})')
  legacy = 'algorithm' not in listing  # written before XXH3: {name: [crc32, size]}
  algorithm, files = ('crc32', listing) if legacy else (listing['algorithm'], listing.get('files'))
  if algorithm not in (ALGORITHM, 'crc32'):
    raise ValueError(f'{path.name} is no checksum list (algorithm {algorithm!r})')
  if not isinstance(files, dict) or not files:
    raise ValueError(f'{path.name} is no checksum list (it lists no files)')
  for name, entry in files.items():
    if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], int if legacy else str)
            and isinstance(entry[1], int)):
      raise ValueError(f'{path.name} is no checksum list (its entry of {name} is {entry!r})')
  return algorithm, {k: [f'{v:08x}', n] for k, (v, n) in files.items()} if legacy else files


def verify(step_dir) -> tuple[str, str | None]:
  """This host's word on its files in `step_dir`: ('verified', None) where they match its checksum list, ('none',
  None) where it has no list, ('unreadable', why) where its list cannot be read or is none, ('mismatch', why) where
  a file is missing or differs."""
  listing_path = epath.Path(step_dir) / LISTING.format(jax.process_index())
  if not listing_path.exists():
    return 'none', None
  try:
    algorithm, files = _read_listing(listing_path)
  except ValueError as e:
    return 'unreadable', str(e)
  for name, (saved, size) in files.items():
    path = listing_path.parent / name
    if not path.exists():
      return 'mismatch', f'{name} is missing'
    if (now_size := _size(path)) != size:
      return 'mismatch', f'{name} has {now_size} bytes, {size} when saved'
    if (now := checksum(path, algorithm)) != saved:
      return 'mismatch', f'{name}: content checksum mismatch ({algorithm} {now}, {saved} when saved)'
  return 'verified', None


def remove_list_temporaries(checkpoints) -> list[str]:
  """Removes the temporaries of checksum lists whose writes a kill cut short, in every checkpoint under `checkpoints`
  (for the lease holder: no other run writes there). Returns their names."""
  removed = []
  for step_dir in epath.Path(checkpoints).glob('*'):
    if is_remote(step_dir) or not step_dir.is_dir():
      continue
    temporaries = (re.fullmatch(r'\.(checksums\.process_\d+\.json)\..*\.tmp', name) for name in os.listdir(step_dir))
    removed += remove_temporaries(step_dir, {found[1] for found in temporaries if found})
  return removed
