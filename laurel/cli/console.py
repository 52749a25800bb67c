"""What the command-line programs print (laurel.cli.process: how Ctrl-C stops them). Standard library only:
laurel.main imports it before JAX and TensorFlow load."""

import contextlib
import glob
import importlib.util
import os
import shlex
import shutil
import sys
import threading
import time

from laurel.cli import gpu_workarounds, process

# Device files of a TPU (/dev/accel* up to v4, /dev/vfio/<n> from v5e) or a GPU (NVIDIA, AMD).
ACCELERATOR_FILES = ('/dev/accel*', '/dev/vfio/[0-9]*', '/dev/nvidia[0-9]*', '/dev/kfd')
HEARTBEAT_S = 30.0


def has_accelerator() -> bool:
  return any(glob.glob(pattern) for pattern in ACCELERATOR_FILES)


def quiet_start() -> None:
  """Before JAX starts a backend: the CPU where libtpu is installed but no accelerator is present (not libtpu's
  errors; unless JAX_PLATFORMS says otherwise); TensorFlow's warnings only, with no oneDNN notice; on a GPU, the
  flags a known-slow jaxlib needs (laurel.cli.gpu_workarounds), in one line."""
  gpu_workarounds.apply()
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '1')
  os.environ.setdefault('TF_ENABLE_ONEDNN_OPTS', '0')
  if os.environ.get('JAX_PLATFORMS') or importlib.util.find_spec('libtpu') is None or has_accelerator():
    return
  os.environ['JAX_PLATFORMS'] = 'cpu'
  jax = sys.modules.get('jax')
  if jax is not None and hasattr(jax, 'config') and not jax.config.jax_platforms:  # it read the environment already
    jax.config.update('jax_platforms', 'cpu')


def quiet_unless_first(process_index: int) -> None:
  """A process other than a run's process 0 prints only its errors and warnings (stderr): process 0 prints the run's
  progress, and what libraries write to stdout (Gloo's `[Gloo] Rank 1 is connected to ...`) goes to /dev/null."""
  if process_index == 0:
    return
  sys.stdout.flush()
  devnull = os.open(os.devnull, os.O_WRONLY)
  os.dup2(devnull, sys.stdout.fileno())  # the descriptor, as C++ code writes to it too
  os.close(devnull)


def duration(seconds: float) -> str:
  """12.3 s, 4m05s, 2h03m."""
  if seconds < 60:
    return f'{seconds:.1f} s'
  minutes = int(seconds // 60)
  return f'{minutes}m{int(seconds % 60):02d}s' if minutes < 60 else f'{minutes // 60}h{minutes % 60:02d}m'


class Phase:
  """What a phase's body tells `phase`: `cut(why)` where it stopped before its work was done."""

  def __init__(self):
    self.cut_by = None

  def cut(self, why: str) -> None:
    self.cut_by = why


@contextlib.contextmanager
def phase(what: str, every_s: float = HEARTBEAT_S, file=None):
  """Prints `what...`, `  still <what> (<time>)` every `every_s` s, then `<what>: done in <time>` unless it raises,
  or `<what>: interrupted (<why>) after <time>` where the body called `cut(why)` on the Phase it was given."""
  say = lambda line: print(line, file=file or sys.stdout, flush=True)
  say(f'{what}...')
  start, done, progress = time.perf_counter(), threading.Event(), Phase()

  def heartbeat():
    while not done.wait(every_s):
      say(f'  still {what} ({duration(time.perf_counter() - start)})')

  thread = process.start_thread('laurel-heartbeat', heartbeat)
  try:
    yield progress
  finally:
    done.set()
    thread.join()
  took = duration(time.perf_counter() - start)
  say(f'{what}: interrupted ({progress.cut_by}) after {took}' if progress.cut_by else f'{what}: done in {took}')


# Bookkeeping of a logged row, shown in their own places on the console line (or only in metrics.jsonl); a design's
# per-site diagnostics (`<section>/<name>_<i>`) go to metrics.jsonl and TensorBoard only.
_NOT_METRICS = ('mean_of_steps', 'learning_rate', 'step_time_s', 'peak_memory_bytes', 'params', 'device_peak_bytes',
                'mfu')


def _metrics(row: dict) -> str:
  names = ['loss'] * ('loss' in row) + [k for k in row if k != 'loss' and k not in _NOT_METRICS
                                        and not k.endswith('_per_s') and '/' not in k]
  return ' | '.join(f'{k} {row[k]:.4f}' for k in names)


def step_line(step: int, steps: int, row: dict, unit: str) -> str:
  """`step 25/500 (5%) | mean of 25 steps: loss 3.1416 | lr 1.50e-03 | 0.44 s/step, 4,301 tokens/s | ETA 3m32s`."""
  mean_of = row.get('mean_of_steps', 1)
  parts = [f'step {step}/{steps} ({100 * step // steps}%)',
           f'mean of {mean_of} steps: ' * (mean_of > 1) + _metrics(row)]
  if 'learning_rate' in row:
    parts.append(f'lr {row["learning_rate"]:.2e}')
  parts.append(f'{row["step_time_s"]:.3g} s/step, {row[f"{unit}_per_s"]:,.0f} {unit}/s'
               + (f', mfu {100 * row["mfu"]:.1f}%' if 'mfu' in row else ''))
  return ' | '.join(parts + [f'ETA {duration(row["step_time_s"] * (steps - step))}'])


def eval_line(step: int, steps: int, row: dict) -> str:
  """`eval at step 250/500 | loss 2.9871 | accuracy 0.3521` from the eval_* metrics."""
  return f'eval at step {step}/{steps} | ' + _metrics({k.removeprefix('eval_'): v for k, v in row.items()})


def python_command() -> str:
  """This interpreter in a printed command: `python` where the PATH finds this very one, else its shown() path."""
  found = shutil.which('python')
  with contextlib.suppress(OSError):
    if found and os.path.samefile(found, sys.executable) and os.path.samefile(os.path.dirname(found),
                                                                              os.path.dirname(sys.executable)):
      return 'python'
  return quoted(sys.executable)


def script_command(name: str, module: str) -> str:
  """A console script installed beside this interpreter (the venv's `tensorboard`) in a printed command: its name
  where the PATH finds that very one, else its shown() path; `python -m module` where there is none."""
  script = os.path.join(os.path.dirname(sys.executable), name)
  if not os.path.isfile(script):
    return f'{python_command()} -m {module}'
  found = shutil.which(name)
  with contextlib.suppress(OSError):
    if found and os.path.samefile(found, script):
      return name
  return quoted(script)


def quoted(path) -> str:
  """shown(path) quoted for a shell, as a printed command needs it (a folder with spaces)."""
  return shlex.quote(shown(path))


def shown(path) -> str:
  """A path as one would type it here: relative to the working directory when it lies inside it."""
  path = os.fspath(path)
  if '://' in path or not os.path.isabs(path):
    return path
  relative = os.path.relpath(path)
  return path if relative.startswith(os.pardir) else relative


def run_command(main, interrupted: str) -> None:
  """The process of a console script (or `python -m`) whose `main(argv)` returns its exit status: quiet and
  interruptible (`interrupted` is its line) while JAX loads, absl's log handler, main's status as the exit status."""
  from absl import flags, logging  # pylint: disable=import-outside-toplevel  # this module loads before absl
  quiet_start()
  process.exit_on_interrupt(interrupted)
  logging.use_absl_handler()
  flags.FLAGS.mark_as_parsed()  # absl's log and grain's worker processes read the global flags: their defaults
  sys.exit(main(sys.argv))
