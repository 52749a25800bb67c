"""Compiled programs reused across processes: JAX's persistent compilation cache, set up by every command.

Where (the first that is set): the flag --compilation_cache=DIR (`none`: off); JAX's own JAX_COMPILATION_CACHE_DIR
(and JAX_ENABLE_COMPILATION_CACHE=false: off); else $XDG_CACHE_HOME/laurel/jax (~/.cache/laurel/jax). Nothing here
changes the environment: lm-eval's command line (no absl flags) reads the same variables. A compile-only TPU client
(laurel.aot) cannot load an executable back, so `record` keeps the compiler's figures under DIR/preflight instead.
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
_state = {'directory': None}  # setup's choice; JAX's own setting is off in a compile-only process


def setup(directory: str | None = None) -> str | None:
  """Points JAX's persistent compilation cache at `directory` (else the flag, JAX's variables, the default) and
  returns it, or None where it is off. Call it before anything compiles."""
  if directory is None and flags.FLAGS.is_parsed():
    directory = _FLAG.value
  if directory is None and os.environ.get('JAX_ENABLE_COMPILATION_CACHE', '').lower() not in ('none', 'off', 'false'):
    cache_home = os.environ.get('XDG_CACHE_HOME') or os.path.join(os.path.expanduser('~'), '.cache')
    directory = os.environ.get('JAX_COMPILATION_CACHE_DIR') or os.path.join(cache_home, 'laurel', 'jax')
  if directory is None or directory.lower() in ('', 'none', 'off', 'false'):
    directory = None
  else:
    directory = os.path.abspath(os.path.expanduser(directory))
    jax.config.update('jax_compilation_cache_dir', directory)
    if 'JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS' not in os.environ:
      jax.config.update('jax_persistent_cache_min_compile_time_secs', MIN_COMPILE_S)
  jax.config.update('jax_enable_compilation_cache', directory is not None)
  _state['directory'] = directory
  return directory


def directory() -> str | None:
  return _state['directory']


def record(key_parts: list[str], figures) -> dict:
  """The dict `figures()` returns, saved under the cache as JSON keyed by `key_parts` (a program's text and what else
  decides what the compiler makes of it), and read back instead of calling `figures` the next time."""
  if directory() is None:
    return figures()
  path = pathlib.Path(directory(), 'preflight', hashlib.sha256('\0'.join(key_parts).encode()).hexdigest() + '.json')
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
