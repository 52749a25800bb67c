"""The workdir lease (issue 54): a holder known by more than its pid (a restarted container is not refused by its
earlier incarnation; a stopped live holder is never taken over), the fence (a run that lost its lease stops before its
next write), staleness judged on this host's monotonic clock alone (clock skew), damaged lease files, storage errors.
The lease's first tests (refusal, takeover, Slurm, gs://) are in tests/test_cluster.py."""
import errno
import json
import os
import signal
import subprocess
import sys
import threading
import time

import jax
import pytest

from helpers import ROOT, SPEC, TINY_LM, checkpoint_steps, cli_env, load_config, metrics, typed_config
from laurel import config_lib, train
from laurel.run import checkpoint, files, lease, metrics_log


def _holder(workdir, **fields) -> dict:
  """Writes lease.json as another run on this host would, with `fields` changed; returns the record."""
  record = {**lease.Lease(workdir).record, 'token': 'other', **fields}
  (workdir / lease.NAME).write_text(json.dumps(record))
  return record


def _token(workdir) -> str:
  return json.loads((workdir / lease.NAME).read_text())['token']


# 1. A holder is its pid and its start time in this pid namespace: a restart is not refused.

@pytest.mark.skipif(not os.path.exists('/proc/self/stat'), reason='no /proc/<pid>/stat on this system')
def test_a_restarted_container_takes_over_from_its_earlier_incarnation_at_once(tmp_path, capsys):
  """In a container Python is pid 1 every time: the same pid, alive, but started later than the holder's."""
  _holder(tmp_path, pid_started=lease.process_started(os.getpid()) - 1)
  taken = lease.Lease(tmp_path, stale_s=3600).acquire()  # at once: no watching
  taken.release()
  assert f'its pid {os.getpid()} is now another process (started later' in capsys.readouterr().err


def test_an_earlier_incarnation_in_another_pid_namespace_is_watched_then_taken_over(tmp_path, capsys):
  """Its pid 1 is not this namespace's pid 1: the kernel cannot tell, its heartbeat can."""
  _holder(tmp_path, pid=1, pid_namespace='pid:[4026530000]', pid_started=5)
  taken = lease.Lease(tmp_path, stale_s=0.2).acquire()
  taken.release()
  err = capsys.readouterr().err
  assert 'watching its heartbeat for up to 0 s' in err and 'its heartbeat did not move in 0 s' in err


HOLDER = ('import sys, time\nfrom laurel.run import lease\n'
          'held = lease.Lease(sys.argv[1], heartbeat_s=0.02).acquire()\nprint("held", flush=True)\ntime.sleep(600)\n')


@pytest.mark.slow
def test_a_stopped_holder_on_this_host_is_never_taken_over(tmp_path, capsys):
  child = subprocess.Popen([sys.executable, '-c', HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                           env={**os.environ, 'PYTHONPATH': str(ROOT)})
  try:
    assert child.stdout.readline() == 'held\n'
    os.kill(child.pid, signal.SIGSTOP)  # a suspended job: alive, its heartbeat paused
    time.sleep(0.3)
    with pytest.raises(lease.Held, match=f'pid {child.pid}.*its process is alive on this host'):
      lease.Lease(tmp_path, stale_s=0.1).acquire()
  finally:
    child.kill()  # SIGKILL ends a stopped process too
    child.wait()
  taken = lease.Lease(tmp_path, stale_s=3600).acquire()  # its rerun: at once
  taken.release()
  assert f'its pid {child.pid} is gone from this host' in capsys.readouterr().err


# 2. Clock skew: staleness is this host's monotonic clock watching the record, never another host's timestamp.

def _beating(workdir, stop: threading.Event, **fields):
  """Another host's run renewing its lease every 20 ms, its heartbeat stamped by the real clock."""
  clock = time.time

  def beat():
    for beats in range(10**6):
      record = {'host': 'elsewhere', 'pid': 7, 'process_id': 0, 'processes': 1, 'token': 'other', 'beats': beats,
                'heartbeat': clock(), **fields}
      files.write_text_atomic(workdir / lease.NAME, json.dumps(record))
      if stop.wait(0.02):
        return
  thread = threading.Thread(target=beat, daemon=True)
  thread.start()
  while not (workdir / lease.NAME).exists():
    time.sleep(0.01)
  return thread


def test_a_live_holder_is_refused_by_a_reader_whose_clock_is_ahead(tmp_path, monkeypatch):
  stop = threading.Event()
  thread = _beating(tmp_path, stop)
  try:
    clock = time.time
    monkeypatch.setattr(time, 'time', lambda: clock() + 90)  # this host's clock, 90 s ahead of the holder's
    with pytest.raises(lease.Held, match='on host elsewhere; its heartbeat moved while this run watched it'):
      lease.Lease(tmp_path).acquire()
  finally:
    stop.set()
    thread.join()


def test_a_dead_holder_whose_clock_was_ahead_does_not_block_the_workdir(tmp_path, capsys):
  _holder(tmp_path, host='elsewhere', heartbeat=time.time() + 3600)  # stamped an hour ahead of this host
  taken = lease.Lease(tmp_path, stale_s=0.2).acquire()
  taken.release()
  err = capsys.readouterr().err
  assert 'its heartbeat did not move in 0 s' in err and ' -' not in err  # no negative age


# 3. The fence: a run whose lease another run took stops before its next write.

def test_the_fence_stops_a_run_whose_lease_was_taken_over(tmp_path):
  held = lease.Lease(tmp_path, heartbeat_s=3600).acquire()
  fence = lease.fence(held)
  fence()
  _holder(tmp_path, host='elsewhere', pid=7, token='later')  # taken over while this run was stopped
  fence(reread=False)  # the heartbeat has not looked yet: steps go on
  with pytest.raises(lease.Lost, match=r'no longer holds its lease \(lease.json\): now process 0 of 1 \(pid 7\) '
                                       'on host elsewhere'):
    fence()  # before a write: lease.json read now
  with pytest.raises(lease.Lost):
    fence(reread=False)  # and at every step boundary after
  held.release()
  assert _token(tmp_path) == 'later'  # not removed: the other run's


def test_the_heartbeat_notices_a_takeover_and_stops_renewing(tmp_path, capsys):
  held = lease.Lease(tmp_path, heartbeat_s=0.02).acquire()
  (tmp_path / lease.NAME).unlink()  # removed: whoever did, this run no longer holds the workdir
  deadline = time.monotonic() + 30
  while held.lost is None:
    assert time.monotonic() < deadline, 'the heartbeat did not notice'
    time.sleep(0.02)
  with pytest.raises(lease.Lost, match=r'now no one \(it was removed\)'):
    lease.fence(held)(reread=False)  # the loop's check at a step boundary
  held.release()
  assert not (tmp_path / lease.NAME).exists()  # not written again
  assert not capsys.readouterr().err  # the loop says it, once, as it stops


def test_every_process_stops_before_a_collective_save_where_process_zero_lost_the_lease():
  lease.fence(None, processes=2, agree=lambda lost: False)(every_process=True)
  with pytest.raises(lease.Lost, match='as process 0 found'):
    lease.fence(None, processes=2, agree=lambda lost: True)(every_process=True)


@pytest.mark.slow
def test_a_run_taken_over_mid_run_logs_and_saves_nothing_more(tmp_path, monkeypatch):
  """Another run takes the workdir over after step 3 is logged: step 4 is not logged, checkpoint 4 not saved, and the
  temporary file of a write a kill cut short in an earlier run is gone."""
  workdir = tmp_path / 'run'
  workdir.mkdir()
  (workdir / '.config.json.k1ll3d.tmp').write_text('{"torn": ')
  write = metrics_log.MetricsLog.write

  def write_then_lose(log, step, values):
    write(log, step, values)
    if step == 3:
      _holder(workdir, host='elsewhere', token='later')
  monkeypatch.setattr(metrics_log.MetricsLog, 'write', write_then_lose)
  config = load_config(SPEC, {**TINY_LM, 'steps': 6, 'checkpoint_every': 2})
  with pytest.raises(lease.Lost, match='now process 0 of 1 .* on host elsewhere'):
    train.train(config, str(workdir), devices=jax.devices()[:1], hold_lease=True)
  assert [r['step'] for r in metrics(workdir)] == [1, 2, 3]
  assert checkpoint_steps(workdir) == {2}
  assert not (workdir / 'final.json').exists() and _token(workdir) == 'later'
  assert not list(workdir.glob('.*.tmp'))


# 4. A damaged lease file is one line: a takeover notice, or an error naming it.

@pytest.mark.parametrize('content, why', [
    (b'\x00\xff\xfegarbage', "not JSON: b'\\x00\\xff\\xfegarbage'"),
    (b'[]', 'not a JSON object but list'),
    (b'{"pid": 12}', 'no token names its holder'),
    (b'{"token": "x", "host": "h", "heartbeat": "soon"}', "its field heartbeat='soon' has the wrong type"),
    (b'{"token": "x", "pid": "12"}', "its field pid='12' has the wrong type"),
])
def test_a_damaged_lease_is_taken_over_with_one_line(tmp_path, capsys, content, why):
  (tmp_path / lease.NAME).write_bytes(content)
  taken = lease.Lease(tmp_path).acquire()
  taken.release()
  err = capsys.readouterr().err
  assert err == f'lease: taking over {tmp_path / lease.NAME} from a damaged lease: it is damaged ({why})\n'


def test_a_directory_in_the_leases_place_is_one_line(tmp_path):
  (tmp_path / lease.NAME).mkdir()
  with pytest.raises(config_lib.InputError, match=r'lease.json cannot be taken: EISDIR \(Is a directory\): .*; it is '
                                                  'a directory: remove it'):
    lease.Lease(tmp_path).acquire()


def test_a_holder_is_never_described_with_none(tmp_path):
  assert lease.describe({'token': 'x'}) == 'a process on an unnamed host'


def test_every_process_stops_in_one_line_where_process_zero_cannot_write_the_lease(tmp_path):
  with pytest.raises(config_lib.InputError, match='process 0 could not take its lease'):
    with lease.held(tmp_path, process_id=1, processes=2, agree=lambda code: 2):
      pass


# 5. Storage that refuses writes: one line naming the cause and the path, at start and at the end.

@pytest.mark.parametrize('code', [errno.ENOSPC, errno.EROFS, errno.EACCES])
def test_a_lease_that_cannot_be_written_at_start_is_one_line(tmp_path, monkeypatch, code):
  def refused(path, *_, **__):
    raise OSError(code, os.strerror(code), str(path))
  monkeypatch.setattr(files, 'write_bytes_atomic', refused)
  with pytest.raises(config_lib.InputError) as error:
    lease.Lease(tmp_path).acquire()
  assert str(error.value) == (f'--workdir={str(tmp_path)!r}: lease.json cannot be taken: {errno.errorcode[code]} '
                              f'({os.strerror(code)}): {tmp_path / lease.NAME}')


def test_a_workdir_turned_read_only_does_not_fail_the_release(tmp_path, monkeypatch, capsys):
  held = lease.Lease(tmp_path, heartbeat_s=3600).acquire()

  def read_only(*_):
    raise OSError(errno.EROFS, 'Read-only file system', str(tmp_path / lease.NAME))
  monkeypatch.setattr(type(held.path), 'unlink', read_only)
  held.release()
  assert capsys.readouterr().err == (f'warning: {tmp_path / lease.NAME}: not removed: EROFS (Read-only file system): '
                                     f'{tmp_path / lease.NAME}; the next run takes it over (this process is gone)\n')


FAILING_RUN = ('import errno, sys\nfrom laurel import main, train\nfrom laurel.run import lease\nworkdir = sys.argv[1]\n'
               'def train_failing(*_, **__):\n'
               '  raise {}\n'
               'train.train = train_failing\n'
               f'sys.argv = ["laurel", "--config={ROOT / SPEC}", "--workdir=" + workdir]\n'
               'main.run()\n')


@pytest.mark.slow
@pytest.mark.parametrize('raised, status, line', [
    ('lease.Lost("--workdir=\'w\': this run no longer holds its lease")', 6,  # docs/training.md's statuses
     "error: --workdir='w': this run no longer holds its lease"),
    ('OSError(errno.EROFS, "Read-only file system", workdir + "/metrics.jsonl")', 74,
     'error: a write failed: EROFS (Read-only file system): {w}/metrics.jsonl; rerun the same command to resume once '
     'it is writable'),
])
def test_a_lost_lease_and_a_refused_write_exit_with_their_status_and_one_line(tmp_path, raised, status, line):
  result = subprocess.run([sys.executable, '-c', FAILING_RUN.format(raised), str(tmp_path)], env=cli_env(), cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
  assert result.returncode == status, result.stderr[-2000:]
  assert result.stderr.strip().splitlines() == [line.format(w=tmp_path)]


# 6. A kill inside the first config.json write records its history entry once.

def test_a_kill_between_the_history_and_config_writes_records_the_entry_once(tmp_path, monkeypatch):
  config = typed_config(SPEC, TINY_LM)
  write = checkpoint.write_text_atomic

  def killed_at_config(path, text):
    if path.name == 'config.json':
      raise KeyboardInterrupt
    write(path, text)
  monkeypatch.setattr(checkpoint, 'write_text_atomic', killed_at_config)
  with pytest.raises(KeyboardInterrupt):
    checkpoint.guard_config(config, tmp_path)
  monkeypatch.setattr(checkpoint, 'write_text_atomic', write)
  checkpoint.guard_config(config, tmp_path)  # the rerun
  assert (tmp_path / 'config.json').exists()
  assert len((tmp_path / 'config_history.jsonl').read_text().splitlines()) == 1
