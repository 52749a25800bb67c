"""Helpers shared by the scripts in this folder: load a config file, apply `field=value` overrides."""

from __future__ import annotations

import ast
import importlib.util
import math
import pathlib
import re
import shlex
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `python scripts/x.py` puts scripts/ on the path, not the repo root
  sys.path.insert(0, str(ROOT))


def fail(message: str, code: int = 2):
  print(f'error: {message}', file=sys.stderr, flush=True)
  sys.exit(code)


def split_spec(spec: str) -> tuple[str, str]:
  """'configs/<file>.py:<arg>' -> (path, arg)."""
  path, _, arg = spec.partition(':')
  return path, arg


def config_path(spec: str) -> pathlib.Path:
  """The config file of `spec`, relative to the current directory or else to the repo root."""
  path = pathlib.Path(split_spec(spec)[0])
  if not path.is_file() and (ROOT / path).is_file():
    path = ROOT / path
  if not path.is_file():
    raise ValueError(f'--config={spec!r}: no such config file')
  return path


def runnable_spec(spec: str) -> str:
  """`spec` with its file made absolute if it is only found relative to the repo root, for subprocesses."""
  path, arg = split_spec(spec)
  return spec if pathlib.Path(path).is_file() else f'{config_path(spec)}:{arg}'


def load_module(path):
  module_spec = importlib.util.spec_from_file_location(pathlib.Path(path).stem, path)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  return module


def load_config(spec: str, arg: str | None = None):
  """get_config(arg) of the file in `spec`; `arg` defaults to the part after the colon."""
  return load_module(config_path(spec)).get_config(split_spec(spec)[1] if arg is None else arg)


def get_field(config, dotted: str):
  node = config
  for part in dotted.split('.'):
    try:
      node = node[part]
    except (KeyError, AttributeError, TypeError):
      raise ValueError(f'{dotted}: unknown config field') from None
  return node


def parse_value(current, text: str):
  """`text` as the type of the field's current value, the way `--config.<field>=<text>` reads it."""
  if isinstance(current, bool):
    if text.lower() in ('true', '1', 'yes'):
      return True
    if text.lower() in ('false', '0', 'no'):
      return False
    raise ValueError('expected true or false')
  if isinstance(current, int):
    return int(text)
  if isinstance(current, float):
    return float(text)
  if isinstance(current, str):
    return text
  return ast.literal_eval(text)  # tuples, lists, None


def set_field(config, dotted: str, text: str):
  """Assigns `text`, typed like the field, to `config.<dotted>`; one-line ValueError naming the field."""
  current = get_field(config, dotted)
  *parents, leaf = dotted.split('.')
  node = get_field(config, '.'.join(parents)) if parents else config
  try:
    value = parse_value(current, text)
  except (ValueError, SyntaxError) as e:
    raise ValueError(f'{dotted}={text!r}: not a valid {type(current).__name__} ({e})') from None
  try:
    node[leaf] = value
  except (TypeError, ValueError) as e:
    raise ValueError(f'{dotted}={text!r}: {e}') from None


def parse_assignment(text: str) -> tuple[str, str]:
  """'field=value' -> (field, value); the field may be written --config.field."""
  field, sep, value = text.partition('=')
  field = field.removeprefix('--').removeprefix('config.')
  if not sep or not field:
    raise ValueError(f'{text!r}: expected field=value, e.g. model.laurel.rank=16')
  return field, value


# Cloud TPU VMs: slices, gcloud commands and the command each host runs (scripts/launch_tpu.py, sweep.py).

# generation: accelerator-type prefix, TensorCores per chip in its name, software version, largest size.
GENERATIONS = {
    'v4': ('v4', 2, 'tpu-ubuntu2204-base', 4096),
    'v5p': ('v5p', 2, 'v2-alpha-tpuv5', 4096),
    'v5e': ('v5litepod', 1, 'v2-alpha-tpuv5-lite', 256),
    'v6e': ('v6e', 1, 'v2-alpha-tpuv6e', 256),
}
# Chips -> the slice's topology: 2-D for v5e/v6e, 3-D for v4/v5p (4 chips per host on all of them).
TOPOLOGY_2D = {1: '1x1', 4: '2x2', 8: '2x4', 16: '4x4', 32: '4x8', 64: '8x8', 128: '8x16', 256: '16x16'}
TOPOLOGY_3D = {4: '2x2x1', 8: '2x2x2', 16: '2x2x4', 32: '2x4x4', 64: '4x4x4', 128: '4x4x8', 256: '4x8x8',
               512: '8x8x8', 1024: '8x8x16', 2048: '8x16x16'}
REMOTE_DIR = 'laurel'  # in each host's home directory
REMOTE_PYTHON = '.venv/bin/python'  # relative to REMOTE_DIR
TARBALL = 'laurel-src.tar.gz'


def parse_accelerator(name: str, topology: str | None = None) -> dict:
  """'v6e-16' -> generation, chips, hosts, topology and the create flags; one-line ValueError otherwise."""
  known = ', '.join(f'{p}-N' for p, *_ in GENERATIONS.values())
  match = re.fullmatch(r'(v4|v5p|v5litepod|v5e|v6e)-(\d+)', name or '')
  if not match:
    raise ValueError(f'--accelerator={name!r}: unknown TPU accelerator type (known: {known}, e.g. v6e-16)')
  prefix, size = match.group(1), int(match.group(2))
  prefix = 'v5litepod' if prefix == 'v5e' else prefix
  gen = next(g for g, (p, *_) in GENERATIONS.items() if p == prefix)
  _, cores_per_chip, version, largest = GENERATIONS[gen]
  chips, table = size // cores_per_chip, (TOPOLOGY_3D if cores_per_chip == 2 else TOPOLOGY_2D)
  if size % cores_per_chip or chips not in table or size > largest:
    sizes = ', '.join(str(c * cores_per_chip) for c in table if c * cores_per_chip <= largest)
    raise ValueError(f'--accelerator={name!r}: no such {gen} slice (sizes: {sizes})')
  # 4 chips per host, except the single-host v5e/v6e slices of up to 8 chips.
  hosts = 1 if cores_per_chip == 1 and chips <= 8 else max(1, chips // 4)
  accel = {'name': f'{prefix}-{size}', 'generation': gen, 'chips': chips, 'hosts': hosts,
           'topology': table[chips], 'version': version, 'create_flags': [f'--accelerator-type={prefix}-{size}']}
  if topology and topology != accel['topology']:
    dims = topology.split('x')
    if gen != 'v4':
      raise ValueError(f'--topology={topology!r}: only v4 takes a custom topology; {accel["name"]} is '
                       f'{accel["topology"]}')
    if len(dims) != 3 or not all(d.isdigit() and int(d) > 0 for d in dims) or math.prod(map(int, dims)) != chips:
      raise ValueError(f'--topology={topology!r}: must be AxBxC with A*B*C = {chips} chips ({accel["name"]})')
    accel.update(topology=topology, create_flags=['--type=v4', f'--topology={topology}'])
  return accel


def gcloud(verb: str, positional: list[str], zone: str, project: str | None, *extra: str) -> list[str]:
  project_flag = [f'--project={project}'] if project else []
  return ['gcloud', 'compute', 'tpus', 'tpu-vm', verb, *positional, f'--zone={zone}', *project_flag, *extra]


def ssh(tpu, zone, project, command: str) -> list[str]:
  """`command` on every host of the slice at once."""
  return gcloud('ssh', [tpu], zone, project, '--worker=all', f'--command={command}')


def train_command(config_spec: str, workdir: str, hosts: int, overrides=(), detach=False) -> str:
  """What every host runs: laurel.main from the repo's venv. --num_processes lets jax.distributed find the
  coordinator itself (TPU metadata), before anything starts a backend."""
  args = [REMOTE_PYTHON, '-m', 'laurel.main', f'--config={config_spec}', f'--workdir={workdir}',
          f'--num_processes={hosts}', *overrides]
  run = shlex.join(args)
  if detach:
    run = f'nohup {run} > train.log 2>&1 < /dev/null &'
  return f'cd {REMOTE_DIR} && {run}'


def setup_command(jax_requirement: str, repo_url: str | None, ref: str, install: bool) -> str:
  if not re.fullmatch(r'[\w.\[\],=<>!~-]+', jax_requirement):
    raise ValueError(f'--jax={jax_requirement!r}: not a pip requirement such as jax[tpu]==0.10.2')
  steps = []
  if repo_url:
    url, ref = shlex.quote(repo_url), shlex.quote(ref)
    steps.append(f'if [ -d {REMOTE_DIR}/.git ]; then git -C {REMOTE_DIR} fetch -q origin {ref} && '
                 f'git -C {REMOTE_DIR} checkout -q --force FETCH_HEAD; else git clone -q {url} {REMOTE_DIR} && '
                 f'git -C {REMOTE_DIR} checkout -q {ref}; fi')
  else:
    steps.append(f'mkdir -p {REMOTE_DIR} && tar xzf {TARBALL} -C {REMOTE_DIR} && rm {TARBALL}')
  if install:
    steps += [f'cd {REMOTE_DIR}', 'python3 -m pip install -q --user uv',
              'python3 -m uv venv -q --allow-existing --python 3.11 .venv',
              f'python3 -m uv pip install -q --python {REMOTE_PYTHON} "{jax_requirement}" gcsfs -e .']
  return 'set -e; ' + ' && '.join(steps)


def shell_line(cmd: list[str]) -> str:
  """The command as one shell line; --flag=value arguments quote only the value, as one would type them."""
  out = []
  for arg in cmd:
    match = re.fullmatch(r'(--[\w-]+=)(.*)', arg, re.S)
    out.append(match.group(1) + shlex.quote(match.group(2)) if match else shlex.quote(arg))
  return ' '.join(out)
