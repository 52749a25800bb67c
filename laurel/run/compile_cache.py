"""JAX's persistent compilation cache, set up by every command. Where: --compilation_cache=DIR (`none`: off), else
JAX_COMPILATION_CACHE_DIR (JAX_ENABLE_COMPILATION_CACHE=false: off), else $XDG_CACHE_HOME/laurel/jax. The environment
is left as it is: lm-eval's command line (no absl flags) reads the same variables. An entry that cannot be read back
(cut short by a kill or a full disk) is deleted, so that the program is compiled and written again."""

import contextlib
import hashlib
import json
import os
import pathlib
import sys

import jax
from absl import flags
from jax._src import compilation_cache as jax_cache  # pylint: disable=g-importing-member  # its reader, wrapped below

from laurel.run import files

_FLAG = flags.DEFINE_string(
    'compilation_cache', None, 'Directory of the persistent compilation cache, reused by every command (none: off). '
    'Default: $JAX_COMPILATION_CACHE_DIR if set, else $XDG_CACHE_HOME/laurel/jax (~/.cache/laurel/jax).')
# Programs that compile faster than this are not written (JAX's default is 1 s; a tiny CPU step compiles in less).
MIN_COMPILE_S = 0.2
_OFF = ('none', 'off', 'false')
_state = {'directory': None}  # setup's choice; JAX's own setting is off in a compile-only process


def setup(directory: str | None = None) -> str | None:
  """Points the cache at `directory` (else the flag, JAX's variables, the default); returns it, None where off.
  Call it before anything compiles."""
  if directory is None and flags.FLAGS.is_parsed():
    directory = _FLAG.value
  if directory is None and os.environ.get('JAX_ENABLE_COMPILATION_CACHE', '').lower() not in _OFF:
    cache_home = os.environ.get('XDG_CACHE_HOME') or os.path.join(os.path.expanduser('~'), '.cache')
    directory = os.environ.get('JAX_COMPILATION_CACHE_DIR') or os.path.join(cache_home, 'laurel', 'jax')
  if directory is not None and directory.lower() not in ('', *_OFF):
    directory = os.path.abspath(os.path.expanduser(directory))
    jax.config.update('jax_compilation_cache_dir', directory)
    if 'JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS' not in os.environ:
      jax.config.update('jax_persistent_cache_min_compile_time_secs', MIN_COMPILE_S)
  else:
    directory = None
  jax.config.update('jax_enable_compilation_cache', directory is not None)
  _state['directory'] = directory
  if directory is not None and not hasattr(jax_cache.get_executable_and_time, 'laurel_reader'):
    jax_cache.get_executable_and_time = _dropping_unreadable(jax_cache.get_executable_and_time)
  return directory


def _dropping_unreadable(read):
  """JAX's cache reader, which deletes an entry it cannot read. JAX itself only warns, on every later run, and never
  replaces the entry (its writer skips a key whose file exists)."""
  def read_or_drop(cache_key, *args, **kwargs):
    try:
      return read(cache_key, *args, **kwargs)
    except Exception as e:  # pylint: disable=broad-except  # whatever the damage: the entry is of no use
      folder = jax.config.jax_compilation_cache_dir
      if not folder or '://' in folder:
        raise
      for suffix in ('-cache', '-atime'):  # JAX's LRU cache: the entry and its access time
        with contextlib.suppress(FileNotFoundError):
          os.unlink(os.path.join(folder, cache_key + suffix))
      print(f'compilation cache: deleted the unreadable entry of {cache_key.rpartition("-")[0]} '
            f'({type(e).__name__}: {str(e)[:80]}); compiling it again', file=sys.stderr, flush=True)
      return None, None
  read_or_drop.laurel_reader = True
  return read_or_drop


def directory() -> str | None:
  return _state['directory']


def record(key_parts: list[str], figures) -> dict:
  """`figures()`, kept as JSON under the cache keyed by `key_parts` and read back next time. A compile-only TPU
  client (laurel.run.aot) cannot load an executable back from the cache, so it keeps the compiler's figures here."""
  if directory() is None:
    return figures()
  path = pathlib.Path(directory(), 'preflight', hashlib.sha256('\0'.join(key_parts).encode()).hexdigest() + '.json')
  with contextlib.suppress(OSError, ValueError):  # none yet, or unreadable: compile
    return json.loads(path.read_text())
  result = figures()
  with contextlib.suppress(OSError):  # a read-only cache costs the next run a compile, not this one its result
    path.parent.mkdir(parents=True, exist_ok=True)
    files.write_text_atomic(path, json.dumps(result) + '\n')
  return result
