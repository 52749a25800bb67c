"""The scripts' shared command line: the repository root on the path, bad input as one line, a command as typed in
the repository root, --set overrides as laurel.main's --config.<field>=<value>, and JSON result files. A script that
uses it imports it before laurel."""

import functools
import json
import os
import pathlib
import re
import shlex
import sys

from absl import logging
from etils import epath

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `python scripts/x.py` puts scripts/ on the path, not the repo root
  sys.path.insert(0, str(ROOT))
from laurel import config_lib  # pylint: disable=g-import-not-at-top,wrong-import-position  # noqa: E402
from laurel.cli import console, files  # pylint: disable=g-import-not-at-top,wrong-import-position  # noqa: E402
from laurel.cli.process import fail  # pylint: disable=g-import-not-at-top,wrong-import-position  # noqa: E402,F401


def main(body):
  """absl's main for `body()`: no stray arguments; the CPU where libtpu is installed but no accelerator is present
  (console.quiet_start: not libtpu's errors on stderr); an InputError (bad input) ends the script as one line
  `error: ...`; anything else keeps its traceback."""
  def run(argv):
    if len(argv) > 1:
      fail(f'unexpected arguments: {" ".join(argv[1:])}')
    console.quiet_start()
    logging.set_verbosity(logging.WARNING)
    try:
      body()
    except config_lib.InputError as e:
      fail(str(e))
  return run


TABLES = ('c4_ablation', 'residual_designs')  # the LM tables: configs/<table>.py, each with a baseline_24 row


def write_json(path: str, result: dict):
  """`result` as indented JSON at `path` (local or gs://), its directory made as needed."""
  epath.Path(path).parent.mkdir(parents=True, exist_ok=True)
  files.write_text_atomic(path, json.dumps(result, indent=2) + '\n')


def write_json_lines(path, rows: list[dict]):
  """`rows` as JSON lines at `path`, written whole (not every filesystem appends)."""
  files.write_text_atomic(path, ''.join(json.dumps(r) + '\n' for r in rows))


def command() -> str:
  """This script's command line, as typed in the repo root."""
  return shlex.join(['python', os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]])


def require(**flag_holders):
  if missing := [name for name, holder in flag_holders.items() if not holder.value]:
    raise config_lib.InputError(f'--{missing[0]} is required')


def config_flags(sets) -> list[str]:
  """--set values, <field>=<value> (or --config.<field>=<value>), as laurel.main's --config.<field>=<value>."""
  return [f'--config.{s.removeprefix("--").removeprefix("config.")}' for s in sets]


def override_field(override: str) -> str:
  """The dotted field of <field>=<value> or --config.<field>=<value>."""
  return override.split('=', 1)[0].removeprefix('--').removeprefix('config.')


def override_values(config, overrides) -> dict:
  """{field: its value in the ConfigDict `config`} of <field>=<value> overrides, as command_line.check_overrides reads
  them."""
  get = lambda dotted: functools.reduce(lambda node, part: node[part], dotted.split('.'), config)
  return {f: get(f) for f in map(override_field, overrides)}


def typed(cmd: list[str]) -> list[str]:
  """A command as one types it in the repo root: `python`, and paths inside the repo relative to it, as arguments
  or as a --flag's value (a fresh clone elsewhere has them there too)."""
  def relative(arg):
    flag, sep, value = arg.partition('=') if arg.startswith('--') else ('', '', arg)
    return flag + sep + os.path.relpath(value, ROOT) if value.startswith(f'{ROOT}{os.sep}') else arg
  return ['python' if a == sys.executable else relative(a) for a in cmd]


def repo_spec(spec: str) -> str:
  """A config spec as the TPU hosts can read it: relative to the repository root, or a shipped config's name."""
  from laurel import command_line, train_config  # pylint: disable=import-outside-toplevel  # the model stack: on use
  if train_config.run_of(spec) is not None:  # a run's WORKDIR: the hosts read the config it saved where it is
    return spec
  resolved = command_line.resolve_spec(spec)
  path, sep, arg = resolved.partition(':')
  if not os.path.isabs(path):
    return resolved
  if not pathlib.Path(path).is_relative_to(ROOT):
    raise config_lib.InputError(f'--config={spec!r}: outside the repository, so the TPU hosts do not have it')
  return f'{pathlib.Path(path).relative_to(ROOT)}{sep}{arg}'


def shell_line(cmd: list[str]) -> str:
  """The command as one shell line; --flag=value arguments quote only the value, as one would type them."""
  return ' '.join(m.group(1) + shlex.quote(m.group(2)) if (m := re.fullmatch(r'(--[\w-]+=)(.*)', arg, re.S))
                  else shlex.quote(arg) for arg in cmd)
