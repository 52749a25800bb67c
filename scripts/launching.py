"""Where the runs of a table or a sweep train (here, one or more at a time, or on a TPU slice through
launch_tpu.py), one script at a time in a folder, and what each run trained on (reproduce_c4_ablation.py, sweep.py,
ablation_table.py)."""

import concurrent.futures
import fcntl
import functools
import hashlib
import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading

import cli  # puts the repo root on sys.path
from absl import flags

from laurel import config_lib
from laurel.cli import files, process
from laurel.plan.hardware import parse_accelerator
from cli import (ROOT, command, config_flags, fail, override_field, override_values, repo_spec, require, shell_line,
                 typed)


def sets_that_apply(spec: str, sets) -> list[str]:
  """The --set overrides that change something in `spec`'s run: a table-wide --set (e.g. model.laurel.rank) means
  nothing to the rows without that part, which train without it (said on stderr)."""
  from laurel import command_line, tasks  # pylint: disable=import-outside-toplevel  # jax: only where needed
  unused = tasks.get_task(command_line.load(spec, config_flags(sets))).unused_fields()
  for s in sets:
    if override_field(s) in unused:
      print(f'{spec}: --set={s} left out: {unused[override_field(s)]}', file=sys.stderr, flush=True)
  return [s for s in sets if override_field(s) not in unused]


# Of one accelerator's memory, the share that the runs training on it at once split between them (--jobs).
MEMORY_SHARE = 0.9
# Memory settings of JAX's GPU client; where one is given, the runs keep it.
MEMORY_VARIABLES = ('XLA_PYTHON_CLIENT_MEM_FRACTION', 'XLA_PYTHON_CLIENT_PREALLOCATE', 'XLA_PYTHON_CLIENT_ALLOCATOR')


def child_env(jobs: int = 1, environ=None) -> dict:
  """The environment of the runs this script starts: the repo root on PYTHONPATH, and where `jobs` runs share one
  accelerator, each its share of its memory (JAX preallocates 75% of a GPU for each process: a second one fails to
  allocate), unless the environment sets JAX's memory variables itself."""
  environ = os.environ if environ is None else environ
  env = dict(environ, PYTHONPATH=os.pathsep.join(filter(None, (str(ROOT), environ.get('PYTHONPATH')))))
  if jobs > 1 and not set(MEMORY_VARIABLES) & set(environ):
    env['XLA_PYTHON_CLIENT_MEM_FRACTION'] = f'{MEMORY_SHARE / jobs:.3f}'
  return env


def parse_duration(text: str) -> float:
  """Seconds of '600', '90s', '10m', '1h30m' or '2h'; one-line InputError otherwise."""
  match = re.fullmatch(r'(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m)?(?:(\d+(?:\.\d+)?)s?)?', text.strip())
  if not text.strip() or not match or not any(match.groups()):
    raise config_lib.InputError(f'--time_limit={text!r}: not a duration (e.g. 600, 90s, 10m, 1h30m)')
  hours, minutes, seconds = (float(part or 0) for part in match.groups())
  if (total := 3600 * hours + 60 * minutes + seconds) <= 0:
    raise config_lib.InputError(f'--time_limit={text!r}: must be more than 0 s')
  return total


_HELD_LOCKS = []  # open for the process's life: the kernel releases each lock when the process ends, however


def folder_lock(folder) -> pathlib.Path:
  """The lock file of a local folder: in the temporary directory (never a stray file in results/), named by the
  folder's real path, so that every spelling of one folder shares it."""
  real = os.path.realpath(os.fspath(folder))
  return pathlib.Path(tempfile.gettempdir()) / f'laurel-folder-{hashlib.sha256(real.encode()).hexdigest()[:16]}.lock'


def hold_folder(folder, flag: str):
  """Holds `folder`'s lock (folder_lock, fcntl.flock) for the rest of this process, so that a second table or sweep
  script on the same folder is refused in one line naming this one, before it trains or writes anything. A gs://
  folder has no lock."""
  if '://' in os.fspath(folder):
    return
  handle = open(folder_lock(folder), 'a+', encoding='utf-8')  # pylint: disable=consider-using-with  # until exit
  try:
    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except BlockingIOError:
    handle.seek(0)
    holder = handle.read().strip() or 'another process'
    handle.close()
    raise config_lib.InputError(f'--{flag}={os.fspath(folder)}: {holder} writes there; wait until it ends, or give '
                                f'another --{flag}') from None
  handle.truncate(0)
  handle.write(f'pid {os.getpid()} on {socket.gethostname()} (since {files.utc()}: {command()})\n')
  handle.flush()
  _HELD_LOCKS.append(handle)


def run_points(points: list[dict], log_name: str, command, after=lambda: None, before=lambda point: None,
               jobs: int = 1, time_limit: float | None = None) -> list[str]:
  """`command(point)` for each point ({'name', 'dir': an epath.Path, ...}) without a final.json, `jobs` at a time
  (each its share of the accelerator's memory: child_env), `before(point)` as each starts, its output echoed and
  added to <dir>/<log_name>, then `after()`. A point that fails gets <dir>/failed.json and the rest go on; one that
  another process finished meanwhile is reported as such, not failed. Returns the names of the points that failed.
  SIGTERM and Ctrl-C are passed on to the running points (each in a process group of its own, so that a terminal's
  Ctrl-C reaches it once, from here), which save a checkpoint and exit; no further point starts; after Ctrl-C this
  exits 130 with one line. A second Ctrl-C passes on too: the points exit at once. After `time_limit` seconds the
  running points get SIGTERM, and no further point starts."""
  failed, running, stop, timed_out, lock = [], [], [], [], threading.Lock()

  def stop_running(signum, _):
    stop.append(signum)
    for proc in list(running):
      proc.send_signal(signum)

  def out_of_time(*_):
    timed_out.append(True)
    stop_running(signal.SIGTERM, None)
  previous = {s: signal.signal(s, stop_running) for s in (signal.SIGTERM, signal.SIGINT)}
  if time_limit:
    previous[signal.SIGALRM] = signal.signal(signal.SIGALRM, out_of_time)
    signal.setitimer(signal.ITIMER_REAL, time_limit)
  env = child_env(jobs)

  def run_point(i, point):
    tag, point_dir = f'[{i + 1}/{len(points)} {point["name"]}]', point['dir']
    if (point_dir / 'final.json').exists():
      (point_dir / 'failed.json').unlink(missing_ok=True)  # an earlier attempt's, before another process finished it
      print(f'{tag} finished, skipped', flush=True)
      return
    if stop:
      return
    point_dir.mkdir(parents=True, exist_ok=True)
    (point_dir / 'failed.json').unlink(missing_ok=True)
    before(point)
    cmd = command(point)
    print(f'{tag} + {shell_line(typed(cmd))}', flush=True)
    output = []
    with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          process_group=0) as proc:
      running.append(proc)
      if stop:  # the signal came as it started
        proc.send_signal(stop[-1])
      for line in proc.stdout:
        output.append(line)
        print(f'{tag} {line}', end='', flush=True)
    running.remove(proc)
    log = point_dir / log_name  # written whole: not every filesystem appends
    files.write_text_atomic(log, (log.read_text() if log.exists() else '') + ''.join(output))
    if proc.returncode and not stop:
      if (point_dir / 'final.json').exists():
        print(f'{tag} finished by another process (exit {proc.returncode} here); see {log}', flush=True)
      elif proc.returncode == process.BAD_INPUT and 'in use by another run' in ''.join(output):
        print(f'{tag} left to the run that holds it (exit {proc.returncode}); see {log}', flush=True)
      else:
        print(f'{tag} failed (exit {proc.returncode}); see {log}', flush=True)
        files.write_text_atomic(point_dir / 'failed.json',
                                json.dumps({'exit': proc.returncode, 'command': typed(cmd)}) + '\n')
        failed.append(point['name'])
    with lock:  # the tables are written by one thread at a time
      after()

  try:
    if jobs == 1:
      for i, point in enumerate(points):
        run_point(i, point)
    else:
      with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        list(pool.map(run_point, range(len(points)), points))
  finally:
    signal.setitimer(signal.ITIMER_REAL, 0)
    for signum, handler in previous.items():
      signal.signal(signum, handler)
  if signal.SIGINT in stop:
    print('interrupted: the running point saved what it had (see its log); rerun the same command to resume',
          file=sys.stderr, flush=True)
    sys.exit(130)
  if timed_out:
    print(f'time limit of {time_limit:g} s reached: the running points were stopped (a point in its train loop saves a '
          'checkpoint; see its log) and no further point started; rerun the same command to continue', flush=True)
  elif stop:
    print('stopped by SIGTERM; rerun the same command to resume', flush=True)
  return failed


DEVICE_KIND = 'import jax; print(jax.devices()[0].device_kind)'


@functools.lru_cache(maxsize=1)
def local_device_kind() -> str | None:
  """The kind of device the local runs train on (jax's name: 'NVIDIA H200', 'cpu'), asked of a child that
  preallocates nothing: this process starts no backend, which would hold accelerator memory while the runs train."""
  env = dict(child_env(), XLA_PYTHON_CLIENT_PREALLOCATE='false')
  found = subprocess.run([sys.executable, '-c', DEVICE_KIND], env=env, capture_output=True, text=True, check=False)
  lines = found.stdout.strip().splitlines()
  return lines[-1] if found.returncode == 0 and lines else None


def corpus_fingerprint(data_cfg) -> str | None:
  """16 hex digits of a SHA-256 over the training corpus's files, each one's name and size: data.name=text's file
  list (laurel.data: the default corpora, the Python sources installed here, differ between machines), or the files
  under a local data.path; 'synthetic' for the generated data; None for remote or TFDS data."""
  from laurel import data  # pylint: disable=import-outside-toplevel  # grain: only where needed
  if data_cfg.name == 'synthetic':
    return 'synthetic'
  if data_cfg.name == 'text':
    listed = data._list_files(data_cfg.path)  # pylint: disable=protected-access  # what the text loader reads
  elif data_cfg.path and os.path.isdir(data_cfg.path):
    root = pathlib.Path(data_cfg.path)
    listed = [(f.relative_to(root).as_posix(), str(f)) for f in sorted(root.rglob('*')) if f.is_file()]
  else:
    return None
  digest = hashlib.sha256()
  for key, path in listed:
    digest.update(f'{key}\t{os.path.getsize(path)}\n'.encode())
  return digest.hexdigest()[:16]


def point_status(point_dir) -> str:
  """done (final.json), failed (failed.json: its last attempt failed), partial (metrics logged) or missing."""
  names = ('final.json', 'failed.json', 'metrics.jsonl')
  return next((s for s, n in zip(('done', 'failed', 'partial'), names) if (point_dir / n).exists()), 'missing')


LAUNCH_TPU = str(ROOT / 'scripts' / 'launch_tpu.py')


def define_launch_flags() -> dict:
  """--launch and the slice's flags, for the scripts that train many runs (sweep.py, reproduce_c4_ablation.py)."""
  return {
      'launch': flags.DEFINE_enum(
          'launch', 'local', ['local', 'print', 'tpu'], 'local: train the runs here, one after another; print: '
          "print the commands instead, a dry run: with --tpu the scripts/launch_tpu.py commands (the slice's setup, "
          'then one per run), without it the local laurel.main ones; tpu: run them in turn, each run training on the '
          'slice in the foreground.'),
      'tpu': flags.DEFINE_string('tpu', None, '--launch=print|tpu: the TPU VM (scripts/launch_tpu.py --tpu).'),
      'zone': flags.DEFINE_string('zone', None, '--launch=print|tpu: its zone.'),
      'project': flags.DEFINE_string('project', None, "--launch=print|tpu: Google Cloud project; default: gcloud's."),
      'accelerator': flags.DEFINE_string('accelerator', None, '--launch=print|tpu: the slice, e.g. v6e-16.'),
      'setup': flags.DEFINE_bool('setup', True, '--launch=print|tpu: first copy the code to the slice and install it '
                                 '(scripts/launch_tpu.py --notrain).'),
      'preflight': flags.DEFINE_bool('preflight', True, '--launch=tpu: each run first compiles its step for the '
                                     'slice here (scripts/launch_tpu.py --preflight); --nopreflight skips it.'),
      'jobs': flags.DEFINE_integer('jobs', 1, '--launch=local: runs training at once on this machine, each with its '
                                   'share of one accelerator\'s memory (XLA_PYTHON_CLIENT_MEM_FRACTION=0.9/jobs).'),
      'time_limit': flags.DEFINE_string('time_limit', None, 'Stop after this long (600, 90s, 10m, 1h30m): the running '
                                        'runs save a checkpoint, no further run starts; rerun to continue.'),
  }


class Launcher:
  """Where a script's runs train: here (python -m laurel.main), or on a TPU slice (scripts/launch_tpu.py)."""

  def __init__(self, holders: dict):
    self.launch, self.setup, self.slice_args, self.slice = holders['launch'].value, holders['setup'].value, [], ()
    self.preflight, self.jobs, self.accelerator = holders['preflight'].value, holders['jobs'].value, None
    self.time_limit = holders['time_limit'].value and parse_duration(holders['time_limit'].value)
    if self.jobs < 1 or (self.jobs > 1 and self.launch != 'local'):
      raise config_lib.InputError(f'--jobs={self.jobs}: give 1 or more, and more than 1 only with --launch=local')
    # --launch=print without --tpu is a dry run of the local commands.
    self.on_slice = self.launch == 'tpu' or (self.launch == 'print' and bool(holders['tpu'].value))
    if self.on_slice:
      require(**{k: holders[k] for k in ('tpu', 'zone', 'accelerator')})
      self.accelerator = holders['accelerator'].value
      accel = parse_accelerator(self.accelerator)
      self.slice = (accel['chips'], accel['hosts'])
      self.slice_args = [f'--{k}={holders[k].value}' for k in ('tpu', 'zone', 'accelerator', 'project')
                         if holders[k].value]

  def load(self, spec: str, overrides):
    """A run's config, checked for the devices it will train on, its overrides all changing something (one-line
    InputError, as laurel.main)."""
    from laurel import command_line, train_config  # pylint: disable=import-outside-toplevel  # jax, optax: on use
    config = command_line.load(spec, overrides)
    typed = train_config.validate_config(config, *self.slice).config
    for warning in command_line.check_overrides(typed, spec, override_values(config, overrides)):
      print(warning, file=sys.stderr, flush=True)
    return config

  def command(self, point: dict) -> list[str]:
    if not self.on_slice:
      return [sys.executable, '-m', 'laurel.main', f'--config={point["config"]}', f'--workdir={point["dir"]}',
              *point['overrides']]
    return [sys.executable, LAUNCH_TPU, *self.slice_args, '--nosetup', '--nodetach',
            *([] if self.preflight else ['--nopreflight']), f'--config={repo_spec(point["config"])}',
            f'--workdir={point["dir"]}', *point['overrides']]

  def run(self, points: list[dict], log_name: str, after=lambda: None, before=lambda point: None) -> list[str]:
    """Prints every point's command (--launch=print) or runs them (run_points); returns the names that failed."""
    setup = [[sys.executable, LAUNCH_TPU, *self.slice_args, '--notrain']] if self.slice and self.setup else []
    if self.launch == 'print':
      for cmd in setup + [self.command(p) for p in points]:
        print(shell_line(typed(cmd)), flush=True)
      return []
    for cmd in setup:
      if code := subprocess.run(cmd, check=False).returncode:
        fail(f'setting up the slice failed (exit {code}): {shell_line(typed(cmd))}', code=code)
    return run_points(points, log_name, self.command, after, before, self.jobs, self.time_limit)
