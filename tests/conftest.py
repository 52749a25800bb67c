"""Test-wide JAX settings, set before jax initialises (subprocesses inherit them through tests/helpers.py).

8 host CPU devices so mesh tests run in-process; low XLA optimisation and a persistent compilation cache,
because compiling dominates these tests' time on a 2-core machine (results are compared within one setting).
"""
import contextlib
import glob
import importlib.metadata
import os
import resource
import signal
import subprocess
import tempfile
import time

import numpy as np
import pytest
from absl import flags

# XLA:CPU runs each ready collective on a thread of a pool sized max(NPROC or cores, devices), and blocks
# that thread until every participant arrives. A step with several independent all-reduces per device can
# fill an 8-thread pool with half-met rendezvous and deadlock: mesh (2, 1, 4) hung within two runs, 3 times
# out of 3. A larger pool leaves every participant a thread; a real hang then fails in 3 minutes.
os.environ['NPROC'] = str(max(64, int(os.environ.get('NPROC') or 0)))
# Without its fusion emitters XLA:CPU compiles the tiny models several times faster (docs/testing.md). jaxlib 0.11
# dropped that flag, and XLA ends a process whose XLA_FLAGS names a flag it does not know.
_JAXLIB = tuple(int(part) for part in importlib.metadata.version('jaxlib').split('.')[:2])
_NO_FUSION_EMITTERS = '--xla_cpu_use_fusion_emitters=false ' if _JAXLIB < (0, 11) else ''
# One LLVM module per program: XLA:CPU's split for parallel codegen costs CPU time that busy cores lack
# (docs/testing.md).
TEST_XLA_FLAGS = (f'--xla_backend_optimization_level=0 {_NO_FUSION_EMITTERS}--xla_cpu_parallel_codegen_split_count=1 '
                  '--xla_cpu_collective_call_terminate_timeout_seconds=180 '
                  '--xla_cpu_collective_call_warn_stuck_timeout_seconds=60')
os.environ.setdefault('XLA_FLAGS', f'--xla_force_host_platform_device_count=8 {TEST_XLA_FLAGS}')
os.environ.setdefault('JAX_PLATFORMS', 'cpu')
os.environ.setdefault('JAX_COMPILATION_CACHE_DIR', os.path.join(tempfile.gettempdir(), 'laurel_test_jax_cache'))
os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0')
os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES', '0')
# grain's worker processes read absl flags, which laurel's command lines parse (absl.app); here their defaults.
flags.FLAGS.mark_as_parsed()


@pytest.fixture(autouse=True)
def no_interrupt_left_pending():
  """An interrupt a test leaves pending in laurel.cli.process ends the test process at the next deferred section (the
  real os._exit, its line swallowed by pytest's capture: xdist's 'node down'); that test fails instead."""
  yield
  from laurel.cli import process  # pylint: disable=import-outside-toplevel
  state = process._interrupt  # pylint: disable=protected-access
  left = dict(state)
  state.update(pending=None, deferred=0)  # the next tests run as usual
  assert left['pending'] is None and not left['deferred'], f'laurel.cli.process left {left}'


@pytest.fixture(autouse=True)
def no_process_left_running(monkeypatch):
  """Kills what a test started with subprocess.Popen and left running, with its descendants: a test that fails before
  it stops its 100,000-step run would leave it training through the rest of the suite. multiprocessing's and grain's
  workers are not started through Popen, and live on."""
  started = []
  popen_init = subprocess.Popen.__init__

  def recording_init(self, *args, **kwargs):
    popen_init(self, *args, **kwargs)
    started.append(self)

  monkeypatch.setattr(subprocess.Popen, '__init__', recording_init)
  yield
  for proc in started:
    if proc.poll() is None:
      for pid in [*_descendants(proc.pid), proc.pid]:
        with contextlib.suppress(ProcessLookupError):
          os.kill(pid, signal.SIGKILL)
      proc.wait()


def _descendants(pid: int) -> list[int]:
  """The processes below `pid`, as /proc lists them now (none where there is no /proc)."""
  children = {}
  for stat in glob.glob('/proc/[0-9]*/stat'):
    with contextlib.suppress(OSError, ValueError, IndexError):
      with open(stat) as f:
        fields = f.read().rpartition(')')[2].split()  # after the command's name, which may hold spaces
      children.setdefault(int(fields[1]), []).append(int(stat.split('/')[2]))
  found, queue = [], list(children.get(pid, []))
  while queue:
    found.append(child := queue.pop())
    queue += children.get(child, [])
  return found


@pytest.fixture(scope='session')
def sp_model(tmp_path_factory):
  """A tiny SentencePiece model with T5's special ids (pad 0, eos 1, unk 2), trained on random letters."""
  import sentencepiece  # pylint: disable=import-outside-toplevel
  root = tmp_path_factory.mktemp('sp')
  rng = np.random.default_rng(0)
  lines = [''.join(rng.choice(list('abcdefghij '), size=40)) for _ in range(300)]
  (root / 'corpus.txt').write_text('\n'.join(lines))
  sentencepiece.SentencePieceTrainer.train(
      input=str(root / 'corpus.txt'), model_prefix=str(root / 'sp'), vocab_size=40, model_type='bpe',
      pad_id=0, eos_id=1, unk_id=2, bos_id=-1, minloglevel=2)
  return str(root / 'sp.model')


@pytest.fixture(scope='session')
def trained_run(tmp_path_factory):
  """A run of helpers.SPEC trained through the command line in this process (helpers.TRAINED: checkpoints 3, 6 and
  9), once per test process. Tests only read it; one that changes it works on a copy (shutil.copytree)."""
  from helpers import SPEC, TRAINED, cli_args, on_devices  # pylint: disable=import-outside-toplevel  # it imports this
  from laurel import main  # pylint: disable=import-outside-toplevel
  workdir = tmp_path_factory.mktemp('trained') / 'run'
  with on_devices(1):
    assert main.main(['laurel-train', *cli_args(SPEC, workdir, TRAINED)[3:]]) == 0
  return workdir


def pytest_addoption(parser):
  parser.addoption('--cpu-times', type=int, default=0, metavar='N',
                   help='after the run: CPU seconds in all, and the N tests that took the most (test process and its '
                        'subprocesses; setup and teardown included)')


def _cpu_seconds() -> tuple[float, float]:
  """(this process's CPU seconds, its finished subprocesses')."""
  children = resource.getrusage(resource.RUSAGE_CHILDREN)
  return time.process_time(), children.ru_utime + children.ru_stime


_CPU_START = pytest.StashKey[tuple]()
_cpu_times = {}  # test id -> (own, subprocesses') CPU seconds, gathered where the reports arrive (xdist: controller)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
  item.stash[_CPU_START] = _cpu_seconds()
  yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
  report = (yield).get_result()
  if call.when == 'teardown' and item.config.getoption('cpu_times'):
    report.user_properties.append(('cpu_s', tuple(b - a for a, b in zip(item.stash[_CPU_START], _cpu_seconds()))))


def pytest_runtest_logreport(report):
  _cpu_times.update((report.nodeid, value) for name, value in report.user_properties if name == 'cpu_s')


def pytest_terminal_summary(terminalreporter, config):
  if not (most := config.getoption('cpu_times')) or not _cpu_times:
    return
  own, children = (sum(t[i] for t in _cpu_times.values()) for i in (0, 1))
  write = terminalreporter.write_line
  terminalreporter.section('CPU seconds (test process + its subprocesses)')
  write(f'{own + children:.1f} in all: {own:.1f} in the test processes, {children:.1f} in subprocesses')
  for test, (o, c) in sorted(_cpu_times.items(), key=lambda kv: -sum(kv[1]))[:most]:
    write(f'{o + c:7.1f} {o:7.1f} {c:7.1f}  {test}')
