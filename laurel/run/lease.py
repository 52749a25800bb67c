"""WORKDIR/lease.json: the run that holds a workdir, so that a second, uncoordinated run on it is refused at start,
and a run that lost it stops before writing again (the fence). A lease, not a lock (a run killed with SIGKILL must not
block its rerun): a later run takes it over where its holder's process is gone from this host (pid and start time), its
Slurm job was requeued, or its heartbeat did not move while this run watched it for STALE_S on its own monotonic clock.
No host's clock is compared with another's."""

import contextlib
import json
import os
import socket
import sys
import threading
import time
import uuid

from etils import epath

from laurel.run import files, process
from laurel.config_lib import InputError

NAME = 'lease.json'
HEARTBEAT_S = 10.0
STALE_S = 60.0


class Held(Exception):
  """The workdir is held by another live run; the message names it."""
  exit_status = process.HELD


class Lost(Exception):
  """Another run took this run's lease over; the message names it. Raised before a write, never after."""
  exit_status = process.LOST


def _read_line(path: str) -> str | None:
  try:
    with open(path, encoding='ascii', errors='replace') as f:
      return f.read().strip() or None
  except OSError:
    return None


def process_started(pid) -> int | None:
  """When `pid` started, in clock ticks since boot (/proc/<pid>/stat field 22); None where unknown or gone."""
  stat = _read_line(f'/proc/{pid}/stat')
  fields = stat.rpartition(')')[2].split() if stat else []  # after the command name, which may hold spaces
  return int(fields[19]) if len(fields) > 19 and fields[19].isdigit() else None


def _pid_namespace() -> str | None:
  with contextlib.suppress(OSError):
    return os.readlink('/proc/self/ns/pid')
  return None


# Each field a run writes, and its type: a record with another type is damaged, not a run's.
FIELDS = {'host': str, 'pid': int, 'process_id': int, 'processes': int, 'started_at': str, 'heartbeat': (int, float),
          'heartbeat_at': str, 'beats': int, 'slurm_job': (str, type(None)), 'slurm_restart': int, 'token': str,
          'boot_id': (str, type(None)), 'pid_namespace': (str, type(None)), 'pid_started': (int, type(None))}


def damage(holder) -> str | None:
  """Why `holder` (lease.json's JSON) is no lease a run wrote, as a phrase; None where it is one."""
  if not isinstance(holder, dict):
    return f'not a JSON object but {type(holder).__name__}'
  if not holder.get('token'):
    return 'no token names its holder'
  for name, kind in FIELDS.items():
    if name in holder and (not isinstance(holder[name], kind) or isinstance(holder[name], bool)):
      return f'its field {name}={holder[name]!r} has the wrong type'
  return None


def describe(holder: dict) -> str:
  """The holder of a well-formed record, naming only the fields it has."""
  where = f'process {holder["process_id"]} of {holder["processes"]} ' if 'process_id' in holder else 'a process '
  where += f'(pid {holder["pid"]}) ' if 'pid' in holder else ''
  where += f'on host {holder["host"]}' if 'host' in holder else 'on an unnamed host'
  where += f', started {holder["started_at"]}' if 'started_at' in holder else ''
  return where + (f', Slurm job {holder["slurm_job"]}' if holder.get('slurm_job') else '')


def _pid_alive(pid) -> bool:
  try:
    os.kill(int(pid), 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    pass  # another user's process: it lives
  return True


class Lease:
  """The lease on one workdir, held by this process from acquire() to release()."""
  def __init__(self, workdir, process_id: int = 0, processes: int = 1, heartbeat_s: float = HEARTBEAT_S,
               stale_s: float = STALE_S):
    self.path = epath.Path(workdir) / NAME
    self.where = f'--workdir={os.fspath(self.path.parent)!r}'
    self.heartbeat_s, self.stale_s = heartbeat_s, stale_s
    now = time.time()
    self.record = {'host': socket.gethostname(), 'pid': os.getpid(), 'process_id': process_id,
                   'processes': processes, 'started_at': files.utc(now),
                   'heartbeat': now, 'heartbeat_at': files.utc(now), 'beats': 0,
                   'slurm_job': os.environ.get('SLURM_JOB_ID'),
                   'slurm_restart': int(os.environ.get('SLURM_RESTART_COUNT') or 0), 'token': uuid.uuid4().hex,
                   'boot_id': _read_line('/proc/sys/kernel/random/boot_id'), 'pid_namespace': _pid_namespace(),
                   'pid_started': process_started(os.getpid())}
    self.lost = None  # why, once the heartbeat found another holder
    self._writing = threading.Lock()  # one write at a time: a beat's older record never lands after a newer one
    self._stop = threading.Event()
    self._thread = None

  def read(self) -> tuple[dict | None, str | None]:
    """(record, None); (None, None) where there is no lease; (None, why) where lease.json is no lease a run wrote.
    OSError where it cannot be read."""
    try:
      text = self.path.read_bytes()
    except FileNotFoundError:
      return None, None
    try:
      holder = json.loads(text)
    except ValueError:  # UnicodeDecodeError included
      return None, f'not JSON: {text[:40]!r}'
    why = damage(holder)
    return (None, why) if why else (holder, None)

  def _mine(self) -> bool:
    return (self.read()[0] or {}).get('token') == self.record['token']

  def acquire(self) -> 'Lease':
    """Takes the lease, or raises Held; InputError (one line) where lease.json cannot be read or written."""
    try:
      self._acquire()
    except OSError as e:  # a full disk, a read-only mount, no permission, a directory in the lease's place
      raise InputError(f'{self.where}: {NAME} cannot be taken: {files.why(e)}'
                         + ('; it is a directory: remove it' if self.path.is_dir() else '')) from None
    self._thread = process.start_thread('laurel-lease', self._beat)
    return self

  def _acquire(self):
    for _ in range(3):  # a lease released while this run looked at it: create it again
      holder, damaged = self.read()
      if holder is None and damaged is None:
        if self._create():
          return
        continue  # another run's lease appeared first: judge it
      reason = f'it is damaged ({damaged})' if damaged else self._why_free(holder)
      if reason is None:
        holder = self.read()[0]  # now: another run may have taken it over while this one watched
        if holder is None:
          continue  # released (or damaged) while this run watched it
        raise Held(self._held_message(holder))
      who = 'a damaged lease' if damaged else describe(holder)
      print(f'lease: taking over {self.path} from {who}: {reason}', file=sys.stderr, flush=True)
      self._write()
      time.sleep(0.05)  # two runs taking over at once: the later rename wins, and the other sees it here
      if not self._mine():
        raise Held(self._held_message(self.read()[0] or {}))
      return
    raise Held(f'{self.where}: its lease was created and released three times while this run tried to take it; '
               'another run is starting there')

  def _why_free(self, holder: dict) -> str | None:
    """Why `holder` no longer holds the workdir, or None where it still does; may watch its heartbeat for stale_s."""
    job, restart = self.record['slurm_job'], self.record['slurm_restart']
    if job and holder.get('slurm_job') == job and holder.get('slurm_restart', 0) < restart:
      return f'it is an earlier run of Slurm job {job} (requeued)'
    if self._sees_process(holder):  # its pid means the same process here: ask the kernel
      pid, started = holder['pid'], holder.get('pid_started')
      if not _pid_alive(pid):
        return f'its pid {pid} is gone from this host'
      if started is not None and process_started(pid) not in (None, started):
        return f'its pid {pid} is now another process (started later: a restarted container?)'
      return None  # alive, though perhaps stopped (SIGSTOP, a suspended job): never taken over
    return self._watch(holder)

  def _sees_process(self, holder: dict) -> bool:
    """Whether holder's pid names a process this one can see: the same host, boot and pid namespace."""
    if holder.get('host') != self.record['host'] or 'pid' not in holder:
      return False
    return all(holder.get(k) == self.record[k] for k in ('boot_id', 'pid_namespace') if k in holder)

  def _watch(self, holder: dict) -> str | None:
    """None where holder's record changes (a heartbeat) within stale_s of this run's monotonic clock; else why it is
    free. Skew-free: no other host's timestamp is compared with this host's clock."""
    print(f'lease: {self.path} is held by {describe(holder)}; watching its heartbeat for up to {self.stale_s:.0f} s',
          file=sys.stderr, flush=True)
    start = time.monotonic()
    while time.monotonic() - start < self.stale_s:
      time.sleep(min(1.0, self.stale_s / 20))
      if self.read() != (holder, None):
        return None
    return f'its heartbeat did not move in {self.stale_s:.0f} s'

  def _held_message(self, holder: dict) -> str:
    evidence = ('its process is alive on this host' if self._sees_process(holder)
                else 'its heartbeat moved while this run watched it')
    return (f'{self.where}: held by a live run: {describe(holder)}; {evidence} ({NAME}); wait for it to end or stop '
            f'it (a run takes its lease over once its heartbeat stops for {self.stale_s:.0f} s, or at once where its '
            'process is gone from this host); two runs in one workdir overwrite each other')

  def _create(self) -> bool:
    """False where another run's lease appeared first."""
    data = json.dumps(self.record, indent=1).encode()
    if not files.is_remote(self.path):
      try:
        files.write_bytes_atomic(self.path, data, exclusive=True)
        return True
      except FileExistsError:
        return False
      except OSError as e:
        if files.storage_error(e):
          raise
        # a filesystem without hard links (some FUSE mounts): as on an object store
    files.write_bytes_atomic(self.path, data)  # no exclusive create: the last writer within a second wins
    time.sleep(1.0)
    return self._mine()

  def _write(self):
    with self._writing:
      now = time.time()
      self.record.update(heartbeat=now, heartbeat_at=files.utc(now), beats=self.record['beats'] + 1)
      files.write_text_atomic(self.path, json.dumps(self.record, indent=1))

  def check(self, reread: bool = True) -> None:
    """fence()'s check on this process. A read that fails proves nothing: the heartbeat reads again."""
    if self.lost is None and reread:
      with contextlib.suppress(OSError):
        self._look()
    if self.lost is not None:
      raise Lost(self.lost)

  def _look(self):
    """Reads lease.json; where another run holds it, sets `lost` to why."""
    holder, damaged = self.read()
    if (holder or {}).get('token') == self.record['token']:
      return
    now = (describe(holder) if holder else f'a damaged lease ({damaged})' if damaged else 'no one (it was removed)')
    self.lost = (f'{self.where}: this run no longer holds its lease ({NAME}): now {now}; stopped before writing '
                 f'again (was this run stopped for longer than {self.stale_s:.0f} s?)')

  def _beat(self):
    failed = None
    while not self._stop.wait(self.heartbeat_s):
      try:
        self._look()
        if self.lost is not None:
          return  # the loop stops at its next step, saying why
        self._write()
        failed = None
      except Exception as e:  # pylint: disable=broad-except  # a storage hiccup: try again at the next beat
        if files.why(e) != failed:  # once per cause, not every beat
          failed = files.why(e)
          print(f'warning: {self.path}: heartbeat not written: {failed}', file=sys.stderr, flush=True)

  def release(self):
    """Ends the heartbeat and removes the lease where it is still this run's; never raises (a read-only workdir)."""
    self._stop.set()
    if self._thread is not None and self._thread.is_alive():
      self._thread.join()
    try:
      if self._mine():
        self.path.unlink()
    except FileNotFoundError:
      pass
    except OSError as e:
      print(f'warning: {self.path}: not removed: {files.why(e)}; the next run takes it over (this process is gone)',
            file=sys.stderr, flush=True)


@contextlib.contextmanager
def held(workdir, process_id: int, processes: int, agree=None, **timing):
  """Process 0 holds the workdir's lease for the block; every process raises where process 0 does (`agree(code)`
  returns process 0's code: jax's broadcast by default): Held, or InputError where the lease cannot be written."""
  lease, refusal = None, None
  if process_id == 0:
    try:
      lease = Lease(workdir, process_id, processes, **timing).acquire()
    except Exception as e:  # pylint: disable=broad-except  # raised below, once every process knows
      refusal = e
  code = 0 if refusal is None else 1 if isinstance(refusal, Held) else 2
  if processes > 1 and (code := int((agree or _broadcast)(code) or 0)) and refusal is None:
    where = f'--workdir={os.fspath(workdir)!r}'
    refusal = (Held(f'{where}: held by another live run, as process 0 found (its log names the holder)') if code == 1
               else InputError(f'{where}: process 0 could not take its lease (its log says why)'))
  if refusal is not None:
    raise refusal
  try:
    yield lease
  finally:
    if lease is not None:
      lease.release()


def fence(lease: Lease | None, processes: int = 1, agree=None):
  """What a run calls before each write of a checkpoint or run file: fence() re-reads lease.json on process 0 and
  raises Lost where another run holds it; fence(reread=False) only asks whether the heartbeat found one (each step);
  fence(every_process=True), which every process calls at once (before a collective save), raises on all of them."""
  def check(reread: bool = True, every_process: bool = False):
    lost = None
    if lease is not None:
      try:
        lease.check(reread)
      except Lost as e:
        lost = e
    if every_process and processes > 1 and (agree or _broadcast)(lost is not None) and lost is None:
      lost = Lost('this run no longer holds its lease, as process 0 found (its log names the new holder)')
    if lost is not None:
      raise lost
  return check


def _broadcast(value: int) -> int:
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
  return int(multihost_utils.broadcast_one_to_all(value))
