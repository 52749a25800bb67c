"""laurel-train's flags and the one loader of a --config value, with its `--config.<field>=<value>` overrides: a config
file and its argument, a shipped config by name, or a run's WORKDIR (the ConfigDict of the config it saved). A bad
flag, value or field is one line naming it, and the flag or field a misspelled one means."""

import contextlib
import difflib
import functools
import importlib.util
import pathlib
import re
import sys
from typing import Sequence

import ml_collections
from absl import app, flags
from ml_collections import config_flags

from laurel import tasks, train_config
from laurel.config_lib import InputError, import_module_of, is_int
from laurel.plan import cost
from laurel.cli import compile_cache
from laurel.run import cluster
from laurel.cli.process import fail

REPO = pathlib.Path(__file__).resolve().parents[1]
TABLES = ('c4_ablation', 'imagenet_resnet50', 'residual_designs')  # configs/<table>.py, each with its ROWS


def define_flags(argv) -> flags.FlagValues:
  """laurel-train's flags, afresh for one command line (`--config.<field>` overrides in `argv` among them)."""
  fv = flags.FlagValues()
  config_flags.DEFINE_config_file('config', None, 'configs/<file>.py:<arg>', flag_values=fv, lock_config=True,
                                  sys_argv=argv)
  define = lambda kind, name, default, text, **kw: getattr(flags, f'DEFINE_{kind}')(name, default, text,
                                                                                    flag_values=fv, **kw)
  define('string', 'workdir', None, 'Directory for checkpoints, metrics and final.json.')
  define('string', 'coordinator_address', None, 'host:port of process 0 (multi-process).')
  define('integer', 'num_processes', None, 'Number of processes (multi-process).')
  define('integer', 'process_id', None, 'This process (multi-process).')
  define('float', 'join_timeout', cluster.JOIN_TIMEOUT_S, 'Seconds for every process of a multi-process run to join; '
         'then JAX aborts each (docs/clusters.md).')
  define('float', 'heartbeat_timeout', cluster.HEARTBEAT_TIMEOUT_S, "Seconds a process of a multi-process run may miss "
         "JAX's heartbeat before JAX aborts the others (a peer died; docs/clusters.md).")
  define('integer', 'preempted_exit', None, 'Exit status of a run that SIGTERM or Ctrl-C stopped, with a checkpoint, '
         'before it finished: by default 42 under a scheduler (Slurm, Kubernetes, Open MPI, a TPU VM), which xpk, '
         'JobSet and scripts/slurm_train.sbatch restart, else 0 (docs/clusters.md).')
  define('bool', 'allow_config_change', False, 'Resume checkpoints trained with another config in fields other than '
         'the resumable ones (steps, the log/eval/checkpoint cadence, the mesh, input workers), which always may '
         'change. The change is recorded in WORKDIR/config_history.jsonl.')
  define('bool', 'print_config', False, 'Print the resolved config (row and overrides, checked) as JSON and exit; a '
         "run's design from outside the package is not imported (its section is shown as saved).")
  define('bool', 'trust_design_file', False, train_config.TRUST_HELP)
  define('bool', 'compile_only', False, "Compile the step for --topology's TPU slice on this machine, check that it "
         'fits the HBM, run nothing (needs libtpu).')
  define('string', 'topology', None, 'With --compile_only: the TPU slice, e.g. v6e:4x4 or v6e-16 (v5p:2x2x4 or '
         'v5p-32).')
  define('string', 'compilation_cache', None, compile_cache.HELP)
  define('float', 'mfu', None, cost.MFU_HELP)
  return fv


def set_design_policy(argv) -> None:
  """What a run's saved config may import, from --trust_design_file and --print_config, before the flags are parsed:
  `--config=WORKDIR` reads it while they are."""
  early, names = flags.FlagValues(), ('trust_design_file', 'print_config')
  for name in names:
    flags.DEFINE_bool(name, False, '', flag_values=early)
  with contextlib.suppress(flags.Error):  # the full parse names a bad value
    early([argv[0], *(a for a in argv[1:] if a.lstrip('-').split('=')[0].removeprefix('no') in names)])
  train_config.set_design_policy(trust=early.trust_design_file, imports=not early.print_config)


def resolve_spec(spec: str) -> str:
  """'configs/<file>.py:<arg>' as given if the file exists here, else in the repo or by name in configs/ (e.g.
  'c4_ablation:rw_lr'); a run's directory or its config.json (local or gs://) as it is (parse_flags and load read
  the config it saved)."""
  if train_config.run_of(spec) is not None:
    return spec
  path, sep, arg = spec.partition(':')
  candidates = [pathlib.Path(path), REPO / path, REPO / 'configs' / path, REPO / 'configs' / f'{path}.py']
  found = next((p for p in candidates if p.is_file()), None)
  if found is None:
    shipped = sorted(p.stem for p in (REPO / 'configs').glob('*.py'))
    hint = did_you_mean(pathlib.Path(path).stem, {name: name for name in shipped})
    raise InputError(f'--config={spec!r}: no such config file{hint} (shipped: {", ".join(shipped)}; or a run\'s '
                     'WORKDIR)')
  return spec if found == candidates[0] else f'{found}{sep}{arg}'


def _alike(typed: str, known: str) -> float:
  """How alike two names are: difflib's ratio, or 0.9 where `typed` is the initials of `known`'s words (lr:
  learning_rate)."""
  initials = ''.join(word[:1] for word in known.split('_'))
  return max(difflib.SequenceMatcher(None, typed, known).ratio(), 0.9 if len(typed) > 1 and typed == initials else 0)


def did_you_mean(typed: str, known: dict[str, str]) -> str:
  """'; did you mean X?' for the X of `known` ({shown: dotted name}) whose name is most like `typed`, else ''.
  Dotted names are compared part by part (optimzer.lr: optimizer.learning_rate) as well as whole."""
  def score(name):
    parts, known_parts = typed.split('.'), name.split('.')
    by_part = min(map(_alike, parts, known_parts)) if len(parts) == len(known_parts) else 0
    return max(by_part, difflib.SequenceMatcher(None, typed, name).ratio())
  best = max(known, key=lambda shown: score(known[shown]), default=None)
  return f'; did you mean {best}?' if best is not None and score(known[best]) >= 0.7 else ''


def dotted_fields(config, prefix: str = '') -> list[str]:
  """The fields of a ConfigDict as dotted names, nested sections included."""
  names = []
  for key, value in config.items():
    names += dotted_fields(value, f'{prefix}{key}.') if isinstance(value, ml_collections.ConfigDict) else [prefix + key]
  return names


# What parsing a --config.<field> value as the type of the config's value says, and the one line it means.
VALUE_PARSE_ERRORS = {'invalid literal for int()': 'must be an integer', 'could not convert string to float':
                      'must be a number', 'Non-boolean argument to boolean flag': 'must be true or false'}


def flag_error_message(error: Exception, argv: Sequence[str], known: dict[str, str] | None = None) -> str:
  """absl's or ml_collections' error for a bad --config or --config.<field> flag, as one line; where `known` (the
  program's flags and the config's fields, {shown: name as typed}) holds a name like a misspelled one, it is named."""
  root = error
  while (cause := root.__cause__ or (None if root.__suppress_context__ else root.__context__)) is not None:
    root = cause  # the config file's own ValueError, if there is one
  message = ' '.join(str(root).replace('\\n', ' ').split())
  if isinstance(root, InputError):  # already one line naming its field (a config file's, a saved run's)
    return message
  if isinstance(root, SyntaxError):  # --config named a file that is not Python
    return f'--config={root.filename}: not a Python config file ({root.msg}, line {root.lineno})'
  if missing := re.fullmatch(r'Missing value for flag (-[-\w.]+)', message):
    return f'{missing.group(1)}: no value; write {missing.group(1)}=<value>'
  if isinstance(root, flags.UnrecognizedFlagError) and known is not None:
    return f'--{root.flagname}: unknown flag{did_you_mean(root.flagname, known)}'
  if isinstance(root, (AttributeError, KeyError)):  # a locked config rejects unknown fields this way
    name = re.search(r"'(\w+)'", message)
    bad = [a.split('=')[0][2:] for a in argv if a.startswith('--config.') and name
           and name.group(1) in a.split('=')[0].split('.')]
    fields = {shown: name for shown, name in (known or {}).items() if shown.startswith('--config.')}
    hint = did_you_mean(bad[0].removeprefix('config.'), fields) if bad else ''
    return f'{bad[0] if bad else message}: unknown config field{hint}'
  typed = re.fullmatch(r'flag (--config\.[\w.]+)=(.*?): (.*)', ' '.join(str(error).split()))
  if typed and (why := next((w for p, w in VALUE_PARSE_ERRORS.items() if p in typed.group(3)), None)):
    return f'{typed.group(1)}={typed.group(2)!r}: {why}'  # the value's type is the config's: int('eight') failed
  if root is not error and 'config' not in message and str(error).startswith('flag '):
    return f'{str(error).split(": ")[0]}: {message}'  # name the flag, e.g. --config.steps=abc
  return message


def parse_flags(argv, flag_values=flags.FLAGS):
  """absl's flag parser for a program with a `--config` file flag: configs found by name, a run's WORKDIR as the config
  it saved, a bad config or override one line with exit 2 (naming the flag or field a misspelled one means), --help
  exit 0 (absl's exits 1)."""
  if {'--help', '-h', '-?'} & set(argv[1:]):
    app.usage(shorthelp=True, writeto_stdout=True, exitcode=0)
  args = _joined(argv[1:])
  given = [a.split('=')[0] for a in args]
  if '--config' not in given and (override := next((a for a in given if a.startswith('--config.')), None)):
    fail(f'{override}: --config is required (the config file whose field it overrides)')
  try:
    import_designs(args)
    spec = _config_spec(args)
    if spec is not None and 'config' in flag_values and train_config.run_of(spec) is not None:
      parsed = _define_run_config(flag_values, spec, [argv[0], *args])
    else:
      args = ['--config=' + resolve_spec(a.split('=', 1)[1]) if a.startswith('--config=') else a for a in args]
      spec, parsed = _config_spec(args), [argv[0], *args]
    remaining = flag_values(parsed)
    if 'config' in flag_values and spec is not None:
      fit_warmup(flag_values.config, _overridden(args), spec)
    return remaining
  except (flags.Error, AttributeError, KeyError, TypeError, ValueError, SyntaxError) as e:
    fail(flag_error_message(e, args, known_names(flag_values, args)))


def _joined(args: Sequence[str]) -> list[str]:
  """`--config FILE` as `--config=FILE`, so that shipped names resolve."""
  args = list(args)
  if '--config' in args[:-1]:
    i = args.index('--config')
    args[i:i + 2] = [f'--config={args[i + 1]}']
  return args


def _config_spec(args: Sequence[str]) -> str | None:
  return next((a.removeprefix('--config=') for a in args if a.startswith('--config=')), None)


def config_spec(argv: Sequence[str]) -> str | None:
  """The --config value of a command line, as typed."""
  return _config_spec(_joined(argv[1:]))


def _define_run_config(flag_values, run: str, argv: list[str]) -> list[str]:
  """--config as the ConfigDict that `run` saved (train_config.get_config) in place of a config file's flag: a config
  dict flag, which `--config.<field>` overrides as a file's. `argv` without its --config, to parse."""
  argv = [a for a in argv if not a.startswith('--config=')]
  help_string = flag_values['config'].help
  delattr(flag_values, 'config')
  config_flags.DEFINE_config_dict('config', train_config.get_config(run), help_string, flag_values=flag_values,
                                  sys_argv=argv)
  return argv


def _overridden(args: Sequence[str]) -> list[str]:
  """The fields that `--config.<field>=<value>` arguments set."""
  return [a.split('=')[0].removeprefix('--config.') for a in args if a.startswith('--config.')]


def known_names(flag_values, args: Sequence[str]) -> dict[str, str]:
  """{shown: name} of a program's flags (--workdir: workdir) and its config's fields (--config.steps: steps)."""
  known = {f'--{name}': name for name in flag_values if '.' not in name}
  try:
    fields = dotted_fields(load(spec)) if (spec := _config_spec(args)) is not None else []
  except Exception:  # pylint: disable=broad-except  # a config that does not load names no fields
    fields = []
  return {**known, **{f'--config.{name}': name for name in fields}}


def import_designs(argv: Sequence[str]) -> None:
  """Imports a design named `--config.model.stream.design=module:name` before the config file runs: registered, it
  has its config section for the overrides that set it."""
  for arg in argv:
    name, _, value = arg.partition('=')
    module = value.rpartition(':')[0]
    if name.endswith('.stream.design') and module:
      import_module_of(module, name.removeprefix('--config.'), value)


def load(spec: str, overrides: Sequence[str] = ()) -> ml_collections.ConfigDict:
  """The config of `spec` with `--config.<field>=<value>` (or `<field>=<value>`) overrides, read as laurel.main
  reads its flags; one-line InputError for anything bad."""
  argv = [o if o.startswith('--') else f'--config.{o}' for o in overrides]
  for o in argv:
    if not o.startswith('--config.') or '=' not in o:
      raise InputError(f'{o}: write config overrides as --config.<field>=<value>')
  import_designs(argv)
  try:
    flag_values = flags.FlagValues()
    if (run := train_config.run_of(spec)) is None:
      argv = ['laurel', f'--config={resolve_spec(spec)}', *argv]
      config_flags.DEFINE_config_file('config', None, 'config file', flag_values=flag_values, sys_argv=argv)
    else:  # the config the run saved, as a dict flag that `--config.<field>` overrides as a file's
      argv = ['laurel', *argv]
      config_flags.DEFINE_config_dict('config', train_config.get_config(run), 'config', flag_values=flag_values,
                                      sys_argv=argv)
    flag_values(argv)
  except (flags.Error, AttributeError, KeyError, TypeError, ValueError) as e:
    raise InputError(flag_error_message(e, argv)) from None
  fit_warmup(flag_values.config, _overridden(argv), spec)
  return flag_values.config


def fit_warmup(config, overridden: Sequence[str], spec: str) -> None:
  """A run made no longer (`steps` among the `overridden` fields) than its config file's warmup warms up for the
  same fraction of it as the file's run does, with a one-line notice; a warmup set on the command line is left as it
  is (train_config.validate_config then names a value that fits)."""
  if 'steps' not in overridden or 'optimizer.warmup_steps' in overridden or 'optimizer' not in config:
    return
  steps, warmup = config.steps, config.optimizer.warmup_steps
  if not (is_int(steps) and is_int(warmup) and warmup >= steps >= 1):
    return
  file = load(spec)
  fitted = min(steps - 1, round(steps * file.optimizer.warmup_steps / file.steps))  # a step past it, at least
  config.optimizer.warmup_steps = fitted
  print(f'notice: optimizer.warmup_steps={warmup} is {"longer than" if warmup > steps else "as long as"} the run '
        f'(steps={steps}): it warms up for {fitted} steps instead, {fitted / steps:.0%} of the run as in the config '
        'file (--config.optimizer.warmup_steps sets it)', file=sys.stderr, flush=True)


def table_rows(config_file: str) -> list[str]:
  """The rows (ROWS) of a config file, or of configs/<table>.py, in its order."""
  path = config_file if config_file.endswith('.py') else str(REPO / 'configs' / f'{config_file}.py')
  spec = importlib.util.spec_from_file_location('laurel_config_table', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return list(module.ROWS)


def check_overrides(config: train_config.TrainConfig, spec: str, overrides: dict) -> list[str]:
  """An InputError for an override ({field: value}) of a field the typed `config` leaves unused (a sweep would train
  one model many times) unlike the config file's (`spec`); a warning for one that only repeats the file's value."""
  unused = tasks.get_task(config).unused_fields()
  overridden = {name: value for name, value in overrides.items() if name in unused}
  base = load(spec) if overridden else None
  for name, value in overridden.items():
    if value != functools.reduce(lambda node, part: node[part], name.split('.'), base):
      raise InputError(f'{name}={value!r}: changes nothing: {unused[name]}')
  return [f'warning: {name}={value!r} changes nothing ({unused[name]})' for name, value in overridden.items()]
