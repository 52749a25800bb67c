"""Writing run files so that a kill or a crash mid-write never leaves a torn or half-written file behind.

A local file is written to a temporary file in the same folder, flushed to disk, then renamed over the old one:
a reader sees the old content or the new, never part of either. A path behind '://' (gs:// through etils.epath)
is written whole by one upload, which the object store already makes atomic.
"""
import os
import tempfile

from etils import epath


def is_remote(path) -> bool:
  return '://' in os.fspath(path)


def write_text_atomic(path, text: str) -> None:
  """Replaces `path` by `text` (UTF-8) atomically (see the module docstring)."""
  write_bytes_atomic(path, text.encode())


def write_bytes_atomic(path, data: bytes) -> None:
  """Replaces `path` by `data` atomically (see the module docstring)."""
  path = epath.Path(path)
  if is_remote(path):
    path.write_bytes(data)
    return
  path = os.fspath(path)
  folder = os.path.dirname(path) or '.'
  fd, tmp = tempfile.mkstemp(prefix=f'.{os.path.basename(path)}.', suffix='.tmp', dir=folder)
  try:
    with os.fdopen(fd, 'wb') as f:
      f.write(data)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.unlink(tmp)
    raise
  _fsync_folder(folder)


def _fsync_folder(folder: str) -> None:
  """The rename itself reaches the disk only once the folder's entry does (POSIX); best effort elsewhere."""
  try:
    fd = os.open(folder, os.O_RDONLY)
  except OSError:
    return
  try:
    os.fsync(fd)
  except OSError:
    pass
  finally:
    os.close(fd)
