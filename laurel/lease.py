"""WORKDIR/lease.json: the run that holds a workdir, so that a second, uncoordinated run on it is refused at start.
A lease, not a lock (a run killed with SIGKILL must not block its rerun): a later run takes it over where its heartbeat
is stale, its pid gone or its Slurm job requeued. Hosts' clocks must agree within a fraction of STALE_S (NTP)."""

import contextlib
import json
import os
import socket
import sys
import threading
import time
import uuid

from etils import epath

from laurel import files

NAME = 'lease.json'
HEARTBEAT_S = 10.0
STALE_S = 60.0
HELD = 5  # exit status: another live run holds the workdir; a rerun is refused again while it lives


class Held(Exception):
  """The workdir is held by another live run; the message names it."""


def describe(holder: dict) -> str:
  return (f'process {holder.get("process_id")} of {holder.get("processes")} (pid {holder.get("pid")}) on host '
          f'{holder.get("host")}, started {holder.get("started_at")}'
          + (f', Slurm job {holder["slurm_job"]}' if holder.get('slurm_job') else ''))


def _pid_alive(pid) -> bool:
  try:
    os.kill(int(pid), 0)
  except ProcessLookupError:
    return False
  except (PermissionError, ValueError, TypeError, OverflowError):
    pass  # another user's process, or a record we cannot read: assume it lives
  return True


class Lease:
  """The lease on one workdir, held by this process from acquire() to release()."""
  def __init__(self, workdir, process_id: int = 0, processes: int = 1, heartbeat_s: float = HEARTBEAT_S,
               stale_s: float = STALE_S):
    self.path = epath.Path(workdir) / NAME
    self.heartbeat_s, self.stale_s = heartbeat_s, stale_s
    now = time.time()
    self.record = {'host': socket.gethostname(), 'pid': os.getpid(), 'process_id': process_id,
                   'processes': processes, 'started_at': files.utc(now),
                   'heartbeat': now, 'heartbeat_at': files.utc(now),
                   'slurm_job': os.environ.get('SLURM_JOB_ID'),
                   'slurm_restart': int(os.environ.get('SLURM_RESTART_COUNT') or 0), 'token': uuid.uuid4().hex}
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._beat, name='laurel-lease', daemon=True)

  def read(self) -> dict | None:
    """The lease as written, None where there is none; {} where it cannot be parsed (never written by a run)."""
    try:
      holder = json.loads(self.path.read_text())
    except FileNotFoundError:
      return None
    except ValueError:
      return {}
    return holder if isinstance(holder, dict) else {}

  def _mine(self) -> bool:
    return (self.read() or {}).get('token') == self.record['token']

  def acquire(self) -> 'Lease':
    if self.read() is not None or not self._create():
      holder = self.read() or {}  # created by another run a moment ago, or taken over below
      reason = self._why_free(holder) if holder else 'it is unreadable'
      if reason is None:
        raise Held(self._held_message(holder))
      print(f'lease: taking over {self.path} from {describe(holder)}: {reason}', file=sys.stderr, flush=True)
      self._write()
      time.sleep(0.05)  # two runs taking over at once: the later rename wins, and the other sees it here
      if not self._mine():
        raise Held(self._held_message(self.read() or {}))
    self._thread.start()
    return self

  def _why_free(self, holder: dict) -> str | None:
    """Why the lease `holder` no longer holds the workdir, or None where it still does."""
    if (age := time.time() - float(holder.get('heartbeat', 0))) > self.stale_s:
      return f'its last heartbeat is {age:.0f} s old (stale after {self.stale_s:.0f} s)'
    if holder.get('host') == self.record['host'] and not _pid_alive(holder.get('pid')):
      return f'its pid {holder.get("pid")} is gone from this host'
    job, restart = self.record['slurm_job'], self.record['slurm_restart']
    if job and holder.get('slurm_job') == job and int(holder.get('slurm_restart', 0)) < restart:
      return f'it is an earlier run of Slurm job {job} (requeued)'
    return None

  def _held_message(self, holder: dict) -> str:
    age = time.time() - float(holder.get('heartbeat', 0))
    return (f'--workdir={os.fspath(self.path.parent)!r}: held by a live run: {describe(holder)}, last heartbeat '
            f'{age:.0f} s ago ({NAME}); wait for it to end or stop it (its lease is free {self.stale_s:.0f} s after '
            'its last heartbeat); two runs in one workdir overwrite each other')

  def _create(self) -> bool:
    """False where another run's lease appeared first."""
    data = json.dumps(self.record, indent=1).encode()
    if not files.is_remote(self.path):
      try:
        files.write_bytes_atomic(self.path, data, exclusive=True)
        return True
      except FileExistsError:
        return False
      except OSError:
        pass  # a filesystem without hard links (some FUSE mounts): as on an object store
    files.write_bytes_atomic(self.path, data)  # no exclusive create: the last writer within a second wins
    time.sleep(1.0)
    return self._mine()

  def _write(self):
    now = time.time()
    self.record.update(heartbeat=now, heartbeat_at=files.utc(now))
    files.write_text_atomic(self.path, json.dumps(self.record, indent=1))

  def _beat(self):
    while not self._stop.wait(self.heartbeat_s):
      try:
        if not self._mine():
          print(f'warning: {self.path}: now held by {describe(self.read() or {})}; this run no longer renews it '
                '(was it stopped for longer than the stale limit?)', file=sys.stderr, flush=True)
          return
        self._write()
      except Exception as e:  # pylint: disable=broad-except  # a storage hiccup: try again at the next beat
        print(f'warning: {self.path}: heartbeat failed: {e!r}', file=sys.stderr, flush=True)

  def release(self):
    self._stop.set()
    if self._thread.is_alive():
      self._thread.join()
    with contextlib.suppress(FileNotFoundError):
      if self._mine():
        self.path.unlink()


@contextlib.contextmanager
def held(workdir, process_id: int, processes: int, agree=None, **timing):
  """Process 0 holds the workdir's lease for the block; every process raises Held where process 0 does (`agree(flag)`
  returns process 0's flag: jax's broadcast by default)."""
  lease, refusal = None, None
  if process_id == 0:
    try:
      lease = Lease(workdir, process_id, processes, **timing).acquire()
    except Held as e:
      refusal = e
  if processes > 1 and (agree or _broadcast)(refusal is not None) and refusal is None:
    refusal = Held(f'--workdir={os.fspath(workdir)!r}: held by another live run, as process 0 found (its log names '
                   'the holder)')
  if refusal is not None:
    raise refusal
  try:
    yield lease
  finally:
    if lease is not None:
      lease.release()


def _broadcast(flag: bool) -> bool:
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
  return bool(multihost_utils.broadcast_one_to_all(flag))
