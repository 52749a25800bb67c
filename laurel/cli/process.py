"""A run's process: its threads, its two signal regimes and its exit statuses (`fail` ends a program with one line and
one of them). Standard library only: laurel.main installs the first regime before JAX and TensorFlow load.

Threads of our own (start_thread, under a name of THREADS):

  | thread            | started by          | what it does                                                         |
  |-------------------|---------------------|----------------------------------------------------------------------|
  | laurel-ctrl-c     | exit_on_interrupt   | woken by a signal, exits at once: Ctrl-C does not wait out a compile |
  | laurel-heartbeat  | console.phase       | `still compiling (1m30s)` every 30 s                                 |

The libraries keep their own: orbax saves in the background (a checkpoint's checksum list is written in its
post-finalization callback), faulthandler's watchdog (laurel.train.Watchdog) and jax.distributed's heartbeat are
theirs.

Signals, SIGINT (Ctrl-C) and SIGTERM (a scheduler's stop):

  | regime              | installed by        | what a signal does                                               |
  |---------------------|---------------------|------------------------------------------------------------------|
  | before the loop     | exit_on_interrupt   | one line, exit INTERRUPTED at once; inside deferred() once the    |
  |                     |                     | write is done                                                    |
  | in the loop         | stop_requests       | a checkpoint at the step's end, then exit 0, or PREEMPTED under a |
  |                     |                     | scheduler; a second Ctrl-C exits at once. Several processes:     |
  |                     |                     | SIGTERM goes to JAX's preemption service, so every host stops at |
  |                     |                     | one step                                                         |

Exit statuses of laurel.main (EXIT_STATUSES), each telling a supervisor what to do next."""

import contextlib
import os
import signal
import socket
import sys
import threading

SUCCESS = 0
ERROR = 1  # anything else: a bug, a hang (the watchdog), a failed join or save, a refused write; rerun or fix
BAD_INPUT = 2  # one line naming the field, flag or path and its value, before anything compiled or was written
DIVERGED = 3  # a loss or a state about to be saved that is not finite: a rerun would repeat it
PREEMPTED = 42  # stopped with a checkpoint before it finished, under a scheduler: restart it
INTERRUPTED = 130  # Ctrl-C or SIGTERM before the loop, or a second Ctrl-C: nothing saved, nothing lost
EXIT_STATUSES = {SUCCESS: 'finished (outside a scheduler also stopped with a checkpoint)',
                 ERROR: 'an error: a bug or the environment (its traceback, or one line), a hang',
                 BAD_INPUT: 'bad input, a workdir another run holds included', DIVERGED: 'diverged',
                 PREEMPTED: 'preempted under a scheduler, with a checkpoint', INTERRUPTED: 'interrupted before the loop'}

THREADS = ('laurel-ctrl-c', 'laurel-heartbeat')
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def start_thread(name: str, target, *args) -> threading.Thread:
  """A daemon thread of THREADS, started."""
  if name not in THREADS:
    raise ValueError(f'{name}: not a thread of laurel.cli.process.THREADS')
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
    os._exit(INTERRUPTED)  # pylint: disable=protected-access  # no unwinding through XLA's and TensorFlow's threads


def _watch_wakeups(reader: socket.socket, writer: socket.socket):
  del writer  # kept alive with this thread: Python writes each caught signal's number to it
  while received := reader.recv(64):
    for signum in STOP_SIGNALS:
      if signum in received and signal.getsignal(signum) is _exit_interrupted:
        _exit_interrupted(signum)


def exit_on_interrupt(line: str) -> None:
  """From now on Ctrl-C and SIGTERM print `line` (naming SIGTERM) and exit INTERRUPTED at once, until another handler
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


def fail(message: str, code: int = BAD_INPUT):
  """Ends the program with one line `error: <message>` on stderr and exit status `code`."""
  print(f'error: {message}', file=sys.stderr, flush=True)
  sys.exit(code)


def exit_status(body, *args) -> int:
  """Runs `body(*args)` and returns its exit status: 0, or the status it exits with (fail: one line, then its status)."""
  try:
    body(*args)
  except SystemExit as e:
    return e.code if isinstance(e.code, int) else int(e.code is not None)
  return 0


@contextlib.contextmanager
def errors_in_one_line(fail):  # pylint: disable=redefined-outer-name
  """What an operator can act on ends the program through `fail(message, status)`, one line: an error with an
  `exit_status` (InputError, TrainingDiverged, a failed save or join), a write the storage refused, Ctrl-C before the
  loop. Any other error is a bug or an environment failure: it keeps its traceback."""
  try:
    yield
  except KeyboardInterrupt:  # before the first step (in the loop it saves a checkpoint)
    fail('interrupted before training started; nothing was saved', INTERRUPTED)
  except OSError as e:  # a full disk, a read-only mount, no permission: the cause and the path
    from laurel.cli import files  # pylint: disable=import-outside-toplevel  # this module loads before etils
    if not files.storage_error(e):
      raise
    fail(f'a write failed: {files.why(e)}; rerun the same command to resume once it is writable', ERROR)
  except Exception as e:  # pylint: disable=broad-except
    if getattr(e, 'exit_status', None) is None:
      raise
    fail(str(e), e.exit_status)


# The regime in the loop.
@contextlib.contextmanager
def stop_requests(processes: int, requested: list):
  """Appends the signals that ask the loop to stop to `requested`, which the loop reads at each step's end; the
  handlers before are back on exit. One process: SIGTERM and Ctrl-C. Several: Ctrl-C, passed on as SIGTERM to JAX's preemption service
  (orbax's reached_preemption then stops every host at the same step)."""

  def handle(signum, _):
    if signum == signal.SIGINT and requested:
      print('interrupted again: exiting without a checkpoint', file=sys.stderr, flush=True)
      os._exit(INTERRUPTED)  # pylint: disable=protected-access
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
