"""Writes that a kill never leaves torn: a local file goes to a temporary file beside it, flushed, then renamed over
the old one; a path behind '://' (gs://) is one upload, which the object store makes atomic."""
import contextlib
import datetime
import os
import tempfile
import time

from etils import epath


def is_remote(path) -> bool:
  return '://' in os.fspath(path)


def write_text_atomic(path, text: str) -> None:
  write_bytes_atomic(path, text.encode())


def write_bytes_atomic(path, data: bytes, exclusive: bool = False) -> None:
  """Replaces `path` by `data` atomically; with `exclusive` (local paths) creates it by a hard link, which raises
  FileExistsError where it exists (another OSError where the filesystem has no hard links)."""
  if is_remote(path):
    epath.Path(path).write_bytes(data)
    return
  path = os.fspath(path)
  folder = os.path.dirname(path) or '.'
  fd, tmp = tempfile.mkstemp(prefix=f'.{os.path.basename(path)}.', suffix='.tmp', dir=folder)
  try:
    with os.fdopen(fd, 'wb') as f:
      f.write(data)
      f.flush()
      os.fsync(f.fileno())
    (os.link if exclusive else os.replace)(tmp, path)
  finally:
    with contextlib.suppress(FileNotFoundError):  # renamed, or a write cut short
      os.unlink(tmp)
  with contextlib.suppress(OSError):  # the rename reaches the disk once the folder's entry does (POSIX)
    fd = os.open(folder, os.O_RDONLY)
    try:
      os.fsync(fd)
    finally:
      os.close(fd)


def utc(seconds: float | None = None) -> str:
  """An ISO 8601 UTC time to the second: now, or `seconds` since the epoch."""
  moment = datetime.datetime.fromtimestamp(time.time() if seconds is None else seconds, datetime.timezone.utc)
  return moment.isoformat(timespec='seconds')
