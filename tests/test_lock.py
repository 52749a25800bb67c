"""One writer per workdir (issue 58): process 0 holds an `fcntl.flock` on WORKDIR/lock for the run's life. A second run
is refused in one line naming the holder, also while the holder is stopped; a killed or restarted holder releases it;
an object store has none (the scheduler's contract, docs/clusters.md)."""
import contextlib
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import pytest

from helpers import ROOT, SPEC, TINY_LM, cli_args, cli_env, metrics, losses, train_cli, tree_snapshot
from laurel import config_lib
from laurel.cli import process
from laurel.run import lock


def _refusal(workdir) -> str:
  with pytest.raises(config_lib.InputError) as refused:
    with lock.held(workdir):
      pass
  return str(refused.value)


def test_a_second_run_is_refused_in_one_line_naming_the_holder_and_a_finished_one_is_not(tmp_path):
  with lock.held(tmp_path):
    holder = json.loads((tmp_path / lock.NAME).read_text())
    assert holder['pid'] == os.getpid() and holder['host'] == socket.gethostname()
    assert _refusal(tmp_path) == (
        f"--workdir='{tmp_path}': in use by another run (pid {os.getpid()} on host {socket.gethostname()}, started "
        f'{holder["started_at"]}; {tmp_path / lock.NAME}); wait for it to end or stop it: two runs in one workdir '
        'overwrite each other')
  with lock.held(tmp_path):  # released with the block
    pass


def test_a_restarted_container_is_not_refused_by_its_earlier_incarnation(tmp_path):
  """In a container Python is pid 1 every time: the lock file names it, but no live process holds its lock."""
  (tmp_path / lock.NAME).write_text(json.dumps({'pid': 1, 'host': socket.gethostname(), 'started_at': 'earlier'}))
  with lock.held(tmp_path):
    assert json.loads((tmp_path / lock.NAME).read_text())['pid'] == os.getpid()


def test_an_object_store_has_no_lock_and_every_process_is_refused_with_process_zero(tmp_path):
  with lock.held('gs://bucket/run'):  # nothing written, nothing refused: the scheduler's contract
    pass
  told = []
  with lock.held(tmp_path, process_index=1, processes=2, agree=lambda refused: told.append(refused) or False):
    assert not (tmp_path / lock.NAME).exists() and told == [False]
  with pytest.raises(config_lib.InputError, match='in use by another run, as process 0 found'):
    with lock.held(tmp_path, process_index=1, processes=2, agree=lambda refused: True):
      pass


def _stopped(pid: int) -> bool:
  """Whether every thread of process `pid` is stopped (state T in /proc/<pid>/task/<tid>/stat)."""
  states = []
  for stat in pathlib.Path(f'/proc/{pid}/task').glob('*/stat'):
    with contextlib.suppress(FileNotFoundError):  # a thread that ended meanwhile
      states.append(stat.read_text().rpartition(')')[2].split()[0])
  return bool(states) and all(state in 'Tt' for state in states)


HOLDER = ('import sys, time\nfrom laurel.run import lock\n'
          'with lock.held(sys.argv[1]):\n  print("held", flush=True)\n  time.sleep(600)\n')


@pytest.mark.process
def test_a_stopped_holder_is_refused_and_a_killed_one_releases_the_lock(tmp_path):
  holder = subprocess.Popen([sys.executable, '-c', HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, 'PYTHONPATH': str(ROOT)})
  assert holder.stdout.readline() == 'held\n'
  os.kill(holder.pid, signal.SIGSTOP)  # a suspended job: alive, stopped
  assert f'in use by another run (pid {holder.pid} on host ' in _refusal(tmp_path)
  holder.kill()  # SIGKILL ends a stopped process too
  holder.wait()
  with lock.held(tmp_path):  # its rerun: the kernel dropped the lock with the process
    pass


@pytest.mark.slow
@pytest.mark.process
def test_a_second_run_on_a_live_runs_workdir_is_refused_and_the_first_ends_unharmed(tmp_path, capsys):
  overrides = {**TINY_LM, 'steps': 100_000, 'checkpoint_every': 100_000, 'eval_every': 100_000}
  workdir, out = tmp_path / 'run', tmp_path / 'first.out'  # a file: a pipe left unread would stall the run
  with out.open('w') as f:
    first = subprocess.Popen(cli_args(SPEC, workdir, overrides) + ['--preempted_exit=42'], env=cli_env(), stdout=f,
                             stderr=subprocess.STDOUT)
  deadline = time.time() + 240

  def wait_for(ready):
    while not ready():
      assert first.poll() is None and time.time() < deadline, out.read_text()[-2000:]
      time.sleep(0.05)

  wait_for(lambda: (workdir / 'metrics.jsonl').exists() and max(losses(workdir), default=0) >= 3)
  os.kill(first.pid, signal.SIGSTOP)  # stopped: it holds the workdir still
  wait_for(lambda: _stopped(first.pid))  # the signal lands later: a write in flight would follow the snapshot
  before = tree_snapshot(workdir)
  status, stdout, stderr = train_cli(capsys, SPEC, workdir, {**overrides, 'steps': 99_999})
  after = tree_snapshot(workdir)  # before the first run goes on, writing its metrics
  os.kill(first.pid, signal.SIGCONT)
  assert status == process.BAD_INPUT and stderr.count('\n') == 1, stderr[-2000:]
  assert stderr.startswith(f"error: --workdir='{workdir}': in use by another run (pid {first.pid} on host ")
  assert 'compiling' not in stdout and after == before
  first.send_signal(signal.SIGTERM)
  assert first.wait(timeout=120) == process.PREEMPTED, out.read_text()[-2000:]
  assert 'preempted (SIGTERM): saved checkpoint' in out.read_text(), out.read_text()[-2000:]
  logged = [r['step'] for r in metrics(workdir)]
  assert logged == list(range(1, len(logged) + 1))  # every step once: one writer
  assert json.loads((workdir / 'config.json').read_text())['steps'] == 100_000  # not the second run's
