"""Clusters (issue 39): which environment names how many processes, one line where they do not all join, and the
workdir lease that refuses a second, uncoordinated run. Two processes joined as srun and mpirun start them:
tests/test_train.py::test_two_processes_match_one_process_with_eight_devices; a SIGKILLed run's rerun taking the
lease over at once: test_resume_after_sigkill_matches_uninterrupted_run."""
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from helpers import ROOT, TINY_LM, cli_args, cli_env, cluster_env, fake_gcs_env, free_port, losses, metrics, run_cli
from laurel.run import cluster, lease, process

SPEC = 'configs/c4_ablation.py:rw_lr_pa,preset=tiny'


@pytest.mark.parametrize('environ, name, processes, source', [
    ({'SLURM_JOB_ID': '7', 'SLURM_NTASKS': '16', 'SLURM_PROCID': '3'}, 'Slurm', 16, 'SLURM_NTASKS=16'),
    ({'SLURM_JOB_ID': '7'}, 'Slurm', 1, 'SLURM_NPROCS=unset'),  # a batch script's shell without --ntasks
    ({'OMPI_COMM_WORLD_SIZE': '4', 'SLURM_JOB_ID': '7', 'SLURM_NTASKS': '1'}, 'Open MPI', 4,
     'OMPI_COMM_WORLD_SIZE=4'),  # mpirun inside a Slurm allocation: jax checks Open MPI first too
    ({'JOB_COMPLETION_INDEX': '2', 'KUBERNETES_SERVICE_HOST': '10.0.0.1'}, 'Kubernetes Indexed Job', None,
     'JOB_COMPLETION_INDEX=2'),
    ({'JOB_COMPLETION_INDEX': '2'}, None, None, None),  # not in a pod
    ({}, None, None, None),
])
def test_detect_names_the_environment_and_its_process_count(monkeypatch, environ, name, processes, source):
  monkeypatch.setattr(cluster, 'on_tpu_vm', lambda: False)  # also where the tests run on a TPU VM
  found = cluster.detect(environ)
  assert (found and (found.name, found.processes, found.source)) == (name and (name, processes, source))


@pytest.mark.parametrize('environ, ids', [
    ({'SLURM_JOB_ID': '7', 'SLURM_STEP_TASKS_PER_NODE': '8(x2)', 'SLURM_NODEID': '1'}, None),  # one GPU each
    ({'SLURM_JOB_ID': '7', 'SLURM_STEP_TASKS_PER_NODE': '1(x4)', 'SLURM_NODEID': '3'}, []),  # one task drives 8
    ({'SLURM_JOB_ID': '7', 'SLURM_TASKS_PER_NODE': '2(x3),1', 'SLURM_NODEID': '3'}, []),
    ({'SLURM_JOB_ID': '7', 'SLURM_TASKS_PER_NODE': '2(x3),1', 'SLURM_NODEID': '2'}, None),
    ({'SLURM_JOB_ID': '7', 'SLURM_STEP_TASKS_PER_NODE': '8', 'CUDA_VISIBLE_DEVICES': '5'}, []),  # --gpus-per-task=1
    ({'OMPI_COMM_WORLD_LOCAL_SIZE': '1'}, []),
    ({'OMPI_COMM_WORLD_LOCAL_SIZE': '8'}, None),
])
def test_local_device_ids_keep_every_gpu_of_a_process_that_drives_its_node(environ, ids):
  assert cluster.local_device_ids(environ) == ids


@pytest.mark.parametrize('local_size, want_ids', [('2', [1]), ('1', [])])
def test_open_mpi_5_gives_jax_all_it_would_detect(monkeypatch, local_size, want_ids):
  """Open MPI 5 sets no OMPI_MCA_orte_hnp_uri: the run passes the process count, rank and local rank's device, and
  turns jax's detection off (jax 0.11 asks mpi4py there and stops without it)."""
  for name in [n for n in os.environ if n.startswith(('OMPI_', 'SLURM_', 'CUDA_VISIBLE'))]:
    monkeypatch.delenv(name)
  for name, value in {'OMPI_COMM_WORLD_SIZE': '4', 'OMPI_COMM_WORLD_RANK': '3', 'OMPI_COMM_WORLD_LOCAL_RANK': '1',
                      'OMPI_COMM_WORLD_LOCAL_SIZE': local_size}.items():
    monkeypatch.setenv(name, value)
  passed = {}
  monkeypatch.setattr(cluster, '_initialize', lambda found, timeout_s, **arguments: passed.update(arguments))
  with pytest.raises(SystemExit):  # nothing joined here: jax counts 1 process of the 4 named
    cluster.join(None, None, None)
  assert passed == {'num_processes': 4, 'process_id': 3, 'local_device_ids': want_ids,
                    'cluster_detection_method': 'deactivate'}


@pytest.mark.slow
@pytest.mark.parametrize('launcher, first_words, reason', [
    ('srun', 'SLURM_NTASKS=2: Slurm names 2', 'did not all join within 1 s (coordinator localhost:'),
    ('batch_shell', 'SLURM_NTASKS=2: Slurm names 2', 'could not join them'),
    ('mpirun5', 'OMPI_COMM_WORLD_SIZE=2: Open MPI names 2', 'did not all join within 1 s (coordinator localhost:'),
    ('mpirun5_without_address', 'OMPI_COMM_WORLD_SIZE=2: Open MPI names 2', 'JAX_COORDINATOR_ADDRESS=HOST:PORT')],
    ids=['srun', 'batch_shell', 'mpirun5', 'mpirun5_without_address'])
def test_a_process_whose_peer_never_starts_fails_in_one_line(tmp_path, launcher, first_words, reason):
  """Process 0 of 2 started alone. srun's step and Open MPI 5 with JAX_COORDINATOR_ADDRESS: jax waits for process 1,
  and the run gives up after --join_timeout. A Slurm batch script's shell (no SLURM_STEP_NODELIST) and Open MPI 5
  without an address: jax finds no coordinator, at once. Either way: exit 4 and one line, before anything is compiled
  or written."""
  port = free_port()
  env = cluster_env('slurm' if launcher in ('srun', 'batch_shell') else 'ompi', 0, 2, port)
  if launcher == 'batch_shell':
    del env['SLURM_STEP_NODELIST']
  if launcher.startswith('mpirun5'):  # Open MPI 5 (PMIx) sets no orte URI
    del env['OMPI_MCA_orte_hnp_uri']
  if launcher == 'mpirun5':
    env['JAX_COORDINATOR_ADDRESS'] = f'localhost:{port}'
  # jax alone would wait its 300 s, then abort with a C++ stack
  result = subprocess.run(cli_args(SPEC, tmp_path / 'run', TINY_LM) + ['--join_timeout=1'], env=env,
                          capture_output=True, text=True, timeout=120)
  assert result.returncode == cluster.PEER_LOST, result.stderr[-2000:]
  errors = [l for l in result.stderr.splitlines() if l.startswith('error:')]
  assert len(errors) == 1 and errors[0].startswith(f'error: {first_words} processes') and reason in errors[0], errors
  assert 'Traceback' not in result.stderr and 'Check failure' not in result.stderr
  assert not (tmp_path / 'run').exists()


@pytest.mark.parametrize('environ, flag, status', [
    ({'SLURM_JOB_ID': '7', 'SLURM_NTASKS': '2'}, None, 42),  # sbatch requeues 42; 0 would end the job unfinished
    ({'JOB_COMPLETION_INDEX': '0', 'KUBERNETES_SERVICE_HOST': '10.0.0.1'}, None, 42),
    ({'OMPI_COMM_WORLD_SIZE': '2'}, None, 42),
    ({'SLURM_JOB_ID': '7'}, 0, 0),  # an explicit --preempted_exit wins
    ({}, None, 0),  # a shell: Ctrl-C saves and exits 0
    ({}, 42, 42),
])
def test_a_stopped_run_exits_42_under_a_scheduler_unless_told_otherwise(monkeypatch, environ, flag, status):
  monkeypatch.setattr(cluster, 'on_tpu_vm', lambda: False)
  assert cluster.preempted_exit(flag, environ) == status


class _KeyValueStore:
  """The coordinator's key-value store as jax's client offers it; `down` makes every call fail."""

  def __init__(self):
    self.values, self.down = {}, False

  def key_value_set(self, key, value, allow_overwrite=False):
    assert allow_overwrite
    if self.down:
      raise RuntimeError('UNAVAILABLE: failed to connect')
    self.values[key] = value

  def key_value_dir_get(self, prefix):
    if self.down:
      raise RuntimeError('UNAVAILABLE: failed to connect')
    return [(k, v) for k, v in self.values.items() if k.startswith(prefix)]


def _watch_until_it_ends(store, process_id=0, beat_of_peer=None, seconds=10.0):
  """Process `process_id` of 2 watching; the peer beats through `beat_of_peer(beat)` (returns False: it stops)."""
  ended = []
  watch = cluster.PeerWatch(store, process_id, 2, timeout_s=0.4, beat_s=0.05, end=ended.append).start()
  peer = 1 - process_id
  store.key_value_set(f'{watch.PREFIX}who/{peer}', 'pid 77 on host node-b', allow_overwrite=True)
  deadline, beat = time.monotonic() + seconds, 0
  while not ended and time.monotonic() < deadline:
    beat += 1
    if beat_of_peer is None or beat_of_peer(beat):
      store.key_value_set(f'{watch.PREFIX}beat/{peer}', str(beat), allow_overwrite=True)
    time.sleep(0.02)
  watch.finished.set()
  return ended


def test_a_peer_that_stops_beating_ends_the_run_in_one_line_naming_it(capsys):
  ended = _watch_until_it_ends(_KeyValueStore(), beat_of_peer=lambda beat: beat < 20)
  assert ended == [cluster.PEER_LOST]
  lines = capsys.readouterr().err.splitlines()
  assert len(lines) == 1 and lines[0].startswith('error: lost process 1 of 2 (pid 77 on host node-b): no beat for '
                                                 '0.4 s; it died, or its host did. Process 0 ends too'), lines


@pytest.mark.slow
def test_a_peer_that_beats_or_finished_is_never_lost(capsys):
  assert not _watch_until_it_ends(_KeyValueStore(), seconds=1.5)
  store = _KeyValueStore()
  assert not _watch_until_it_ends(store, beat_of_peer=lambda beat: beat < 5 or store.values.update(
      {'laurel/peers/beat/1': 'done'}), seconds=1.5)
  assert capsys.readouterr().err == ''


def test_a_coordinator_that_stops_answering_is_process_0_lost(capsys):
  store = _KeyValueStore()
  ended = _watch_until_it_ends(store, process_id=1, beat_of_peer=lambda beat: beat < 10 or setattr(store, 'down', True))
  assert ended == [cluster.PEER_LOST]
  assert capsys.readouterr().err.startswith('error: lost process 0 of 2: the coordinator does not answer')


@pytest.mark.slow
def test_a_peer_that_dies_ends_the_other_process_in_one_line_naming_it(tmp_path):
  """Process 1 of a two-process Slurm run killed in the loop: process 0, whose collective fails, ends with one line
  naming process 1 and status 4 (jax alone: a traceback, then 54-100 s later an abort with a C++ stack)."""
  overrides = {**TINY_LM, 'steps': 100_000, 'checkpoint_every': 100_000, 'eval_every': 100_000, 'data_shards': 2}
  port, outs = free_port(), [tmp_path / f'process_{i}.out' for i in range(2)]
  # laurel.main where a peer silent for 5 s is lost, not 20 (cluster.PEER_TIMEOUT_S): this test waits that long.
  quick = ('import sys; from laurel.run import cluster; cluster.PEER_TIMEOUT_S, cluster.PEER_BEAT_S = 5.0, 0.5; '
           'from laurel.main import run; sys.argv[0] = "laurel.main"; run()')
  command = [sys.executable, '-c', quick, *cli_args(SPEC, tmp_path / 'run', overrides)[3:]]
  procs = []
  for i, out in enumerate(outs):
    with out.open('w') as f:  # files: a pipe left unread would stall a run
      procs.append(subprocess.Popen(command, env=cluster_env('slurm', i, 2, port), stdout=f, stderr=subprocess.STDOUT))
  try:
    deadline = time.time() + 240
    while 'step 3/' not in outs[0].read_text():
      assert all(p.poll() is None for p in procs) and time.time() < deadline, outs[0].read_text()[-2000:]
      time.sleep(0.1)
    procs[1].kill()
    assert procs[0].wait(timeout=120) == cluster.PEER_LOST, outs[0].read_text()[-3000:]
  finally:
    for p in procs:
      p.kill()
  text = outs[0].read_text()
  errors = [l for l in text.splitlines() if l.startswith('error:')]
  assert len(errors) == 1 and errors[0].startswith('error: lost process 1 of 2 (pid '), text[-3000:]
  assert 'Traceback' not in text and 'Fatal Python error' not in text and 'Check failure' not in text


def _dead_pid() -> int:
  child = subprocess.Popen([sys.executable, '-c', 'pass'])
  child.wait()
  return child.pid


def _write_holder(workdir, **fields):
  record = {'host': socket.gethostname(), 'pid': os.getpid(), 'process_id': 0, 'processes': 2,
            'started_at': '2026-01-01T00:00:00+00:00', 'heartbeat': time.time(), 'token': 'other', **fields}
  (workdir / lease.NAME).write_text(json.dumps(record))


def test_a_live_lease_refuses_a_second_run_naming_its_holder(tmp_path):
  first = lease.Lease(tmp_path, heartbeat_s=0.02).acquire()
  try:
    with pytest.raises(lease.Held) as held:
      lease.Lease(tmp_path).acquire()
    assert f'(pid {os.getpid()}) on host {socket.gethostname()}, started {first.record["started_at"]}' in str(
        held.value)
    first.record.update(host='elsewhere', pid=_dead_pid(), processes=2)  # a pid on another host says nothing here
    first._write()  # pylint: disable=protected-access  # now, not at its next beat
    with pytest.raises(lease.Held, match='process 0 of 2 .* on host elsewhere, started .*heartbeat moved'):
      lease.Lease(tmp_path).acquire()
  finally:
    first.release()


@pytest.mark.parametrize('holder, environ, reason', [
    ({'host': 'elsewhere'}, {}, 'its heartbeat did not move in 0 s'),
    ({'pid': 'dead'}, {}, 'is gone from this host'),
    ({'host': 'elsewhere', 'slurm_job': '9', 'slurm_restart': 0}, {'SLURM_JOB_ID': '9', 'SLURM_RESTART_COUNT': '1'},
     'an earlier run of Slurm job 9 (requeued)'),
])
def test_a_lease_is_taken_over_where_its_holder_is_gone(tmp_path, monkeypatch, capsys, holder, environ, reason):
  for k, v in environ.items():
    monkeypatch.setenv(k, v)
  _write_holder(tmp_path, **{**holder, **({'pid': _dead_pid()} if holder.get('pid') == 'dead' else {})})
  taken = lease.Lease(tmp_path, stale_s=0.2).acquire()
  try:
    assert reason in capsys.readouterr().err
    assert json.loads((tmp_path / lease.NAME).read_text())['token'] == taken.record['token']
  finally:
    taken.release()
  assert not (tmp_path / lease.NAME).exists()


def test_without_hard_links_a_lease_is_written_and_read_back(tmp_path, monkeypatch):
  def no_links(*_):
    raise PermissionError('hard links not supported')
  monkeypatch.setattr(lease.os, 'link', no_links)
  held = lease.Lease(tmp_path).acquire()
  with pytest.raises(lease.Held):
    lease.Lease(tmp_path).acquire()
  held.release()
  assert not (tmp_path / lease.NAME).exists() and not list(tmp_path.iterdir())  # no temporary left


@pytest.mark.slow
def test_a_lease_on_gs_is_held_refused_and_released(tmp_path):
  """gs:// through the tests' local fake (tests/fake_gcs): no exclusive create, so the lease is read back."""
  code = ('from etils import epath\nfrom laurel.run import lease\n'
          'workdir = epath.Path("gs://bucket/run")\n'
          'held = lease.Lease(workdir).acquire()\n'
          'try:\n  lease.Lease(workdir).acquire()\nexcept lease.Held as e:\n  print(e)\n'
          'held.release()\nprint("released", (workdir / lease.NAME).exists())\n')
  (tmp_path / 'bucket' / 'run').mkdir(parents=True)
  result = subprocess.run([sys.executable, '-c', code], env=fake_gcs_env(tmp_path), capture_output=True, text=True,
                          timeout=120)
  assert result.returncode == 0, result.stderr[-2000:]
  assert "--workdir='gs://bucket/run': held by a live run: process 0 of 1" in result.stdout
  assert result.stdout.endswith('released False\n') and not list((tmp_path / 'bucket' / 'run').iterdir())


def test_same_slurm_job_in_the_same_incarnation_is_refused(tmp_path, monkeypatch):
  """Two sruns of one job on one workdir are uncoordinated too; only a requeued job's later incarnation takes over."""
  monkeypatch.setenv('SLURM_JOB_ID', '9')
  monkeypatch.setenv('SLURM_RESTART_COUNT', '1')
  holder = lease.Lease(tmp_path, heartbeat_s=0.02)
  holder.record['host'] = 'elsewhere'
  holder.acquire()
  with pytest.raises(lease.Held, match='Slurm job 9'):
    lease.Lease(tmp_path).acquire()
  holder.release()


def test_the_heartbeat_renews_the_lease_and_release_leaves_another_holder_alone(tmp_path):
  held = lease.Lease(tmp_path, heartbeat_s=0.02).acquire()
  first = json.loads((tmp_path / lease.NAME).read_text())['heartbeat']
  deadline = time.time() + 30
  while json.loads((tmp_path / lease.NAME).read_text())['heartbeat'] == first:
    assert time.time() < deadline, 'no heartbeat'
    time.sleep(0.02)
  held.release()
  assert not (tmp_path / lease.NAME).exists()
  held = lease.Lease(tmp_path, heartbeat_s=3600).acquire()
  _write_holder(tmp_path)  # taken over while this run was stopped for longer than the stale limit
  held.release()
  assert json.loads((tmp_path / lease.NAME).read_text())['token'] == 'other'


def test_only_process_zero_holds_the_lease_and_every_process_is_refused_with_it(tmp_path):
  told = []
  with lease.held(tmp_path, process_id=1, processes=2, agree=lambda flag: told.append(flag) or False) as none:
    assert none is None and not (tmp_path / lease.NAME).exists() and told == [False]
  with lease.held(tmp_path, process_id=0, processes=2, agree=lambda flag: flag):
    assert json.loads((tmp_path / lease.NAME).read_text())['processes'] == 2
    with pytest.raises(lease.Held, match='held by a live run'):  # process 0 of another run
      with lease.held(tmp_path, process_id=0, processes=2, agree=told.append):
        pass
    assert told == [False, True]
    with pytest.raises(lease.Held, match='as process 0 found'):  # process 1 of that run, told by process 0
      with lease.held(tmp_path, process_id=1, processes=2, agree=lambda flag: True):
        pass
  assert not (tmp_path / lease.NAME).exists()


@pytest.mark.slow
def test_a_second_run_on_a_held_workdir_is_refused_and_the_first_ends_unharmed(tmp_path):
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

  wait_for(lambda: (workdir / lease.NAME).exists())  # taken before compiling
  second = run_cli(SPEC, workdir, {**overrides, 'steps': 99_999})
  assert second.returncode == process.HELD, second.stderr[-2000:]
  assert second.stderr.count('\n') == 1 and second.stderr.startswith('error: --workdir=')
  assert f'held by a live run: process 0 of 1 (pid {first.pid}) on host {socket.gethostname()}' in second.stderr
  assert 'compiling' not in second.stdout + second.stderr

  wait_for(lambda: (workdir / 'metrics.jsonl').exists() and max(losses(workdir), default=0) >= 3)
  first.send_signal(signal.SIGTERM)
  assert first.wait(timeout=120) == 42, out.read_text()[-2000:]
  assert 'preempted (SIGTERM): saved checkpoint' in out.read_text(), out.read_text()[-2000:]
  logged = metrics(workdir)
  assert [r['step'] for r in logged] == list(range(1, len(logged) + 1))  # every step once: one writer
  assert json.loads((workdir / 'config.json').read_text())['steps'] == 100_000  # not the second run's
  assert not (workdir / lease.NAME).exists()


@pytest.mark.parametrize('code, restarts, requeued', [(0, 0, False), (42, 0, True), (4, 0, True), (75, 3, True),
                                                       (134, 0, True), (1, 0, False), (2, 0, False), (5, 0, False),
                                                       (42, 20, False)])
def test_the_sbatch_script_requeues_only_what_a_rerun_can_fix(tmp_path, code, restarts, requeued):
  """scripts/slurm_train.sbatch with srun and scontrol stubbed: srun gets laurel.main and every argument; the job is
  requeued on 4, 42, 75 and 128+N, up to MAX_RESTARTS times, and ends with laurel.main's status otherwise."""
  bin_dir, calls = tmp_path / 'bin', tmp_path / 'calls'
  bin_dir.mkdir()
  for name, status in [('srun', code), ('scontrol', 0)]:
    (bin_dir / name).write_text(f'#!/bin/sh\necho "{name} $*" >> "{calls}"\nexit {status}\n')
    (bin_dir / name).chmod(0o755)
  env = {**cli_env(), 'PATH': f'{bin_dir}{os.pathsep}{os.environ["PATH"]}', 'SLURM_JOB_ID': '31',
         'SLURM_RESTART_COUNT': str(restarts), 'SLURM_SUBMIT_DIR': str(ROOT), 'PYTHON': 'python3'}
  result = subprocess.run(['bash', str(ROOT / 'scripts' / 'slurm_train.sbatch'), '--config=c4_ablation:rw',
                           '--workdir=/shared/runs/rw'], env=env, capture_output=True, text=True, timeout=60)
  lines = calls.read_text().splitlines()
  assert lines[0] == ('srun --kill-on-bad-exit=1 python3 -m laurel.main --preempted_exit=42 --config=c4_ablation:rw '
                      '--workdir=/shared/runs/rw')
  assert lines[1:] == (['scontrol requeue 31'] if requeued else []), result.stdout
  assert result.returncode == (0 if requeued else code), result.stdout
