"""Runs `python -m laurel.main` on every host of a Cloud TPU VM (v4, v5e, v5p, v6e), creating it if asked.

  python scripts/launch_tpu.py --tpu=NAME --zone=ZONE --accelerator=v6e-16 [--create] [--version=...] [--dry-run]
      --config=configs/c4_ablation.py:rw_lr --workdir=gs://BUCKET/runs/rw_lr [--config.<field>=<value> ...]

Four steps, gcloud commands (--dry-run prints them, one per line, and runs nothing):
  1. create (only with --create): `gcloud compute tpus tpu-vm create` with --accelerator-type (or, for v4, --type
     and a custom --topology) and the software version of the generation (--version to change it).
  2. ship the code. By default the files of this working tree that git knows or would add (`git ls-files -co
     --exclude-standard`: uncommitted edits included, ignored files such as .venv not) are packed into a tarball
     and copied to every host (`tpu-vm scp --worker=all`). With --repo_url every host clones that repository and
     checks out --ref instead.
  3. install (skip with --noinstall): TPU VM images have Python 3.10 and jax needs >= 3.11, so uv (installed with
     pip --user) makes a Python 3.11 venv, ~/laurel/.venv, with jax[tpu] at this machine's jax version, gcsfs (for
     gs:// workdirs) and the repo.
  4. train: `tpu-vm ssh --worker=all --command='cd laurel && .venv/bin/python -m laurel.main ...'`, the same
     command on every host at once, with --num_processes=<the slice's hosts>: jax.distributed then finds the
     coordinator itself, and laurel.main skips its TPU check, which starts a backend before
     jax.distributed.initialize() and so fails. --detach runs it under nohup (log: ~/laurel/train.log on each
     host) and returns. --notrain stops after step 3 (set up a VM for scripts/sweep.py --launch=print).

The config and every --config.* override are read here first and checked with laurel.train.validate_config for
the slice's device and host counts, so a typo or a batch that does not divide fails in a second, before any
gcloud command. Overrides must be written --config.<field>=<value>; they are passed on unchanged. The workdir
should be on GCS: every host writes checkpoints there. Needs gcloud logged in, with a default project or
--project.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
import tarfile
import tempfile

import common  # puts the repo root on sys.path
from absl import app, flags

_CONFIG = flags.DEFINE_string('config', None, 'configs/<file>.py:<arg>, as for laurel.main.')
_WORKDIR = flags.DEFINE_string('workdir', None, 'Run directory, e.g. gs://BUCKET/runs/rw_lr (shared by all hosts).')
_TPU = flags.DEFINE_string('tpu', None, 'TPU VM name.')
_ZONE = flags.DEFINE_string('zone', None, 'Zone, e.g. us-east5-b.')
_PROJECT = flags.DEFINE_string('project', None, "Google Cloud project; default: gcloud's.")
_ACCELERATOR = flags.DEFINE_string('accelerator', None, 'v4-<cores>, v5litepod-<chips> (or v5e-<chips>), '
                                   'v5p-<cores> or v6e-<chips>, e.g. v6e-16.')
_TOPOLOGY = flags.DEFINE_string('topology', None, 'v4 only: a custom chip topology AxBxC for --create.')
_VERSION = flags.DEFINE_string('version', None, 'TPU software version; default: the one for the generation.')
_CREATE = flags.DEFINE_bool('create', False, 'Create the TPU VM first.')
_SPOT = flags.DEFINE_bool('spot', False, 'With --create: a Spot VM.')
_REPO_URL = flags.DEFINE_string('repo_url', None, 'git clone this on every host instead of copying the working tree.')
_REF = flags.DEFINE_string('ref', 'main', 'With --repo_url: branch, tag or commit to check out.')
_INSTALL = flags.DEFINE_bool('install', True, 'Make the venv and install jax[tpu], gcsfs and the repo.')
_JAX = flags.DEFINE_string('jax', None, "pip requirement for jax; default: jax[tpu]==<this machine's jax>.")
_DETACH = flags.DEFINE_bool('detach', False, 'Run the training under nohup and return at once.')
_TRAIN = flags.DEFINE_bool('train', True, 'Run laurel.main; --notrain only creates, ships and installs.')
_DRY_RUN = flags.DEFINE_bool('dry_run', False, 'Print the commands (also spelled --dry-run); run nothing.')
_VALIDATE = flags.DEFINE_bool('validate', True, 'Check the config for the slice before launching.')
_OVERRIDES = []  # the --config.<field>=<value> arguments, taken out of argv before absl parses it


def tarball_path(tpu: str) -> str:
  return os.path.join(tempfile.gettempdir(), f'laurel-src-{tpu}.tar.gz')


def pack_working_tree(path: str):
  """The files git tracks or would add (not ignored), as they are on disk now."""
  names = subprocess.run(['git', 'ls-files', '-z', '-co', '--exclude-standard'], cwd=common.ROOT, check=True,
                         capture_output=True).stdout.decode().split('\0')
  with tarfile.open(path, 'w:gz') as tar:
    for name in sorted(n for n in names if n and (common.ROOT / n).is_file()):
      tar.add(common.ROOT / name, arcname=name)


def load_config():
  """The config with the overrides applied, as laurel.main will read it; one-line ValueError otherwise."""
  config = common.load_config(_CONFIG.value)
  for arg in _OVERRIDES:
    if '=' not in arg:
      raise ValueError(f'{arg}: write config overrides as --config.<field>=<value>')
    common.set_field(config, *common.parse_assignment(arg))
  return config


def plan() -> list[tuple[str, list[str] | str]]:
  """[(what, command)]: a gcloud argv, or for a local step a description."""
  required = (('tpu', _TPU), ('zone', _ZONE), ('accelerator', _ACCELERATOR)) + (
      (('workdir', _WORKDIR), ('config', _CONFIG)) if _TRAIN.value else ())
  for name, flag in required:
    if not flag.value:
      raise ValueError(f'--{name} is required')
  if not re.fullmatch(r'[a-z]([-a-z0-9]{0,61}[a-z0-9])?', _TPU.value):
    raise ValueError(f'--tpu={_TPU.value!r}: lowercase letters, digits and hyphens, starting with a letter')
  accel = common.parse_accelerator(_ACCELERATOR.value, _TOPOLOGY.value)
  if _TRAIN.value and _VALIDATE.value:
    from laurel import train  # pylint: disable=import-outside-toplevel
    train.validate_config(load_config(), num_devices=accel['chips'], process_count=accel['hosts'])
  if _TRAIN.value and accel['hosts'] > 1 and '://' not in _WORKDIR.value:
    print(f'warning: --workdir={_WORKDIR.value!r} is not on GCS; all {accel["hosts"]} hosts must see the same '
          'directory', file=sys.stderr)
  tpu, zone, project = _TPU.value, _ZONE.value, _PROJECT.value
  jax_requirement = _JAX.value or f'jax[tpu]=={importlib.metadata.version("jax")}'
  steps = []
  if _CREATE.value:
    version = f'--version={_VERSION.value or accel["version"]}'
    steps.append(('create', common.gcloud('create', [tpu], zone, project, *accel['create_flags'], version,
                                          *(['--spot'] if _SPOT.value else []))))
  if not _REPO_URL.value:
    tarball = tarball_path(tpu)
    steps.append(('pack', f'pack the working tree (git ls-files -co --exclude-standard) into {tarball}'))
    steps.append(('copy', common.gcloud('scp', [tarball, f'{tpu}:{common.TARBALL}'], zone, project,
                                        '--worker=all')))
  setup = common.setup_command(jax_requirement, _REPO_URL.value, _REF.value, _INSTALL.value)
  steps.append(('setup', common.ssh(tpu, zone, project, setup)))
  if _TRAIN.value:
    run = common.train_command(_CONFIG.value, _WORKDIR.value, accel['hosts'], _OVERRIDES, _DETACH.value)
    steps.append(('train', common.ssh(tpu, zone, project, run)))
  return steps


def main(argv):
  if len(argv) > 1:
    common.fail(f'unexpected arguments: {" ".join(argv[1:])}')
  try:
    steps = plan()
  except ValueError as e:
    common.fail(str(e))
  for what, cmd in steps:
    line = f'# {cmd}' if isinstance(cmd, str) else common.shell_line(cmd)
    print(line, flush=True)
    if _DRY_RUN.value:
      continue
    if what == 'pack':
      pack_working_tree(tarball_path(_TPU.value))
      continue
    code = subprocess.run(cmd).returncode
    if code:
      common.fail(f'{what} failed (exit {code}): {common.shell_line(cmd)}', code=code)


def parse_flags(argv):
  """absl's parser for this script's flags; --config.* go to _OVERRIDES, --dry-run means --dry_run."""
  argv = [a.replace('--dry-run', '--dry_run', 1) if a.startswith('--dry-run') else a for a in argv]
  _OVERRIDES[:] = [a for a in argv[1:] if a.startswith('--config.')]
  try:
    return flags.FLAGS([a for a in argv if not a.startswith('--config.')])
  except flags.Error as e:
    common.fail(str(e))


if __name__ == '__main__':
  app.run(main, flags_parser=parse_flags)
