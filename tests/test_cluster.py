"""Clusters (issue 39): which environment names how many processes, one line where they cannot join, JAX's own abort
where a peer never joins or dies (issue 58), and the sbatch script's requeue policy. Two processes joined by flags
train as one process does: tests/test_train.py::test_two_processes_match_one_process_with_eight_devices; the
workdir's lock: tests/test_lock.py."""
import os
import signal
import subprocess
import time

import pytest

from helpers import ROOT, TINY_LM, cli_args, cli_env, cluster_env, free_port
from laurel.cli import process
from laurel.run import cluster

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
  monkeypatch.setattr(cluster, '_initialize', lambda found, **arguments: passed.update(arguments))
  with pytest.raises(SystemExit):  # nothing joined here: jax counts 1 process of the 4 named
    cluster.join(None, None, None)
  assert passed == {'num_processes': 4, 'process_id': 3, 'local_device_ids': want_ids,
                    'cluster_detection_method': 'deactivate', 'initialization_timeout': cluster.JOIN_TIMEOUT_S,
                    'heartbeat_timeout_seconds': cluster.HEARTBEAT_TIMEOUT_S}


JAX_ABORT = 'Terminating process because the JAX distributed service detected fatal errors'


@pytest.mark.slow
@pytest.mark.process
@pytest.mark.parametrize('launcher, line', [
    ('srun', None),  # jax waits for process 1, then aborts (Open MPI 5's arguments to it: the test above)
    ('batch_shell', 'error: SLURM_NTASKS=2: Slurm names 2 processes, but jax.distributed.initialize() could not join'),
    ('mpirun5_without_address', 'error: OMPI_COMM_WORLD_SIZE=2: Open MPI names 2 processes, but '
     'jax.distributed.initialize() could not join them')])
def test_a_process_whose_peer_never_starts_stops_before_anything_is_written(tmp_path, launcher, line):
  """Process 0 of 2 started alone. srun's step: jax waits --join_timeout for process 1, then aborts the process itself
  (SIGABRT, its C++ stack). A Slurm batch script's shell (no SLURM_STEP_NODELIST) and Open MPI 5 without an address:
  jax finds no coordinator, and the run stops at once with one line (status 1). Either way nothing is compiled or
  written."""
  port = free_port()
  env = cluster_env('slurm' if launcher in ('srun', 'batch_shell') else 'ompi', 0, 2, port)
  if launcher == 'batch_shell':
    del env['SLURM_STEP_NODELIST']
  if launcher == 'mpirun5_without_address':  # Open MPI 5 (PMIx) sets no orte URI
    del env['OMPI_MCA_orte_hnp_uri']
  result = subprocess.run(cli_args(SPEC, tmp_path / 'run', TINY_LM) + ['--join_timeout=1'], env=env,
                          capture_output=True, text=True, timeout=120)
  if line is None:
    assert result.returncode == -signal.SIGABRT and JAX_ABORT in result.stderr, result.stderr[-2000:]
  else:
    errors = [l for l in result.stderr.splitlines() if l.startswith('error:')]
    assert result.returncode == process.ERROR and len(errors) == 1 and errors[0].startswith(line), result.stderr
    assert 'Traceback' not in result.stderr
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


@pytest.mark.slow
@pytest.mark.process
def test_a_peer_that_dies_is_found_by_jax_which_aborts_the_other_process(tmp_path):
  """Two processes as srun starts them (its variables, a localhost coordinator) join and train; process 1, killed in
  the loop, misses JAX's coordination service's heartbeat for --heartbeat_timeout seconds, and the service aborts
  process 0 with its own lines (docs/clusters.md), a status the schedulers restart (SIGABRT)."""
  overrides = {**TINY_LM, 'steps': 100_000, 'checkpoint_every': 100_000, 'eval_every': 100_000, 'data_shards': 2}
  port, outs = free_port(), [tmp_path / f'process_{i}.out' for i in range(2)]
  command = cli_args(SPEC, tmp_path / 'run', overrides) + ['--heartbeat_timeout=5']
  procs = []
  for i, out in enumerate(outs):
    with out.open('w') as f:  # files: a pipe left unread would stall a run
      procs.append(subprocess.Popen(command, env=cluster_env('slurm', i, 2, port), stdout=f, stderr=subprocess.STDOUT))
  deadline = time.time() + 240
  while 'step 3/' not in outs[0].read_text():
    assert all(p.poll() is None for p in procs) and time.time() < deadline, outs[0].read_text()[-2000:]
    time.sleep(0.1)
  procs[1].kill()
  assert procs[0].wait(timeout=120) == -signal.SIGABRT, outs[0].read_text()[-3000:]
  for i, out in enumerate(outs):
    first_line = out.read_text().partition('\n')[0]
    assert first_line.startswith(f'cluster: Slurm (SLURM_NTASKS=2): process {i} of 2 on '), first_line
    assert first_line.endswith(', 1 of 2 cpu devices'), first_line
  text = outs[0].read_text()
  assert JAX_ABORT in text and 'stopped sending heartbeats' in text, text[-3000:]


@pytest.mark.parametrize('code, restarts, requeued', [(0, 0, False), (42, 0, True), (1, 3, True), (134, 0, True),
                                                       (130, 0, True), (2, 0, False), (3, 0, False), (42, 20, False)])
def test_the_sbatch_script_requeues_only_what_a_rerun_can_fix(tmp_path, code, restarts, requeued):
  """scripts/slurm_train.sbatch with srun and scontrol stubbed: srun gets laurel.main and every argument; the job is
  requeued on 1 (an error: a hang, a failed join or save), 42 and 128+N (a peer's death aborts the others), up to
  MAX_RESTARTS times, and ends with laurel.main's status otherwise (2 bad input, 3 diverged)."""
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
