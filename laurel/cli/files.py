"""Writes that a kill never leaves torn: a local file goes to a temporary file beside it, flushed, then renamed over
the old one; a path behind '://' (gs://) is one upload, which the object store makes atomic."""
import contextlib
import datetime
import errno
import os
import tempfile
import time

from etils import epath


def is_remote(path) -> bool:
  return '://' in os.fspath(path)


def write_text_atomic(path, text: str) -> None:
  write_bytes_atomic(path, text.encode())


def write_bytes_atomic(path, data: bytes) -> None:
  """Replaces `path` by `data` atomically."""
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
    os.replace(tmp, path)
  finally:
    with contextlib.suppress(FileNotFoundError):  # renamed, or a write cut short
      os.unlink(tmp)
  with contextlib.suppress(OSError):  # the rename reaches the disk once the folder's entry does (POSIX)
    fd = os.open(folder, os.O_RDONLY)
    try:
      os.fsync(fd)
    finally:
      os.close(fd)


def storage_error(error: BaseException) -> bool:
  """Whether `error` says the storage refuses writes (full, read-only, no permission): a write that fails so fails
  again until someone frees space or remounts, the environment, not a bug."""
  return isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES)


def why(error: BaseException) -> str:
  """An OSError as one line naming its cause and path, e.g. 'ENOSPC (No space left on device): /runs/a/final.json'."""
  if isinstance(error, OSError) and error.errno in errno.errorcode:
    return (f'{errno.errorcode[error.errno]} ({error.strerror or os.strerror(error.errno)})'
            + (f': {os.fspath(error.filename)}' if error.filename is not None else ''))
  return f'{type(error).__name__}: {(str(error).splitlines() or [""])[0][:200]}'


def remove_temporaries(folder, names) -> list[str]:
  """Removes the temporary files write_bytes_atomic left beside each of `names` in `folder` when a kill cut it short;
  only for a writer that knows no other process writes them (a run holding its workdir's lock). Returns their names."""
  if is_remote(folder):
    return []  # an upload leaves no temporary
  prefixes = tuple(f'.{name}.' for name in names)
  removed = []
  with contextlib.suppress(FileNotFoundError):
    for entry in os.scandir(folder):
      if entry.name.startswith(prefixes) and entry.name.endswith('.tmp') and entry.is_file(follow_symlinks=False):
        with contextlib.suppress(FileNotFoundError):
          os.unlink(entry.path)
          removed.append(entry.name)
  return removed


def utc(seconds: float | None = None) -> str:
  """An ISO 8601 UTC time to the second: now, or `seconds` since the epoch."""
  moment = datetime.datetime.fromtimestamp(time.time() if seconds is None else seconds, datetime.timezone.utc)
  return moment.isoformat(timespec='seconds')
