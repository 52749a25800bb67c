"""JAX's persistent compilation cache, set up by every command. Where: --compilation_cache=DIR (`none`: off), else
JAX_COMPILATION_CACHE_DIR (JAX_ENABLE_COMPILATION_CACHE=false: off), else $XDG_CACHE_HOME/laurel/jax. The environment
is left as it is: lm-eval's command line (no absl flags) reads the same variables."""

import os

import jax
from absl import flags

HELP = ('Directory of the persistent compilation cache, reused by every command (none: off). Default: '
        '$JAX_COMPILATION_CACHE_DIR if set, else $XDG_CACHE_HOME/laurel/jax (~/.cache/laurel/jax).')
_FLAG = flags.DEFINE_string('compilation_cache', None, HELP)
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
  return directory


def directory() -> str | None:
  return _state['directory']
