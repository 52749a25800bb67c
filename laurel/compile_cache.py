"""Compiled programs reused across processes: JAX's persistent compilation cache, set up by every command.

  setup()      before the first compile: the cache directory in use (None: off)
  directory()  the same, afterwards
  record(key_parts, figures)  for laurel.aot: what the TPU compiler said of a program, read back, or figures() saved

Where (the first that is set): the flag --compilation_cache=DIR (`none`: off); JAX's own JAX_COMPILATION_CACHE_DIR
(and JAX_ENABLE_COMPILATION_CACHE=false: off); else $XDG_CACHE_HOME/laurel/jax (~/.cache/laurel/jax). lm-eval's
command line (laurel-lm-eval) has no absl flags: it reads the environment variables. Nothing here changes them.

A compile-only TPU client (the pre-flight on a machine without a TPU) cannot load an executable back, so laurel.aot
keeps the compiler's figures of each program it compiled instead, under DIR/preflight, keyed by the program's text.
"""

import hashlib
import json
import os
import pathlib

import jax
from absl import flags

from laurel import files

_FLAG = flags.DEFINE_string(
    'compilation_cache', None, 'Directory of the persistent compilation cache, reused by every command (none: off). '
    'Default: $JAX_COMPILATION_CACHE_DIR if set, else $XDG_CACHE_HOME/laurel/jax (~/.cache/laurel/jax).')
# Programs that compile faster than this are not written (JAX's default is 1 s; a tiny CPU step compiles in less).
MIN_COMPILE_S = 0.2
OFF = ('', 'none', 'off', 'false')
_state = {'directory': None}


def default_directory() -> str:
  cache_home = os.environ.get('XDG_CACHE_HOME') or os.path.join(os.path.expanduser('~'), '.cache')
  return os.path.join(cache_home, 'laurel', 'jax')


def setup(directory: str | None = None) -> str | None:
  """Points JAX's persistent compilation cache at `directory` (else the flag, JAX's variable, the default; see the
  module's docstring) and returns it, or None where it is off. Call it before anything compiles."""
  if directory is None and flags.FLAGS.is_parsed():
    directory = _FLAG.value
  env_off = os.environ.get('JAX_ENABLE_COMPILATION_CACHE', '').lower() in OFF[1:]
  if directory is None:
    directory = None if env_off else os.environ.get('JAX_COMPILATION_CACHE_DIR') or default_directory()
  if directory is None or directory.lower() in OFF:
    jax.config.update('jax_enable_compilation_cache', False)
    _state['directory'] = None
    return None
  directory = os.path.abspath(os.path.expanduser(directory))
  jax.config.update('jax_enable_compilation_cache', True)
  jax.config.update('jax_compilation_cache_dir', directory)
  if 'JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS' not in os.environ:
    jax.config.update('jax_persistent_cache_min_compile_time_secs', MIN_COMPILE_S)
  _state['directory'] = directory
  return directory


def directory() -> str | None:
  return _state['directory']


def record(key_parts: list[str], figures) -> dict:
  """The dict `figures()` returns, saved under the cache as JSON, keyed by `key_parts` (a program's text and what
  else decides what the compiler makes of it); read back instead of calling `figures` when saved before. Without
  a cache directory, `figures()`."""
  if directory() is None:
    return figures()
  digest = hashlib.sha256('\0'.join(key_parts).encode()).hexdigest()
  path = pathlib.Path(directory(), 'preflight', f'{digest}.json')
  try:
    return json.loads(path.read_text())
  except (OSError, ValueError):  # none yet, or unreadable: compile
    pass
  result = figures()
  try:
    path.parent.mkdir(parents=True, exist_ok=True)
    files.write_text_atomic(path, json.dumps(result) + '\n')
  except OSError:  # a read-only cache costs the next run a compile, not this one its result
    pass
  return result
