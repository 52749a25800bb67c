"""The config schema engine: frozen dataclasses declaring each field's default and check (`field`), their ConfigDict
and JSON forms, and `build`, which checks every field: a bad value is a one-line InputError naming field and value.
The designs and model modules declare their sections with it; the typed train config is laurel.train_config's."""

import dataclasses
import importlib
import math
from typing import Sequence

import jax.numpy as jnp
import ml_collections
import numpy as np

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


def field(default, check=None, resumable=False, **kwargs):  # resumable: a resume may change it (laurel.train_config)
  return dataclasses.field(default=default, metadata={'resumable': resumable, **({'check': check} if check else {})},
                           **kwargs)


class InputError(ValueError):
  """Bad input (a config field, a flag, a path, a workdir): what the user can fix. Only this becomes a one-line
  `error: ...` with exit 2; any other exception is a bug or an environment failure and keeps its traceback."""
  exit_status = 2  # laurel.cli.process.BAD_INPUT


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


def import_module_of(module: str, field_name: str, name: str) -> None:
  """Imports the module of design `name` ('module:name') from the Python path; else a one-line InputError saying
  what to do. A module a run's config.json names is laurel.train_config's to import (the user's word first)."""
  try:
    importlib.import_module(module)
    return
  except ImportError as e:
    error = e
  not_found = error.name is not None and (module + '.').startswith(error.name + '.')  # not its own imports
  hint = f': put the folder holding {module.replace(".", "/")}.py on PYTHONPATH' if not_found else ''
  raise InputError(f'{field_name}={name!r}: cannot import {module} ({error}){hint}')
