"""Config schemas (frozen dataclasses declaring each field's default and check) and the one config loader: a bad
value is a one-line InputError naming field and value."""

import dataclasses
import difflib
import importlib.util
import math
import pathlib
import re
import sys
from typing import Sequence

import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import app, flags
from etils import epath
from ml_collections import config_flags

REPO = pathlib.Path(__file__).resolve().parents[1]
TABLES = ('c4_ablation', 'imagenet_resnet50', 'residual_designs')  # configs/<table>.py, each with its ROWS
DTYPES = {'float32': jnp.float32, 'bfloat16': jnp.bfloat16}  # the `dtype` and `param_dtype` of a model config


def is_int(value) -> bool:
  """An integer, not a bool (True is an int to Python, never a sensible rank or width)."""
  return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def is_number(value) -> bool:
  """A finite number, not a bool: inf and nan are no setting (they fail only after compiling, or train NaN)."""
  return (isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))
          and math.isfinite(value))


# Checks: (predicate, why). `field(default, check)` attaches one to a dataclass field.
POSITIVE_INT = (lambda v: is_int(v) and v >= 1, 'must be a positive integer')
NON_NEGATIVE_INT = (lambda v: is_int(v) and v >= 0, 'must be a non-negative integer')
BOOL = (lambda v: isinstance(v, bool), 'must be a bool')
STRING = (lambda v: isinstance(v, str), 'must be a string')
NON_EMPTY_STRING = (lambda v: isinstance(v, str) and bool(v), 'must be a non-empty string')
POSITIVE = (lambda v: is_number(v) and v > 0, 'must be a positive number')
NON_NEGATIVE = (lambda v: is_number(v) and v >= 0, 'must be a non-negative number')


def one_of(*choices):
  return (lambda v: v in choices, f'must be one of {", ".join(map(str, choices))}')


def in_range(lo, hi, closed=(True, True)):
  ok = lambda v: is_number(v) and (lo <= v if closed[0] else lo < v) and (v <= hi if closed[1] else v < hi)
  return (ok, f'must be a number in {"[(" [not closed[0]]}{lo}, {hi}{"])" [not closed[1]]}')


def field(default, check=None, resumable=False, **kwargs):  # resumable: a resume may change it (laurel.run.checkpoint)
  return dataclasses.field(default=default, metadata={'resumable': resumable, **({'check': check} if check else {})},
                           **kwargs)


class InputError(ValueError):
  """Bad input (a config field, a flag, a path, a workdir): what the user can fix. Only this becomes a one-line
  `error: ...` with exit 2; any other exception is a bug or an environment failure and keeps its traceback."""
  exit_status = 2  # laurel.run.process.BAD_INPUT


def require(ok: bool, field_name: str, value, why: str) -> None:
  if not ok:
    raise InputError(f'{field_name}={value!r}: {why}')


def config_dict(schema, **overrides) -> ml_collections.ConfigDict:
  """The ConfigDict of a dataclass (class or instance), each field at its default or `overrides[name]` (a dict
  updates a nested section)."""
  base = schema() if isinstance(schema, type) else schema
  out = ml_collections.ConfigDict()
  for f in dataclasses.fields(base):
    default = getattr(base, f.name)
    if 'sections' in f.metadata:  # a model's residual design: `stream.design` and each design's section
      out.update(f.metadata['sections'](default, overrides))
      continue
    value = overrides.pop(f.name, default)
    if dataclasses.is_dataclass(default) and isinstance(value, dict):
      value = config_dict(default, **value)
    elif dataclasses.is_dataclass(value):
      value = config_dict(value)
    out[f.name] = value
  if overrides:
    raise InputError(f'{type(base).__name__}: unknown fields {", ".join(sorted(overrides))}')
  return out


def to_dict(config) -> dict:
  """A typed config in JSON's types (tuples as lists), a model's residual design as `stream.design` and that design's
  section alone: what config.json, a checkpoint's config signature, the config hash and --print_config hold."""
  plain = lambda v: (to_dict(v) if dataclasses.is_dataclass(v) else list(map(plain, v)) if isinstance(v, (tuple, list))
                     else v)
  out = {}
  for f in dataclasses.fields(config):
    value = getattr(config, f.name)
    out.update(f.metadata['to_dict'](value) if 'to_dict' in f.metadata else {f.name: plain(value)})
  return out


def build(cls, cfg, prefix: str, skip: Sequence[str] = ()):
  """`cls` from a ConfigDict (or dict) of some of its fields, each checked, then `obj.check(prefix)` across fields;
  InputError('<prefix>.<field>=<value>: why'). A `cls` already built is returned as it is."""
  if isinstance(cfg, cls):
    return cfg
  fields = {f.name: f for f in dataclasses.fields(cls)}
  path = lambda name: f'{prefix}.{name}' if prefix else name
  values = {k: v for k, v in dict(cfg.items() if cfg is not None else {}).items() if k not in skip}
  built = {f.name: f.metadata['build'](f.default, values, prefix) for f in fields.values() if 'build' in f.metadata}
  if unknown := sorted(set(values) - set(fields)):
    raise InputError(f'{path(unknown[0])}: unknown field (known: {", ".join(sorted(set(fields) - set(skip)))})')
  for name, value in values.items():
    f = fields[name]
    if dataclasses.is_dataclass(f.default):
      values[name] = build(type(f.default), value, path(name))
    elif 'check' in f.metadata:
      ok, why = f.metadata['check']
      require(bool(ok(value)), path(name), value, why)
  obj = cls(**values, **built)
  if hasattr(obj, 'check'):
    obj.check(prefix)
  return obj


def parse_arg(arg: str | None, rows, default_row: str, options: dict) -> tuple[str, dict]:
  """'row,key=value,...' -> (row, {key: value}). `options` maps key -> (default, allowed values)."""
  row, chosen = default_row, {k: default for k, (default, _) in options.items()}
  for part in filter(None, (p.strip() for p in (arg or '').split(','))):
    key, sep, value = part.partition('=')
    if not sep:
      row = part
      continue
    if key not in options:
      raise InputError(f'config arg {key}={value!r}: unknown option (known: {", ".join(sorted(options))})')
    if value not in options[key][1]:
      raise InputError(f'config arg {key}={value!r}: must be one of {", ".join(options[key][1])}')
    chosen[key] = value
  if row not in rows:
    raise InputError(f'config row {row!r}: unknown (known: {", ".join(rows)})')
  return row, chosen


def resolve_spec(spec: str) -> str:
  """'configs/<file>.py:<arg>' as given if the file exists here, else in the repo or by name in configs/ (e.g.
  'c4_ablation:rw_lr'); a run's directory or its config.json (local or gs://) is the config it saved."""
  if '://' in spec or ':' not in spec:  # no config file's argument: perhaps a run
    try:
      path = epath.Path(spec)
      saved = path.is_file() if path.name.endswith('.json') else (path / 'config.json').is_file()
    except Exception as e:  # pylint: disable=broad-except  # whatever the filesystem raises, as one line
      raise InputError(f'--config={spec!r}: {io_error_reason(e)}') from None
    if saved:
      return f'{REPO / "laurel" / "run" / "saved_config.py"}:{spec}'
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


def io_error_reason(error: Exception) -> str:
  """Why reading or writing a path failed, as one line; a missing filesystem package (gcsfs) names its install."""
  reason = f'{type(error).__name__}: {(str(error).splitlines() or [""])[0][:200]}'
  if isinstance(error, ImportError):
    return f"its filesystem is not installed: pip install -e '.[gcs]' ({reason})"
  return reason


def optional_import(module: str, extra: str, what: str):
  """`module`, which the optional extra `extra` installs; without it a one-line InputError naming `what`."""
  try:
    return importlib.import_module(module)
  except ImportError as e:
    raise InputError(f"{what}: needs the optional extra [{extra}]: pip install -e '.[{extra}]' ({e})") from None


def fail(message: str, code: int = 2):
  """Ends the program with one line `error: <message>` on stderr; status 2 is bad input."""
  print(f'error: {message}', file=sys.stderr, flush=True)
  sys.exit(code)


def parse_flags(argv, flag_values=flags.FLAGS):
  """absl's flag parser for a program with a `--config` file flag: configs found by name, a bad config or override
  one line with exit 2 (naming the flag or field a misspelled one means), --help exit 0 (absl's exits 1)."""
  if {'--help', '-h', '-?'} & set(argv[1:]):
    app.usage(shorthelp=True, writeto_stdout=True, exitcode=0)
  args = list(argv[1:])
  if '--config' in args[:-1]:  # `--config FILE` as `--config=FILE`, so that shipped names resolve
    i = args.index('--config')
    args[i:i + 2] = [f'--config={args[i + 1]}']
  given = [a.split('=')[0] for a in args]
  if '--config' not in given and (override := next((a for a in given if a.startswith('--config.')), None)):
    fail(f'{override}: --config is required (the config file whose field it overrides)')
  try:
    import_designs(args)
    args = ['--config=' + resolve_spec(a.split('=', 1)[1]) if a.startswith('--config=') else a for a in args]
    remaining = flag_values([argv[0], *args])
    if 'config' in flag_values and (spec := _config_spec(args)) is not None:
      fit_warmup(flag_values.config, _overridden(args), spec)
    return remaining
  except (flags.Error, AttributeError, KeyError, TypeError, ValueError, SyntaxError) as e:
    fail(flag_error_message(e, args, known_names(flag_values, args)))


def _config_spec(args: Sequence[str]) -> str | None:
  return next((a.removeprefix('--config=') for a in args if a.startswith('--config=')), None)


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


def import_module_of(module: str, field_name: str, name: str) -> None:
  """Imports the module of design `name` ('module:name') from the Python path; else a one-line InputError saying
  what to do. A module a run's config.json names is laurel.run.saved_config's to import (the user's word first)."""
  try:
    importlib.import_module(module)
    return
  except ImportError as e:
    error = e
  not_found = error.name is not None and (module + '.').startswith(error.name + '.')  # not its own imports
  hint = f': put the folder holding {module.replace(".", "/")}.py on PYTHONPATH' if not_found else ''
  raise InputError(f'{field_name}={name!r}: cannot import {module} ({error}){hint}')


def load(spec: str, overrides: Sequence[str] = ()) -> ml_collections.ConfigDict:
  """The config of `spec` with `--config.<field>=<value>` (or `<field>=<value>`) overrides, read as laurel.main
  reads its flags; one-line InputError for anything bad."""
  argv = [o if o.startswith('--') else f'--config.{o}' for o in overrides]
  for o in argv:
    if not o.startswith('--config.') or '=' not in o:
      raise InputError(f'{o}: write config overrides as --config.<field>=<value>')
  import_designs(argv)
  try:
    argv = ['laurel', f'--config={resolve_spec(spec)}', *argv]
    flag_values = flags.FlagValues()
    config_flags.DEFINE_config_file('config', None, 'config file', flag_values=flag_values, sys_argv=argv)
    flag_values(argv)
  except (flags.Error, AttributeError, KeyError, TypeError, ValueError) as e:
    raise InputError(flag_error_message(e, argv)) from None
  fit_warmup(flag_values.config, _overridden(argv), spec)
  return flag_values.config


def fit_warmup(config, overridden: Sequence[str], spec: str) -> None:
  """A run made no longer (`steps` among the `overridden` fields) than its config file's warmup warms up for the
  same fraction of it as the file's run does, with a one-line notice; a warmup set on the command line is left as it
  is (validate_config then names a value that fits)."""
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
