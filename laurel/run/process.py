"""A run's process: its background threads, its two signal regimes and its exit statuses, each fixing a real failure.
Standard library only: laurel.main installs the first regime before JAX and TensorFlow load.

Threads (each daemon, started through `start_thread` under a name of THREADS):

  | thread            | started by                  | what it does                          | the failure it fixes             |
  |-------------------|-----------------------------|---------------------------------------|----------------------------------|
  | laurel-ctrl-c     | exit_on_interrupt           | woken by a signal, exits at once      | Ctrl-C waited out an XLA compile |
  | laurel-heartbeat  | console.phase               | `still compiling (1m30s)` every 30 s  | a silent compile looked hung     |
  | laurel-lease      | lease.Lease                 | beats WORKDIR/lease.json every 10 s;  | a taken-over run wrote on        |
  |                   |                             | marks the lease lost                  |                                  |
  | laurel-peers      | cluster.PeerWatch           | beats in the coordinator's store;     | a dead peer: 100 s, then a C++   |
  |                   |                             | a silent peer ends this process       | abort                            |
  | laurel-checksums  | checkpoint.save             | a save's checksum list once it lands  | a crash left a checkpoint        |
  |                   |                             |                                       | unchecked                        |
  | laurel-watchdog   | the train loop (Watchdog)   | ends a loop that stopped progressing  | a collective one host never      |
  |                   |                             |                                       | entered hung forever             |

Signals, SIGINT (Ctrl-C) and SIGTERM (a scheduler's stop):

  | regime              | installed by                | what a signal does                                         |
  |---------------------|-----------------------------|------------------------------------------------------------|
  | before the loop     | exit_on_interrupt           | one line, exit 128 + signal at once; inside deferred()     |
  |                     |                             | only once the write is done                                |
  | in the loop         | stop_requests               | a checkpoint at the step's end, then exit 0, or PREEMPTED  |
  |                     |                             | under a scheduler; a second Ctrl-C exits 130 at once.      |
  |                     |                             | Several processes: SIGTERM goes to JAX's preemption        |
  |                     |                             | service, so every host stops at one step                   |

Exit statuses of laurel.main (EXIT_STATUSES; errors_in_one_line gives an error its own), each telling a supervisor
what to do next."""

import collections
import contextlib
import os
import signal
import socket
import statistics
import sys
import threading
import time
import traceback

BAD_INPUT = 2  # one line naming the field or flag and its value, before anything compiled or was written
DIVERGED = 3  # a loss or state that is not finite, or a failed save: a rerun would repeat it
PEER_LOST = 4  # processes that did not all join, or one of them died: restart every process together
HELD = 5  # another live run holds the workdir; a rerun is refused again while it lives
LOST = 6  # another run took the workdir over: this one stopped before writing again
PREEMPTED = 42  # stopped with a checkpoint before it finished (under a scheduler): restart it
WRITE_FAILED = 74  # the storage refused a write (full, read-only, no permission): rerun once it is writable
HUNG = 75  # the loop made no progress (the watchdog): restart from the last checkpoint (EX_TEMPFAIL)
EXIT_STATUSES = {BAD_INPUT: 'bad input', DIVERGED: 'diverged, or a save failed', PEER_LOST: 'a process lost',
                 HELD: 'workdir held', LOST: 'workdir taken over', PREEMPTED: 'preempted', WRITE_FAILED: 'write refused',
                 HUNG: 'hung', 130: 'Ctrl-C before the loop', 143: 'SIGTERM before the loop'}

THREADS = ('laurel-ctrl-c', 'laurel-heartbeat', 'laurel-lease', 'laurel-peers', 'laurel-checksums', 'laurel-watchdog')
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def start_thread(name: str, target, *args) -> threading.Thread:
  """A daemon thread of THREADS (a suffix may follow the name: laurel-checksums-30), started."""
  if name.rsplit('-', 1)[0] not in THREADS and name not in THREADS:
    raise ValueError(f'{name}: not a thread of laurel.run.process.THREADS')
  thread = threading.Thread(target=target, args=args, name=name, daemon=True)
  thread.start()
  return thread


# The regime before the loop.
_interrupt = {'line': 'interrupted', 'deferred': 0, 'pending': None}
_interrupt_lock = threading.RLock()  # re-entered when the handler runs in the main thread inside deferred()


def _exit_interrupted(signum=signal.SIGINT, _=None):
  with _interrupt_lock:
    if _interrupt['deferred']:
      _interrupt['pending'] = signum
      return
    line = _interrupt['line']
    if signum == signal.SIGTERM:  # the same line, naming the signal
      line = f'terminated (SIGTERM){line[line.index(":"):] if ":" in line else ""}'
    os.write(2, f'{line}\n'.encode())  # no buffered stream: the main thread may be inside print()
    os._exit(128 + signum)  # pylint: disable=protected-access  # no unwinding through XLA's and TensorFlow's threads


def _watch_wakeups(reader: socket.socket, writer: socket.socket):
  del writer  # kept alive with this thread: Python writes each caught signal's number to it
  while received := reader.recv(64):
    for signum in STOP_SIGNALS:
      if signum in received and signal.getsignal(signum) is _exit_interrupted:
        _exit_interrupted(signum)


def exit_on_interrupt(line: str) -> None:
  """From now on Ctrl-C prints `line` and exits 130 at once (SIGTERM: the line naming it, 143), until another handler
  replaces this one. A thread woken through signal.set_wakeup_fd exits even during an XLA compile, where Python would
  wait to run a handler; no KeyboardInterrupt unwinds through JAX (it crashed)."""
  _interrupt['line'] = line
  if signal.getsignal(signal.SIGINT) is _exit_interrupted:
    return
  for signum in STOP_SIGNALS:
    signal.signal(signum, _exit_interrupted)
  reader, writer = socket.socketpair()
  writer.setblocking(False)
  signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
  start_thread('laurel-ctrl-c', _watch_wakeups, reader, writer)


@contextlib.contextmanager
def deferred():
  """A Ctrl-C or SIGTERM (exit_on_interrupt) during this section exits when it ends: a file is never half written."""
  with _interrupt_lock:
    _interrupt['deferred'] += 1
  try:
    yield
  finally:
    with _interrupt_lock:
      _interrupt['deferred'] -= 1
      if _interrupt['pending'] is not None and not _interrupt['deferred']:
        _exit_interrupted(_interrupt['pending'])


@contextlib.contextmanager
def errors_in_one_line(fail):
  """What an operator can act on ends the program through `fail(message, status)`, one line: an error with an
  `exit_status` (InputError, the lease's Held and Lost, TrainingDiverged), a write the storage refused, Ctrl-C before
  the loop. Any other error is a bug or an environment failure: it keeps its traceback."""
  try:
    yield
  except KeyboardInterrupt:  # before the first step (in the loop it saves a checkpoint)
    fail('interrupted before training started; nothing was saved', 128 + signal.SIGINT)
  except OSError as e:  # a full disk, a read-only mount, no permission: the cause and the path
    from laurel.run import files  # pylint: disable=import-outside-toplevel  # this module loads before etils
    if not files.storage_error(e):
      raise
    fail(f'a write failed: {files.why(e)}; rerun the same command to resume once it is writable', WRITE_FAILED)
  except Exception as e:  # pylint: disable=broad-except
    if getattr(e, 'exit_status', None) is None:
      raise
    fail(str(e), e.exit_status)


# The regime in the loop.
@contextlib.contextmanager
def stop_requests(processes: int):
  """The signals that asked the loop to stop, in a list that the loop reads at each step's end; the handlers before
  are back on exit. One process: SIGTERM and Ctrl-C. Several: Ctrl-C, passed on as SIGTERM to JAX's preemption service
  (orbax's reached_preemption then stops every host at the same step)."""
  requested = []

  def handle(signum, _):
    if signum == signal.SIGINT and requested:
      print('interrupted again: exiting without a checkpoint', file=sys.stderr, flush=True)
      os._exit(130)  # pylint: disable=protected-access
    requested.append(signum)
    if signum == signal.SIGINT:
      print('interrupted: saving a checkpoint, then exiting (Ctrl-C again exits at once)', file=sys.stderr,
            flush=True)
    if processes > 1:
      signal.raise_signal(signal.SIGTERM)

  signums = STOP_SIGNALS if processes == 1 else (signal.SIGINT,)
  before = {signum: signal.signal(signum, handle) for signum in signums}
  try:
    yield requested
  finally:
    for signum, handler in before.items():
      signal.signal(signum, handler)


def stop_reason(requested: list) -> str:
  """How a run's last line names what stopped it (stop_requests' signals): Ctrl-C is no preemption."""
  if signal.SIGINT in requested:
    return 'interrupted (Ctrl-C)'
  return 'preempted (SIGTERM)' if signal.SIGTERM in requested else 'preempted'  # several hosts: JAX's notice


class Watchdog:
  """Ends a process whose loop stopped making progress (e.g. a collective one host never entered) with HUNG, printing
  every thread's stack, for a supervisor to restart. Call `beat(step)` after each step, `beat()` after other progress.
  The limit: `limit_s`, and after WARMUP steps (compiling) max(factor × the median step time, min_s). Time the whole
  process was stopped (SIGSTOP, a suspended job) is no stall: the watchdog's own poll comes back that much late, and
  the stall is then counted from the resumption. `where` names the process in its message."""
  WARMUP = 3

  def __init__(self, factor: float, min_s: float, limit_s: float, where: str = '', flush=lambda: None):
    self.factor, self.min_s, self.limit_s, self.where, self.flush = factor, min_s, limit_s, where, flush
    self.step, self.last, self.steps_seen = None, time.monotonic(), 0
    self.step_times = collections.deque(maxlen=200)
    self._stop = threading.Event()
    self._poll_s = min([1.0] + [x / 10 for x in (limit_s, min_s) if x]) if factor or limit_s else None

  def start(self) -> 'Watchdog':
    self.last = time.monotonic()
    if self._poll_s:
      start_thread('laurel-watchdog', self._watch)
    return self

  def stop(self):
    self._stop.set()

  def beat(self, step: int | None = None):
    now = time.monotonic()
    if step is not None:
      self.steps_seen += 1
      if self.steps_seen > self.WARMUP:
        self.step_times.append(now - self.last)
      self.step = step
    self.last = now

  def limit(self) -> float | None:
    limits = [self.limit_s] if self.limit_s else []
    if self.factor and len(self.step_times) >= self.WARMUP:
      limits.append(max(self.factor * statistics.median(self.step_times), self.min_s))
    return min(limits, default=None)

  def _watch(self):
    polled = resumed = time.monotonic()
    while not self._stop.wait(self._poll_s):
      now = time.monotonic()
      if now - polled > 2 * self._poll_s + 1.0:  # this thread was stopped too: the whole process was
        resumed = now
      polled = now
      stalled, limit = now - max(self.last, resumed), self.limit()
      if limit is not None and stalled > limit:
        return self._fire(stalled, limit)

  def _fire(self, stalled: float, limit: float):
    from absl import logging  # pylint: disable=import-outside-toplevel  # this module loads before absl
    after = 'before the first step' if self.step is None else f'after step {self.step}'
    message = (f'watchdog: no progress for {stalled:.1f}s {after} (limit {limit:.1f}s) on {self.where}; exiting with '
               f'status {HUNG} so that a supervisor restarts the run from its last checkpoint')
    logging.error(message)
    print(f'error: {message}', file=sys.stderr, flush=True)
    for thread_id, frame in sys._current_frames().items():  # pylint: disable=protected-access  # where it hangs
      print(f'thread {thread_id}:\n{"".join(traceback.format_stack(frame))}', file=sys.stderr)
    for flush in (self.flush, logging.flush, sys.stdout.flush, sys.stderr.flush):
      try:
        flush()
      except Exception as e:  # pylint: disable=broad-except  # exit regardless
        print(f'watchdog: flushing failed: {e!r}', file=sys.stderr)
    os._exit(HUNG)  # pylint: disable=protected-access  # the main thread is stuck: no clean exit
