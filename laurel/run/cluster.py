"""Joins this process to the rest of its run through JAX's cluster detection (docs/clusters.md). Where the environment
names several processes and jax.distributed cannot join them, the run stops rather than train alone: one line where
JAX raises, JAX's own abort where it gives up waiting (`initialization_timeout`). A peer that dies is JAX's
coordination service's to find (`heartbeat_timeout_seconds`): it aborts every other process."""

import dataclasses
import glob
import os
import re
import socket
import urllib.request

import jax
from absl import logging

from laurel.cli import console, files
from laurel.cli.process import ERROR, PREEMPTED, fail

JOIN_TIMEOUT_S = 300  # jax's own defaults: the wait for every process to join, and for a silent peer
HEARTBEAT_TIMEOUT_S = 100


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
    fail(f'{name}={value!r}: the environment names no number of processes; unset it or fix the launcher')
  return int(value)


def join(coordinator_address: str | None, num_processes: int | None, process_id: int | None,
         join_timeout_s: float = JOIN_TIMEOUT_S, heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S) -> Environment | None:
  """Joins the run's processes (the flags' first, else the environment's), then says so in one line."""
  timeouts = {'initialization_timeout': int(join_timeout_s), 'heartbeat_timeout_seconds': int(heartbeat_timeout_s)}
  if coordinator_address or num_processes:
    found = Environment('flags', num_processes, f'--num_processes={num_processes}',
                        'start every process with the same --coordinator_address and --num_processes, each with its '
                        'own --process_id')
    _initialize(found, coordinator_address=coordinator_address, num_processes=num_processes, process_id=process_id,
                **timeouts)
  else:
    found = detect()
    if found is None:
      return None
    if found.processes != 1:
      arguments = {'local_device_ids': local_device_ids(), **timeouts}
      if found.name == 'Open MPI' and 'OMPI_MCA_orte_hnp_uri' not in os.environ:  # Open MPI 5: jax does not see it
        # All that jax would detect, given (jax 0.11 asks mpi4py for it): the address is JAX_COORDINATOR_ADDRESS.
        local_rank = os.environ.get('OMPI_COMM_WORLD_LOCAL_RANK')
        if arguments['local_device_ids'] is None and local_rank is not None:
          arguments['local_device_ids'] = [int(local_rank)]  # the local rank's GPU, as jax gives under Open MPI 4
        arguments.update(num_processes=found.processes, process_id=int(os.environ['OMPI_COMM_WORLD_RANK']),
                         cluster_detection_method='deactivate')
      _initialize(found, **arguments)
  if found.processes is not None and jax.process_count() != found.processes:
    fail(f'{found.source}: names {found.processes} processes, but jax joined {jax.process_count()} '
                    f'(it found another environment); {found.fix}', code=ERROR)
  devices = jax.devices()
  print(f'cluster: {found.name} ({found.source}): process {jax.process_index()} of {jax.process_count()} on '
        f'{socket.gethostname()}, {jax.local_device_count()} of {len(devices)} {devices[0].platform} devices',
        flush=True)
  console.quiet_unless_first(jax.process_index())  # the progress is process 0's to print
  return found


def _initialize(found: Environment, **arguments):
  """jax.distributed.initialize; one line where it raises (no coordinator to be found). Where a peer never joins,
  JAX aborts the process itself after `initialization_timeout` (docs/clusters.md shows its lines)."""
  try:
    jax.distributed.initialize(**arguments)
  except (RuntimeError, ValueError) as e:
    reason = files.why(e)
    if found.name == 'Cloud TPU VM':
      hosts = _tpu_host_count()
      if hosts == 1:
        logging.warning('jax.distributed.initialize() failed (%s) on a single-host TPU VM; running as one process',
                        reason)
        return
      fail(f'jax.distributed.initialize() failed ({reason}) on a TPU VM of a slice with '
                      f'{"an unknown number of" if hosts is None else hosts} hosts; not training alone, as every '
                      'host would train into the same workdir on its own. Start every host together, or pass '
                      '--coordinator_address, --num_processes and --process_id', code=ERROR)
    fail(f'{found.source}: {found.name} names {found.processes or "several"} processes, but '
                    f'jax.distributed.initialize() could not join them ({reason}); {found.fix}', code=ERROR)


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
