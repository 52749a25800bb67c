"""Joins this process to the rest of its run through JAX's cluster detection (docs/clusters.md). Where the environment
names several processes and joining fails, the run ends with one line and PEER_LOST rather than train alone."""

import dataclasses
import glob
import os
import re
import socket
import sys
import threading
import time
import urllib.request

import jax
from absl import logging

from laurel import config_lib
from laurel.run import console, files, process
from laurel.run.process import PEER_LOST, PREEMPTED

JOIN_TIMEOUT_S = 300  # jax's own default
PEER_TIMEOUT_S = 20.0  # a peer silent this long is lost (jax waits for its 100 s heartbeat timeout, then aborts)
PEER_BEAT_S = 2.0


@dataclasses.dataclass(frozen=True)
class Environment:
  name: str
  processes: int | None  # as the environment names them; None where only jax can tell (Kubernetes)
  source: str  # the variable read, as NAME=value
  fix: str  # what to do where joining fails


def detect(environ=None) -> Environment | None:
  """The cluster this process runs in, from its variables alone (nothing started, nothing asked)."""
  env = os.environ if environ is None else environ
  if 'OMPI_COMM_WORLD_SIZE' in env:
    fix = ('start every rank with mpirun; Open MPI 5 sets no OMPI_MCA_orte_hnp_uri, from which jax finds the '
           'coordinator: there set JAX_COORDINATOR_ADDRESS=HOST:PORT, HOST being rank 0\'s (mpirun -x)')
    return Environment('Open MPI', _count(env, 'OMPI_COMM_WORLD_SIZE'),
                       f'OMPI_COMM_WORLD_SIZE={env["OMPI_COMM_WORLD_SIZE"]}', fix)
  if 'SLURM_JOB_ID' in env:
    tasks = 'SLURM_NTASKS' if 'SLURM_NTASKS' in env else 'SLURM_NPROCS'
    fix = ('start one process per task with srun (srun python -m laurel.main ...), all tasks at once; a batch '
           "script's shell is one process (srun --ntasks=1 trains as one)")
    return Environment('Slurm', _count(env, tasks) if tasks in env else 1, f'{tasks}={env.get(tasks, "unset")}', fix)
  if on_tpu_vm():
    workers = next((f'{k}={env[k]}' for k in ('TPU_PROCESS_ADDRESSES', 'TPU_WORKER_HOSTNAMES') if k in env),
                   "the VM's metadata")
    return Environment('Cloud TPU VM', None, workers, 'start every host together')
  if 'JOB_COMPLETION_INDEX' in env and 'KUBERNETES_SERVICE_HOST' in env:
    fix = ("install the kubernetes package (pip install -e '.[k8s]'), let the pod's service account get and list "
           'pods and jobs, and start every pod of the Job together (docs/clusters.md)')
    return Environment('Kubernetes Indexed Job', None, f'JOB_COMPLETION_INDEX={env["JOB_COMPLETION_INDEX"]}', fix)
  return None


def preempted_exit(flag: int | None, environ=None) -> int:
  """The exit status of a run stopped before it finished: --preempted_exit where given; else PREEMPTED under a
  scheduler, which would read 0 as finished and never restart it; else 0."""
  if flag is not None:
    return flag
  return PREEMPTED if detect(environ) is not None else 0


def _count(env, name: str) -> int:
  value = env[name]
  if not value.isdigit() or int(value) < 1:
    config_lib.fail(f'{name}={value!r}: the environment names no number of processes; unset it or fix the launcher')
  return int(value)


def join(coordinator_address: str | None, num_processes: int | None, process_id: int | None,
         timeout_s: float = JOIN_TIMEOUT_S) -> Environment | None:
  """Joins the run's processes (the flags' first, else the environment's), then says so in one line."""
  if coordinator_address or num_processes:
    found = Environment('flags', num_processes, f'--num_processes={num_processes}',
                        'start every process with the same --coordinator_address and --num_processes, each with its '
                        'own --process_id')
    _initialize(found, timeout_s, coordinator_address=coordinator_address, num_processes=num_processes,
                process_id=process_id)
  else:
    found = detect()
    if found is None:
      return None
    if found.processes != 1:
      arguments = {'local_device_ids': local_device_ids()}
      if found.name == 'Open MPI' and 'OMPI_MCA_orte_hnp_uri' not in os.environ:  # Open MPI 5: jax does not see it
        # All that jax would detect, given (jax 0.11 asks mpi4py for it): the address is JAX_COORDINATOR_ADDRESS.
        local_rank = os.environ.get('OMPI_COMM_WORLD_LOCAL_RANK')
        if arguments['local_device_ids'] is None and local_rank is not None:
          arguments['local_device_ids'] = [int(local_rank)]  # the local rank's GPU, as jax gives under Open MPI 4
        arguments.update(num_processes=found.processes, process_id=int(os.environ['OMPI_COMM_WORLD_RANK']),
                         cluster_detection_method='deactivate')
      _initialize(found, timeout_s, **arguments)
  if found.processes is not None and jax.process_count() != found.processes:
    config_lib.fail(f'{found.source}: names {found.processes} processes, but jax joined {jax.process_count()} '
                    f'(it found another environment); {found.fix}', code=PEER_LOST)
  if jax.process_count() > 1:
    from jax._src import distributed  # pylint: disable=import-outside-toplevel  # where jax keeps its client
    # The timing read now, not at import: a test shortens it (tests/test_cluster.py).
    PeerWatch(distributed.global_state.client, jax.process_index(), jax.process_count(), PEER_TIMEOUT_S,
              PEER_BEAT_S).start()
  devices = jax.devices()
  print(f'cluster: {found.name} ({found.source}): process {jax.process_index()} of {jax.process_count()} on '
        f'{socket.gethostname()}, {jax.local_device_count()} of {len(devices)} {devices[0].platform} devices',
        flush=True)
  console.quiet_unless_first(jax.process_index())  # the progress is process 0's to print
  return found


def _initialize(found: Environment, timeout_s: float, **arguments):
  """jax.distributed.initialize, bounded by a timer that ends the process with one line before jax aborts with a C++
  stack (a peer never registered)."""
  started = time.monotonic()

  def give_up():
    from jax._src import distributed  # pylint: disable=import-outside-toplevel  # where jax keeps the address
    address = getattr(distributed.global_state, 'coordinator_address', None) or 'unknown'
    print(f'error: {found.source}: {found.name} names {found.processes or "several"} processes, but they did not '
          f'all join within {timeout_s:g} s (coordinator {address}, waited {time.monotonic() - started:.0f} s); '
          f'{found.fix}', file=sys.stderr, flush=True)
    os._exit(PEER_LOST)  # pylint: disable=protected-access  # the main thread is blocked in jax

  timer = threading.Timer(timeout_s, give_up)
  timer.daemon = True
  timer.start()
  try:
    jax.distributed.initialize(**arguments, initialization_timeout=int(timeout_s) + 60)
  except (RuntimeError, ValueError) as e:
    reason = files.why(e)
    if found.name == 'Cloud TPU VM':
      hosts = _tpu_host_count()
      if hosts == 1:
        logging.warning('jax.distributed.initialize() failed (%s) on a single-host TPU VM; running as one process',
                        reason)
        return
      config_lib.fail(f'jax.distributed.initialize() failed ({reason}) on a TPU VM of a slice with '
                      f'{"an unknown number of" if hosts is None else hosts} hosts; not training alone, as every '
                      'host would train into the same workdir on its own. Start every host together, or pass '
                      '--coordinator_address, --num_processes and --process_id', code=PEER_LOST)
    config_lib.fail(f'{found.source}: {found.name} names {found.processes or "several"} processes, but '
                    f'jax.distributed.initialize() could not join them ({reason}); {found.fix}', code=PEER_LOST)
  finally:  # whatever ended the wait, the timer must not end the process later
    timer.cancel()


class PeerWatch:
  """Each process of a run beats in the coordinator's key-value store every `beat_s`. Where a peer's beat stops for
  `timeout_s` (it died, or its host did; the coordinator not answering: process 0), this process ends with one line
  naming it and PEER_LOST, instead of a traceback of the failed collective and, 54-100 s later, jax's abort with a
  C++ stack. A process that ended its work says so (`finish`): it is not lost."""
  PREFIX = 'laurel/peers/'
  running = None  # this process's watch, once started

  def __init__(self, client, process_id: int, processes: int, timeout_s: float = PEER_TIMEOUT_S,
               beat_s: float = PEER_BEAT_S, end=os._exit):  # pylint: disable=protected-access
    self.client, self.process_id, self.processes = client, process_id, processes
    self.timeout_s, self.beat_s, self.end = timeout_s, beat_s, end
    self.beats, self.last_seen = 0, {}  # peer: (its last beat, when it last changed)
    self.finished = threading.Event()

  def start(self) -> 'PeerWatch':
    self._set('who', f'pid {os.getpid()} on host {socket.gethostname()}')
    PeerWatch.running = self
    process.start_thread('laurel-peers', self._watch)
    return self

  def finish(self):
    self.finished.set()
    self._set('beat', 'done')

  def _set(self, kind: str, value: str):
    try:
      self.client.key_value_set(f'{self.PREFIX}{kind}/{self.process_id}', value, allow_overwrite=True)
    except Exception:  # pylint: disable=broad-except  # the coordinator is gone: the watch will say so
      pass

  def _read(self, kind: str) -> dict[int, str]:
    pairs = self.client.key_value_dir_get(f'{self.PREFIX}{kind}/')
    return {int(key.rsplit('/', 1)[-1]): value for key, value in pairs}

  def _watch(self):
    polled = answered = time.monotonic()
    while not self.finished.wait(self.beat_s):
      now = time.monotonic()
      if now - polled > 2 * self.beat_s + 1.0:  # this process was stopped (SIGSTOP): no peer was silent meanwhile
        answered, self.last_seen = now, {peer: (beat, now) for peer, (beat, _) in self.last_seen.items()}
      polled, self.beats = now, self.beats + 1
      try:
        self.client.key_value_set(f'{self.PREFIX}beat/{self.process_id}', str(self.beats), allow_overwrite=True)
        beats = self._read('beat')
      except Exception as e:  # pylint: disable=broad-except  # whatever the client raises
        if now - answered > self.timeout_s:
          self._lost([0], f'the coordinator does not answer ({type(e).__name__})')
        continue
      answered = now
      for peer in set(range(self.processes)) - {self.process_id}:
        beat = beats.get(peer)
        if peer not in self.last_seen or self.last_seen[peer][0] != beat:
          self.last_seen[peer] = (beat, now)
      silent = [peer for peer, (beat, since) in sorted(self.last_seen.items())
                if beat != 'done' and now - since > self.timeout_s]
      if silent:
        self._lost(silent, f'no beat for {self.timeout_s:g} s')

  def _lost(self, peers: list[int], why: str):
    try:
      who = self._read('who')
    except Exception:  # pylint: disable=broad-except
      who = {}
    named = ', '.join(f'process {p} of {self.processes}' + (f' ({who[p]})' if p in who else '') for p in peers)
    print(f'error: lost {named}: {why}; it died, or its host did. Process {self.process_id} ends too, with status '
          f'{PEER_LOST}, so that the scheduler restarts every process from the last checkpoint', file=sys.stderr,
          flush=True)
    sys.stdout.flush()
    self.finished.set()  # where `end` returns (a test), the watch is over
    self.end(PEER_LOST)


def finish_peer_watch():
  """This process ended its work: its peers do not count it lost when it exits."""
  if PeerWatch.running is not None:
    PeerWatch.running.finish()


def await_lost_peer():
  """After a failure in a run of several processes: waits as long as the watch needs to tell whether a peer was lost
  (then it ends this process in one line); returns where none was, and the failure is this process's own."""
  watch = PeerWatch.running
  if watch is not None and not watch.finished.is_set():
    watch.finished.wait(watch.timeout_s + 3 * watch.beat_s)


def local_device_ids(environ=None) -> list[int] | None:
  """None: jax keeps the local rank's GPU, for several processes per node; []: every visible device, for one process
  per node or one GPU each (CUDA_VISIBLE_DEVICES names one)."""
  env = os.environ if environ is None else environ
  if 'OMPI_COMM_WORLD_LOCAL_SIZE' in env:
    local = int(env['OMPI_COMM_WORLD_LOCAL_SIZE'])
  elif 'SLURM_JOB_ID' in env:
    local = _slurm_tasks_on_node(env.get('SLURM_STEP_TASKS_PER_NODE') or env.get('SLURM_TASKS_PER_NODE', ''),
                                 int(env.get('SLURM_NODEID', '0')))
  else:
    local = None
  visible = env.get('CUDA_VISIBLE_DEVICES')
  return [] if local == 1 or (visible is not None and len(visible.split(',')) == 1) else None


def _slurm_tasks_on_node(tasks_per_node: str, node: int) -> int | None:
  """Tasks on node `node` from Slurm's compressed list, e.g. '2(x3),1' (2 on nodes 0-2, 1 on node 3)."""
  counts = []
  for part in filter(None, tasks_per_node.split(',')):
    match = re.fullmatch(r'(\d+)(?:\(x(\d+)\))?', part)
    if match is None:
      return None
    counts += [int(match[1])] * int(match[2] or 1)
  return counts[node] if node < len(counts) else None


def _tpu_host_count() -> int | None:
  """Hosts in this TPU VM's slices as the environment (GKE) or the metadata server lists them; None if neither does."""
  workers = os.environ.get('TPU_PROCESS_ADDRESSES') or os.environ.get('TPU_WORKER_HOSTNAMES')
  if workers is None:
    host = os.environ.get('GCE_METADATA_IP', 'metadata.google.internal')
    request = urllib.request.Request(f'http://{host}/computeMetadata/v1/instance/attributes/worker-network-endpoints',
                                     headers={'Metadata-Flavor': 'Google'})
    try:
      with urllib.request.urlopen(request, timeout=5) as response:
        workers = response.read().decode()
    except OSError:
      return None
  slices = os.environ.get('MEGASCALE_NUM_SLICES', '1')
  hosts = [w for w in workers.split(',') if w.strip()]
  return len(hosts) * int(slices) if hosts and slices.isdigit() else None


def on_tpu_vm() -> bool:
  """By its chips' device files (/dev/accel* up to v4, /dev/vfio/<n> from v5e): CPU machines have libtpu too."""
  return bool(glob.glob('/dev/accel*') or glob.glob('/dev/vfio/[0-9]*'))
