"""Runs `laurel.main` on every host of a Cloud TPU VM (v4, v5e, v5p, v6e), creating it if asked, and looks after it.

  python scripts/launch_tpu.py --tpu=NAME --zone=ZONE --accelerator=v6e-16 [--create [--queued] [--spot]] \
      --config=configs/c4_ablation.py:rw_lr --workdir=gs://BUCKET/runs/rw_lr [--config.<field>=<value> ...] \
      [--nodetach | --watch] [--nosetup] [--notrain] [--dry-run]
  python scripts/launch_tpu.py --tpu=NAME --zone=ZONE --action=logs|status|stop

--action=train (the default), in order: create the VM (--create; with --queued through a queued resource, Google's
way to get v5e/v6e capacity, waiting until it is ACTIVE); copy this working tree's files that git tracks or would
add to every host (or clone --repo_url at --ref there), with its commit in COMMIT, and install a Python 3.11 venv
with jax[tpu] at this machine's version (--jax), gcsfs and the repo (--nosetup skips both, for a slice set up before;
--noinstall skips the venv); start laurel.main on all hosts at once, detached (log ~/laurel/train.log, pid
~/laurel/train.pid), or in the foreground with --nodetach. --watch runs it in the foreground and, until the workdir
holds final.json, reruns it after a preemption (recreating a preempted VM and setting it up again); the run resumes
from its last checkpoint. The config and overrides are first checked for the slice, then the step is compiled for it
on this machine (laurel.plan.aot.preflight, needs libtpu; --nopreflight skips it): bad input, or a step that does not
fit the chips' HBM, fails before any gcloud command; one that fits prints its HBM per chip and what the run will
cost (tokens per step, step and wall time, chip-hours; --mfu=F sets the utilisation assumed). The compiler's figures
are kept in the compilation cache (--compilation_cache), so the same pre-flight again does not compile the step.
--action=logs follows worker 0's log; status shows the VM's state and whether each host trains; stop sends SIGTERM
to the training, which saves a checkpoint and exits. --dry-run prints the commands and runs none.
Needs gcloud logged in. The workdir should be on GCS: a slice of several hosts with a local one is refused.
--accelerator also takes the slice as a topology (v6e:4x4 for v6e-16), as pre-flight and the benchmark do.
"""

import importlib.metadata
import importlib.util
import os
import re
import shlex
import subprocess
import sys
import tarfile
import tempfile
import time

import cli  # puts the repo root on sys.path
from absl import app, flags

from laurel import config_lib  # noqa: F401  # their flags: --compilation_cache, --mfu
from laurel.cli import compile_cache
from laurel.plan import cost
from laurel.plan.hardware import parse_accelerator

_ACTION = flags.DEFINE_enum('action', 'train', ['train', 'logs', 'status', 'stop'], 'What to do; see above.')
_CONFIG = flags.DEFINE_string('config', None, 'configs/<file>.py:<arg>, as for laurel.main.')
_WORKDIR = flags.DEFINE_string('workdir', None, 'Run directory, e.g. gs://BUCKET/runs/rw_lr (shared by all hosts).')
_TPU = flags.DEFINE_string('tpu', None, 'TPU VM name (also the queued resource name with --queued).')
_ZONE = flags.DEFINE_string('zone', None, 'Zone, e.g. us-east5-b.')
_PROJECT = flags.DEFINE_string('project', None, "Google Cloud project; default: gcloud's.")
_ACCELERATOR = flags.DEFINE_string('accelerator', None, 'v4-N, v5e-N (or v5litepod-N), v5p-N or v6e-N, e.g. v6e-16, '
                                   'or the same slice as a topology, e.g. v6e:4x4.')
_TOPOLOGY = flags.DEFINE_string('topology', None, 'v4 only: a custom chip topology AxBxC for --create.')
_VERSION = flags.DEFINE_string('version', None, 'TPU software version; default: the one for the generation.')
_CREATE = flags.DEFINE_bool('create', False, 'Create the TPU VM first.')
_QUEUED = flags.DEFINE_bool('queued', False, 'Create (and with --watch recreate) it through a queued resource.')
_SPOT = flags.DEFINE_bool('spot', False, 'With --create: a Spot VM.')
_REPO_URL = flags.DEFINE_string('repo_url', None, 'git clone this on every host instead of copying the working tree.')
_REF = flags.DEFINE_string('ref', 'main', 'With --repo_url: branch, tag or commit to check out.')
_SETUP = flags.DEFINE_bool('setup', True, 'Copy (or clone) the code to every host and install it.')
_INSTALL = flags.DEFINE_bool('install', True, 'Make the venv and install jax[tpu], gcsfs and the repo.')
_JAX = flags.DEFINE_string('jax', None, "pip requirement for jax; default: jax[tpu]==<this machine's jax>.")
_DETACH = flags.DEFINE_bool('detach', True, 'Run the training under nohup and return at once.')
_WATCH = flags.DEFINE_bool('watch', False, 'Train in the foreground and rerun it after preemptions until it ends.')
_WATCH_INTERVAL = flags.DEFINE_integer('watch_interval', 60, 'With --watch: seconds between a preemption and a rerun.')
_MAX_RESTARTS = flags.DEFINE_integer('max_restarts', 100, 'With --watch: give up after this many reruns.')
_TRAIN = flags.DEFINE_bool('train', True, 'Run laurel.main; --notrain only creates, ships and installs.')
_DRY_RUN = flags.DEFINE_bool('dry_run', False, 'Print the commands (also spelled --dry-run); run nothing.')
_PREFLIGHT = flags.DEFINE_bool('preflight', True, 'Compile the step for the slice here first (libtpu) and refuse to '
                               "launch if it does not fit the chips' HBM.")
_OVERRIDES = []  # the --config.<field>=<value> arguments, taken out of argv before absl parses it
# A VM in these states will not train again; --watch creates it anew. Queued resources report their own states.
GONE = ('PREEMPTED', 'TERMINATED', 'STOPPED', 'SUSPENDED', 'FAILED', 'NOT_FOUND')


# What each host runs, and where.
REMOTE_DIR = 'laurel'  # in each host's home directory
REMOTE_PYTHON = '.venv/bin/python'  # relative to REMOTE_DIR
REMOTE_LOG, REMOTE_PID = 'train.log', 'train.pid'  # of a detached run, in REMOTE_DIR
TARBALL = 'laurel-src.tar.gz'


def gcloud(verb: str, positional: list[str], zone: str, project: str | None, *extra: str,
           resource: str = 'tpu-vm') -> list[str]:
  """gcloud compute tpus <resource> <verb> ...; resource: tpu-vm or queued-resources."""
  return ['gcloud', 'compute', 'tpus', resource, verb, *positional, f'--zone={zone}',
          *([f'--project={project}'] if project else []), *extra]


def ssh(tpu, zone, project, command: str, worker: str = 'all') -> list[str]:
  """`command` on every host of the slice at once (or on one: worker='0')."""
  return gcloud('ssh', [tpu], zone, project, f'--worker={worker}', f'--command={command}')


def train_command(config_spec: str, workdir: str, overrides=(), detach=False) -> str:
  """What every host runs: laurel.main from the repo's venv; on a TPU VM jax.distributed finds the processes and
  the coordinator itself. Detached: under nohup, its output in REMOTE_LOG and its pid in REMOTE_PID."""
  run = shlex.join([REMOTE_PYTHON, '-m', 'laurel.main', f'--config={config_spec}', f'--workdir={workdir}',
                    *overrides])
  return f'cd {REMOTE_DIR} && ' + (f'nohup {run} > {REMOTE_LOG} 2>&1 < /dev/null & echo $! > {REMOTE_PID}'
                                   if detach else run)


def setup_command(jax_requirement: str, repo_url: str | None, ref: str, install: bool) -> str:
  if not re.fullmatch(r'[\w.\[\],=<>!~-]+', jax_requirement):
    raise config_lib.InputError(f'--jax={jax_requirement!r}: not a pip requirement such as jax[tpu]==0.10.2')
  if repo_url:
    url, ref = shlex.quote(repo_url), shlex.quote(ref)
    steps = [f'if [ -d {REMOTE_DIR}/.git ]; then git -C {REMOTE_DIR} fetch -q origin {ref} && '
             f'git -C {REMOTE_DIR} checkout -q --force FETCH_HEAD; else git clone -q {url} {REMOTE_DIR} && '
             f'git -C {REMOTE_DIR} checkout -q {ref}; fi']
  else:
    steps = [f'mkdir -p {REMOTE_DIR} && tar xzf {TARBALL} -C {REMOTE_DIR} && rm {TARBALL}']
  if install:
    steps += [f'cd {REMOTE_DIR}', 'python3 -m pip install -q --user uv',
              'python3 -m uv venv -q --allow-existing --python 3.11 .venv',
              f'python3 -m uv pip install -q --python {REMOTE_PYTHON} "{jax_requirement}" -e ".[gcs]"']
  return 'set -e; ' + ' && '.join(steps)


def pack_working_tree(path: str):
  """The files git tracks or would add (not ignored), as they are on disk now, and COMMIT (laurel.train reads it)."""
  from laurel.run import metrics_log  # pylint: disable=import-outside-toplevel  # (see plan)
  names = subprocess.run(['git', 'ls-files', '-z', '-co', '--exclude-standard'], cwd=cli.ROOT, check=True,
                         capture_output=True).stdout.decode().split('\0')
  with tempfile.NamedTemporaryFile('w', suffix='.commit') as commit, tarfile.open(path, 'w:gz') as tar:
    commit.write(f'{metrics_log.code_commit() or "unknown"}\n')
    commit.flush()
    tar.add(commit.name, arcname='COMMIT')
    for name in sorted(n for n in names if n and (cli.ROOT / n).is_file()):
      tar.add(cli.ROOT / name, arcname=name)


def _gcloud(verb: str, *extra: str, resource: str = 'tpu-vm') -> list[str]:
  return gcloud(verb, [_TPU.value], _ZONE.value, _PROJECT.value, *extra, resource=resource)


def state_command() -> list[str]:
  if _QUEUED.value:
    return _gcloud('describe', '--format=value(state.state)', resource='queued-resources')
  return _gcloud('describe', '--format=value(state)')


def create_steps(accel) -> list[tuple[str, list[str]]]:
  version = f'{"--runtime-version" if _QUEUED.value else "--version"}={_VERSION.value or accel["version"]}'
  spot = ['--spot'] if _SPOT.value else []
  if _QUEUED.value:
    return [('create', _gcloud('create', f'--node-id={_TPU.value}', *accel['create_flags'], version, *spot,
                               resource='queued-resources')), ('wait', state_command())]
  return [('create', _gcloud('create', *accel['create_flags'], version, *spot))]


def setup_steps() -> list[tuple[str, list[str] | str]]:
  steps = []
  if not _REPO_URL.value:
    tarball = os.path.join(tempfile.gettempdir(), f'laurel-src-{_TPU.value}.tar.gz')
    steps += [('pack', tarball), ('copy', gcloud('scp', [tarball, f'{_TPU.value}:{TARBALL}'], _ZONE.value,
                                                        _PROJECT.value, '--worker=all'))]
  setup = setup_command(_JAX.value or f'jax[tpu]=={importlib.metadata.version("jax")}', _REPO_URL.value,
                               _REF.value, _INSTALL.value)
  return steps + [('setup', ssh(_TPU.value, _ZONE.value, _PROJECT.value, setup))]


def finished_command() -> list[str]:
  """Exits 0 on worker 0 if the workdir holds final.json (through the hosts' filesystem for gs://)."""
  check = ('import sys; from etils import epath; '
           "sys.exit(0 if (epath.Path(sys.argv[1]) / 'final.json').exists() else 1)")
  return ssh(_TPU.value, _ZONE.value, _PROJECT.value, f'cd {REMOTE_DIR} && '
                    + cli.shell_line([REMOTE_PYTHON, '-c', check, _WORKDIR.value]), worker='0')


def plan() -> list[tuple[str, list[str] | str]]:
  """[(what, command)]: a gcloud argv, or for 'pack' the tarball to write."""
  cli.require(tpu=_TPU, zone=_ZONE)
  tpu, zone, project, remote = _TPU.value, _ZONE.value, _PROJECT.value, REMOTE_DIR
  if _ACTION.value == 'logs':
    return [('logs', ssh(tpu, zone, project, f'tail -n 200 -F {remote}/{REMOTE_LOG}', worker='0'))]
  if _ACTION.value == 'status':
    pid = f'{remote}/{REMOTE_PID}'
    running = (f'if [ -f {pid} ] && kill -0 "$(cat {pid})" 2>/dev/null; then echo "$(hostname): training (pid '
               f'$(cat {pid}))"; else echo "$(hostname): not training"; fi; tail -n 1 {remote}/{REMOTE_LOG} '
               '2>/dev/null || true')
    return [('state', state_command()), ('status', ssh(tpu, zone, project, running))]
  if _ACTION.value == 'stop':  # SIGTERM: laurel.main saves a checkpoint and exits
    pid = f'{remote}/{REMOTE_PID}'
    return [('stop', ssh(tpu, zone, project, f'if [ -f {pid} ]; then kill -TERM "$(cat {pid})" && echo '
                                                     '"$(hostname): stopping (checkpoint, then exit)"; fi'))]
  from laurel import command_line, train_config  # pylint: disable=import-outside-toplevel  # logs, status, stop skip it
  cli.require(accelerator=_ACCELERATOR, **({'workdir': _WORKDIR, 'config': _CONFIG} if _TRAIN.value else {}))
  accel = parse_accelerator(_ACCELERATOR.value, _TOPOLOGY.value)
  steps = create_steps(accel) if _CREATE.value else []
  steps += setup_steps() if _SETUP.value else []
  if _TRAIN.value:
    if accel['hosts'] > 1 and '://' not in _WORKDIR.value:  # each host would write its own checkpoints
      raise config_lib.InputError(f'--workdir={_WORKDIR.value!r}: a local directory, but the {accel["hosts"]} hosts '
                                  f'of {accel["name"]} must share the workdir: use gs://BUCKET/...')
    spec = cli.repo_spec(_CONFIG.value)
    config = command_line.load(spec, _OVERRIDES)
    typed = train_config.validate_config(config, accel['chips'], accel['hosts']).config
    for warning in command_line.check_overrides(typed, spec, cli.override_values(config, _OVERRIDES)):  # as laurel.main
      print(warning, file=sys.stderr, flush=True)
    if _PREFLIGHT.value:  # before any gcloud command: a step that does not fit fails here, not on the slice
      if importlib.util.find_spec('libtpu') is None:  # --dry-run too: the check compiles
        raise config_lib.InputError(f"--preflight: compiling the step for {accel['name']} here needs libtpu (pip "
                                    "install -e '.[tpu]'); --nopreflight launches (or with --dry-run prints) without "
                                    'this check')
      from laurel.plan import aot  # pylint: disable=import-outside-toplevel
      compile_cache.setup()
      aot.compile_only_process()
      print(aot.preflight(config, f'{accel["generation"]}:{accel["topology"]}'), file=sys.stderr, flush=True)
    run = train_command(spec, _WORKDIR.value, _OVERRIDES, _DETACH.value and not _WATCH.value)
    steps.append(('train', ssh(tpu, zone, project, run)))
  return steps


def execute(what: str, cmd) -> int:
  """Runs (or with --dry-run prints) one step; returns its exit status."""
  print(f'# pack the working tree (git ls-files -co --exclude-standard) into {cmd}' if what == 'pack' else
        f'# until ACTIVE (polled): {cli.shell_line(cmd)}' if what == 'wait' else cli.shell_line(cmd), flush=True)
  if _DRY_RUN.value:
    return 0
  if what == 'pack':
    pack_working_tree(cmd)
    return 0
  if what == 'wait':
    while (state := subprocess.run(cmd, capture_output=True, text=True, check=False).stdout.strip()) != 'ACTIVE':
      if state in ('FAILED', 'SUSPENDED'):
        cli.fail(f'queued resource {_TPU.value} is {state}')
      time.sleep(30)
    return 0
  return subprocess.run(cmd, check=False).returncode


def watch(steps):
  """Trains until the workdir holds final.json: after a run ends without it (a preemption), reruns it, first
  recreating the VM if it is gone. Bad input (exit 2) and divergence (3) end the watch: a rerun would repeat them."""
  accel = parse_accelerator(_ACCELERATOR.value, _TOPOLOGY.value)
  for what, cmd in steps[:-1]:
    if code := execute(what, cmd):
      cli.fail(f'{what} failed (exit {code}): {cli.shell_line(cmd)}', code=code)
  for restart in range(_MAX_RESTARTS.value + 1):
    code = execute(*steps[-1])
    if code in (2, 3) or _DRY_RUN.value:
      sys.exit(code)
    if execute('finished', finished_command()) == 0:
      print(f'finished: {_WORKDIR.value}/final.json', flush=True)
      return
    state = subprocess.run(state_command(), capture_output=True, text=True, check=False)
    state = state.stdout.strip() if state.returncode == 0 else 'NOT_FOUND'
    print(f'# training ended (exit {code}) without final.json; the TPU is {state}; rerun {restart + 1} of '
          f'{_MAX_RESTARTS.value} in {_WATCH_INTERVAL.value} s', flush=True)
    time.sleep(_WATCH_INTERVAL.value)
    if state in GONE:
      delete = _gcloud('delete', '--quiet', *(['--force'] if _QUEUED.value else []),
                       resource='queued-resources' if _QUEUED.value else 'tpu-vm')
      for what, cmd in [('delete', delete), *create_steps(accel), *setup_steps()]:
        execute(what, cmd)
  cli.fail(f'gave up after {_MAX_RESTARTS.value} reruns', code=1)


def launch():
  steps = plan()
  if _WATCH.value and _ACTION.value == 'train' and _TRAIN.value:
    watch(steps)
    return
  for what, cmd in steps:
    if (code := execute(what, cmd)) and what != 'state':
      cli.fail(f'{what} failed (exit {code}): {cli.shell_line(cmd)}', code=code)


def parse_flags(argv):
  """absl's parser for this script's flags; --config.* go to _OVERRIDES, --dry-run means --dry_run."""
  argv = [a.replace('--dry-run', '--dry_run', 1) if a.startswith('--dry-run') else a for a in argv]
  _OVERRIDES[:] = [a for a in argv[1:] if a.startswith('--config.')]
  try:
    return flags.FLAGS([a for a in argv if not a.startswith('--config.')])
  except flags.Error as e:
    cli.fail(str(e))


if __name__ == '__main__':
  app.run(cli.main(launch), flags_parser=parse_flags)
