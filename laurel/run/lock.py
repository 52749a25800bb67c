"""One writer per workdir: process 0 holds an exclusive `fcntl.flock` on WORKDIR/lock for the run's life, and writes
who it is into it. The kernel drops the lock when the process ends, however it ends (SIGKILL, the OOM killer, a
restarted container), and keeps it while the process is stopped (SIGSTOP, a suspended job). An object store (gs://)
has no lock: there one job per workdir is the scheduler's contract (docs/clusters.md)."""

import contextlib
import fcntl
import json
import os
import socket

from laurel.config_lib import InputError
from laurel.cli import files

NAME = 'lock'


def _holder(fd: int) -> str:
  """Who holds the lock, as its holder wrote it."""
  try:
    who = json.loads(os.pread(fd, 4096, 0) or b'{}')
    return f'pid {who["pid"]} on host {who["host"]}, started {who["started_at"]}'
  except (ValueError, KeyError, TypeError):
    return 'a run that has not said who it is yet'


@contextlib.contextmanager
def held(workdir, process_index: int = 0, processes: int = 1, agree=None):
  """Holds WORKDIR/lock on process 0 for the block; on every process a one-line InputError where another live run
  holds it (`agree(refused)` gives process 0's word to the others: jax's broadcast by default)."""
  fd, refusal = None, None
  if process_index == 0 and not files.is_remote(workdir):
    path = os.path.join(os.fspath(workdir), NAME)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by the processes this one starts
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      os.ftruncate(fd, 0)
      os.pwrite(fd, json.dumps({'pid': os.getpid(), 'host': socket.gethostname(), 'started_at': files.utc()}).encode(),
                0)
    except BlockingIOError:
      refusal = (f'--workdir={os.fspath(workdir)!r}: in use by another run ({_holder(fd)}; {path}); wait for it to '
                 'end or stop it: two runs in one workdir overwrite each other')
      os.close(fd)
  if processes > 1 and (agree or _broadcast)(refusal is not None) and refusal is None:
    refusal = f'--workdir={os.fspath(workdir)!r}: in use by another run, as process 0 found (its log names it)'
  if refusal is not None:
    raise InputError(refusal)
  try:
    yield
  finally:
    if fd is not None:
      os.close(fd)  # releases the lock; the file stays (removing it would race with a run taking it)


def _broadcast(value: bool) -> bool:
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
  return bool(multihost_utils.broadcast_one_to_all(value))
