"""Shared test helpers: tiny configs for the train loop, run in-process or through the CLI; GPU tests."""
import contextlib
import functools
import importlib.util
import io
import json
import os
import pathlib
import runpy
import shutil
import socket
import subprocess
import sys
from unittest import mock

import pytest
from absl import flags, logging
from absl.testing import flagsaver

from conftest import TEST_XLA_FLAGS
from laurel import command_line, train_config

ROOT = pathlib.Path(__file__).resolve().parents[1]

# The TPU compiler is an optional extra (Linux only): without it, the tests that compile for a slice skip.
needs_libtpu = pytest.mark.skipif(importlib.util.find_spec('libtpu') is None,
                                  reason="compiling for a TPU slice needs libtpu: pip install -e '.[tpu]'")

# A model and batch small enough that a step takes milliseconds on one CPU core.
TINY_LM = {
    'model.d_model': 32, 'model.num_heads': 4, 'model.d_ff': 64, 'model.num_layers': 3,
    'data.name': 'synthetic', 'data.seq_len': 32,
    'batch_size': 8, 'steps': 6, 'log_every': 1, 'eval_every': 1000, 'eval_steps': 2,
    'checkpoint_every': 1000, 'tensorboard': False, 'optimizer.warmup_steps': 2, 'data.prefetch': 0,
}
SPEC = 'configs/c4_ablation.py:rw_lr_pa,preset=tiny'
TRAINED = {**TINY_LM, 'steps': 9, 'checkpoint_every': 3}  # the shared trained run (conftest.trained_run)


def load_config(spec: str, overrides: dict | None = None):
  """`spec` is 'configs/<file>.py:<arg>'; overrides are dotted field names set as Python values (types the
  command line could not write included)."""
  config = command_line.load(spec)
  for dotted, value in (overrides or {}).items():
    *parents, leaf = dotted.split('.')
    node = config
    for p in parents:
      node = node[p]
    node[leaf] = value
  return config


def typed_config(spec: str, overrides: dict | None = None):
  """load_config's config, typed (train_config.build_config), as laurel.main hands it on."""
  return train_config.build_config(load_config(spec, overrides))


def cli_args(spec: str, workdir, overrides: dict) -> list[str]:
  args = [sys.executable, '-m', 'laurel.main', f'--config={ROOT / spec.split(":")[0]}:{spec.split(":")[1]}',
          f'--workdir={workdir}']
  return args + [f'--config.{k}={v}' for k, v in overrides.items()]


# Variables by which laurel.run.cluster finds a cluster: the tests simulate their own, not the one they may run in.
CLUSTER_VARIABLES = ('SLURM_', 'OMPI_', 'PMIX_', 'JOB_COMPLETION_INDEX', 'KUBERNETES_SERVICE_HOST', 'JAX_COORDINATOR')


def cli_env(num_devices: int = 1) -> dict:
  env = {k: v for k, v in os.environ.items() if not k.startswith(CLUSTER_VARIABLES)}
  env['XLA_FLAGS'] = f'--xla_force_host_platform_device_count={num_devices} {TEST_XLA_FLAGS}'
  env['JAX_PLATFORMS'] = 'cpu'
  env['PYTHONPATH'] = str(ROOT)
  return env


def cluster_env(scheduler: str, process: int, processes: int, port: int, num_devices: int = 1) -> dict:
  """cli_env for process `process` of `processes` on this host, with the variables `scheduler` (slurm, ompi) sets and
  a localhost coordinator on `port`, where jax.distributed.initialize() finds them."""
  env = cli_env(num_devices)
  if scheduler == 'slurm':  # srun --ntasks=N on one node
    env.update(SLURM_JOB_ID='4242', SLURM_STEP_NODELIST='localhost', SLURM_NTASKS=str(processes),
               SLURM_PROCID=str(process), SLURM_LOCALID=str(process), SLURM_NODEID='0',
               SLURM_STEP_TASKS_PER_NODE=str(processes))
  elif scheduler == 'ompi':  # mpirun -np N (Open MPI 4) on one host
    env.update(OMPI_MCA_orte_hnp_uri='278003712.0;tcp://127.0.0.1:1', OMPI_COMM_WORLD_SIZE=str(processes),
               OMPI_COMM_WORLD_RANK=str(process), OMPI_COMM_WORLD_LOCAL_RANK=str(process),
               OMPI_COMM_WORLD_LOCAL_SIZE=str(processes))
  else:
    raise ValueError(scheduler)
  env['JAX_COORDINATOR_PORT'] = str(port)  # instead of the port jax derives from the job id
  return env


def free_port() -> int:
  with socket.socket() as s:
    s.bind(('localhost', 0))
    return s.getsockname()[1]


def without_this_python(path: str) -> str:
  """PATH without the folder of this interpreter: a shell in which its venv is not activated."""
  here = os.path.dirname(sys.executable)
  return os.pathsep.join(p for p in path.split(os.pathsep) if not (os.path.isdir(p) and os.path.samefile(p, here)))


def fake_gcs_env(root, num_devices: int = 1) -> dict:
  """cli_env in which gs://BUCKET/PATH is the local file ROOT/BUCKET/PATH (tests/fake_gcs), for etils.epath."""
  env = cli_env(num_devices)
  env.update(FAKE_GCS_ROOT=str(root), EPATH_USE_TF='0',
             PYTHONPATH=os.pathsep.join([str(ROOT / 'tests' / 'fake_gcs'), env['PYTHONPATH']]))
  return env


def run_cli(spec, workdir, overrides, num_devices=1, timeout=300, extra=()):
  return subprocess.run(cli_args(spec, workdir, overrides) + list(extra), env=cli_env(num_devices), cwd=ROOT,
                        capture_output=True, text=True, timeout=timeout)


@contextlib.contextmanager
def on_devices(num_devices: int = 1):
  """A training run started in this process (laurel.main calls train.train) runs on the first `num_devices` of the
  suite's 8, as on the host of a process of its own (cli_env): compiling a tiny run for 8 devices costs about 2.4
  CPU-s more than for one, 0.7 where the compilation cache holds it."""
  import jax  # pylint: disable=import-outside-toplevel  # jax: only where needed
  from laurel import train  # pylint: disable=import-outside-toplevel
  run = train.train

  def on_some(config, workdir, devices=None, **kwargs):
    return run(config, workdir, jax.devices()[:num_devices] if devices is None else devices, **kwargs)

  with mock.patch.object(train, 'train', on_some):
    yield


def train_cli(capsys, spec, workdir, overrides, *extra, num_devices: int = 1) -> tuple[int, str, str]:
  """laurel-train's command line run in this process (laurel.main.main) on `num_devices` devices (on_devices), as
  cli_args writes it, with no cluster's variables: (exit status, stdout, stderr)."""
  from laurel import main  # pylint: disable=import-outside-toplevel  # jax: only where needed
  hidden = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith(CLUSTER_VARIABLES)}
  capsys.readouterr()
  try:
    with on_devices(num_devices):
      status = main.main(['laurel-train', *cli_args(spec, workdir, overrides)[3:], *extra])
  finally:
    os.environ.update(hidden)
  return status, *capsys.readouterr()


def run_python(code: str, env=None, timeout=300, **kwargs):
  """`python -c code` in the repository root, with the tests' environment (cli_env) unless `env`."""
  return subprocess.run([sys.executable, '-c', code], env=env or cli_env(), cwd=ROOT, capture_output=True, text=True,
                        timeout=timeout, **kwargs)


def call_main(main, *args) -> tuple[int, str, str]:
  """A command's `main(argv) -> exit status` (laurel.prepare.c4.main, ...) called in this process with `args`:
  (its status, what it printed on stdout, on stderr)."""
  out, err = io.StringIO(), io.StringIO()
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    status = main(['laurel', *map(str, args)])
  return status, out.getvalue(), err.getvalue()


def run_script(name: str, *args, cwd=None, env=None) -> subprocess.CompletedProcess:
  """`python scripts/<name> ARGS` run in this process, for a test of what it prints, writes and exits with, not of its
  process: the script executed afresh as __main__ (absl parses its flags; a flag of a name that another module
  defined, sweep.py's and reproduce_c4_ablation.py's --workdir, is put aside meanwhile), its stdout, stderr and exit
  status captured, in `cwd`; `env` is the environment of what it starts (this process's jax has started already).
  Its flags, the folders it locked (scripts/launching.py) and absl's verbosity are left as they were."""
  path, verbosity = ROOT / 'scripts' / name, logging.get_verbosity()
  out, err, status = io.StringIO(), io.StringIO(), 0
  if env is not None:
    import jax  # pylint: disable=import-outside-toplevel
    jax.devices()  # the backend starts with the suite's devices, whatever XLA_FLAGS `env` gives
  with contextlib.ExitStack() as stack:
    stack.enter_context(_flags_of_a_fresh_script(str(path)))
    stack.enter_context(mock.patch.object(sys, 'argv', [str(path), *map(str, args)]))
    stack.enter_context(mock.patch.object(sys, 'path', [str(path.parent), *sys.path]))
    stack.enter_context(mock.patch.dict(os.environ, env or {}, clear=env is not None))
    stack.enter_context(contextlib.chdir(cwd or ROOT))
    stack.enter_context(contextlib.redirect_stdout(out))
    stack.enter_context(contextlib.redirect_stderr(err))
    held = list(getattr(sys.modules.get('launching'), '_HELD_LOCKS', []))
    try:
      runpy.run_path(str(path), run_name='__main__')
    except SystemExit as e:
      status = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
    finally:
      logging.set_verbosity(verbosity)
      if (locks := getattr(sys.modules.get('launching'), '_HELD_LOCKS', None)) is not None:
        for handle in locks[len(held):]:  # the lock a process holds until it ends: this one goes on
          handle.close()
        locks[len(held):] = []
  return subprocess.CompletedProcess([name, *args], status, out.getvalue(), err.getvalue())


@contextlib.contextmanager
def _flags_of_a_fresh_script(script: str):
  """absl's FLAGS as the process of `script` would have them: the flags it defines, the launch flags
  (scripts/launching.py) among them, replace those of the same names meanwhile and are removed after; the flags
  defined before, and their values, come back."""
  every, saved, displaced = flags.FLAGS, flagsaver.save_flag_values(), {}
  define = flags.FlagValues.__setitem__

  def displacing(self, name, flag):
    if self is every and name in every._flags() and name not in displaced:  # pylint: disable=protected-access
      displaced[name] = every._flags().pop(name)  # pylint: disable=protected-access
    define(self, name, flag)
  try:
    with mock.patch.object(flags.FlagValues, '__setitem__', displacing):
      yield
  finally:
    for module in (script, 'launching'):  # both define their flags again on the next run
      for flag in list(every.flags_by_module_dict().get(module, [])):
        if every._flags().get(flag.name) is flag:  # pylint: disable=protected-access
          delattr(every, flag.name)
    every._flags().update(displaced)  # pylint: disable=protected-access
    flagsaver.restore_flag_values({**flagsaver.save_flag_values(), **saved})


def metrics(workdir) -> list[dict]:
  """The rows of WORKDIR/metrics.jsonl."""
  return [json.loads(l) for l in (pathlib.Path(workdir) / 'metrics.jsonl').read_text().splitlines() if l]


def losses(workdir) -> dict[int, float]:
  return {r['step']: r['loss'] for r in metrics(workdir) if 'loss' in r}


def tree_snapshot(path) -> dict:
  """The size and modification time of everything below `path`: an equal snapshot later, nothing was written."""
  return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in pathlib.Path(path).rglob('*')}


def checkpoint_steps(workdir) -> set[int]:
  """The steps of WORKDIR's finished checkpoints."""
  d = pathlib.Path(workdir) / 'checkpoints'
  return {int(p.name) for p in d.iterdir() if p.name.isdigit()} if d.exists() else set()


def gpu_present() -> bool:
  """An NVIDIA GPU that jax's CUDA plug-in can use (nvidia-smi lists one)."""
  plugin = any(importlib.util.find_spec(p) for p in ('jax_cuda12_plugin', 'jax_cuda13_plugin'))
  return plugin and shutil.which('nvidia-smi') is not None and subprocess.run(
      ['nvidia-smi', '-L'], capture_output=True, check=False).returncode == 0


def on_gpu(test):
  """A GPU test (marker `gpu`). It runs where jax's default backend is a GPU (make gpu-check: JAX_PLATFORMS=cuda);
  in the CPU suite (conftest) on a machine with a GPU it reruns itself in a process that sees the GPU; with no GPU
  it skips."""
  @functools.wraps(test)
  def run(*args, **kwargs):
    import jax  # pylint: disable=import-outside-toplevel
    if jax.default_backend() == 'gpu':
      return test(*args, **kwargs)
    if not gpu_present():
      pytest.skip('needs an NVIDIA GPU and jax[cuda]')
    node = os.environ['PYTEST_CURRENT_TEST'].rsplit(' ', 1)[0]  # this test, parameters included
    # Without preallocation: pytest's other workers may hold the same GPU.
    env = dict(os.environ, JAX_PLATFORMS='cuda', PYTHONPATH=str(ROOT), XLA_PYTHON_CLIENT_PREALLOCATE='false')
    result = subprocess.run([sys.executable, '-m', 'pytest', '-q', '-x', '-n', '0', '-p', 'no:cacheprovider', node],
                            env=env, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return None
  return pytest.mark.gpu(run)
