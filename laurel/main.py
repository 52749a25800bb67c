"""Trains a config, or resumes it: laurel-train (or python -m laurel.main) --config=FILE.py:ROW --workdir=DIR

  laurel-train --config=c4_ablation:rw_lr,preset=tiny --workdir=runs/demo [--config.<field>=<value> ...]
  laurel-train --config=configs/c4_ablation.py:rw_lr --print_config   # the resolved config, then exit

--config is a config file (relative to the working directory) with its argument, or a shipped config by name
(c4_ablation, imagenet_resnet50, llm, residual_designs). Bad input exits with status 2 and one line on stderr,
before anything is traced or any checkpoint touched; so does resuming a workdir with another config, unless
--allow_config_change. In the train loop SIGTERM and Ctrl-C save a checkpoint and exit 0; elsewhere (start-up,
compiling) Ctrl-C exits at once with status 130. Rerun the same command to resume.
"""

from laurel import console  # pylint: disable=g-bad-import-order  # before JAX and TensorFlow load

INTERRUPTED = 'interrupted: exited; nothing was lost (rerun the same command to start or resume)'
if __name__ == '__main__':
  console.exit_on_interrupt(INTERRUPTED)

import glob  # pylint: disable=g-import-not-at-top,wrong-import-position
import logging as logging_std
import sys

import jax
from absl import app, flags, logging
from ml_collections import config_flags

from laurel import aot, config_lib, train

_CONFIG = config_flags.DEFINE_config_file('config', None, 'configs/<file>.py:<arg>', lock_config=True)
_WORKDIR = flags.DEFINE_string('workdir', None, 'Directory for checkpoints, metrics and final.json.')
_COORDINATOR = flags.DEFINE_string('coordinator_address', None, 'host:port of process 0 (multi-process).')
_NUM_PROCESSES = flags.DEFINE_integer('num_processes', None, 'Number of processes (multi-process).')
_PROCESS_ID = flags.DEFINE_integer('process_id', None, 'This process (multi-process).')
_ALLOW_CONFIG_CHANGE = flags.DEFINE_bool(
    'allow_config_change', False, 'Resume checkpoints trained with another config: fields other than steps, the '
    'log/eval/checkpoint cadence, the mesh and input workers (laurel.train.RESUMABLE), which always may change. '
    'The change is recorded in WORKDIR/config_history.jsonl.')
_PRINT_CONFIG = flags.DEFINE_bool('print_config', False, 'Print the resolved config (row and overrides, checked) as '
                                  'JSON and exit.')
_COMPILE_ONLY = flags.DEFINE_bool('compile_only', False, "Compile the step for --topology's TPU slice on this "
                                  'machine, check that it fits the HBM, run nothing (needs libtpu).')
_TOPOLOGY = flags.DEFINE_string('topology', None, 'With --compile_only: the TPU slice, e.g. v6e:4x4 or v6e-16 '
                                '(v5p:2x2x4 or v5p-32).')


def main(argv):
  if len(argv) > 1:
    config_lib.fail(f'unexpected arguments: {" ".join(argv[1:])}')
  if _CONFIG.value is None:
    config_lib.fail('--config is required, e.g. --config=configs/c4_ablation.py:rw_lr,preset=tiny')
  if _TOPOLOGY.value and not _COMPILE_ONLY.value:
    config_lib.fail(f'--topology={_TOPOLOGY.value}: only with --compile_only (a run uses the devices it finds)')
  if _PRINT_CONFIG.value:
    try:
      train.validate_config(_CONFIG.value)
    except ValueError as e:
      config_lib.fail(str(e))
    print(_CONFIG.value.to_json_best_effort(indent=2, sort_keys=True))
    return
  if _COMPILE_ONLY.value:  # before anything starts a backend or touches a workdir
    try:
      print(aot.preflight(_CONFIG.value, _TOPOLOGY.value), flush=True)
    except ValueError as e:
      config_lib.fail(str(e))
    return
  if not _WORKDIR.value:
    config_lib.fail('--workdir is required')
  logging.set_verbosity(logging.INFO)
  logging.get_absl_handler().addFilter(_console_filter)
  if _COORDINATOR.value or _NUM_PROCESSES.value:
    jax.distributed.initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
  elif _on_tpu_vm():  # jax finds its peers (before any backend starts)
    try:
      jax.distributed.initialize()
    except (RuntimeError, ValueError) as e:  # a single host outside a pod
      logging.warning('jax.distributed.initialize() failed (%s); running as one process', e)
  try:  # train.train checks the config, the data and the workdir before it compiles anything
    train.train(_CONFIG.value, _WORKDIR.value, allow_config_change=_ALLOW_CONFIG_CHANGE.value)
  except ValueError as e:  # a bad config, or e.g. a workdir holding another model's checkpoints
    config_lib.fail(str(e))
  except train.TrainingDiverged as e:
    config_lib.fail(str(e), code=3)
  except KeyboardInterrupt:  # Ctrl-C before the first step (in the loop it saves a checkpoint)
    config_lib.fail('interrupted before training started; nothing was saved', code=130)


def _on_tpu_vm() -> bool:
  """A Cloud TPU VM's chips are device files (/dev/accel* up to v4, /dev/vfio/<n> from v5e); libtpu alone is not
  enough, since the TPU compiler is installed on CPU machines too."""
  return bool(glob.glob('/dev/accel*') or glob.glob('/dev/vfio/[0-9]*'))


def _console_filter(record: logging_std.LogRecord) -> bool:
  """Warnings and errors only: the train loop prints its own progress, one line per logged step."""
  return record.levelno >= logging_std.WARNING


def run():
  console.exit_on_interrupt(INTERRUPTED)
  if sys.modules['__main__'] is not sys.modules[__name__]:  # the laurel-train console script: --help shows ours
    sys.modules['__main__'].__doc__ = __doc__
    for flag in flags.FLAGS.get_key_flags_for_module(__name__):
      flags.FLAGS.register_key_flag_for_module(sys.argv[0], flag)
  app.run(main, flags_parser=config_lib.parse_flags)


if __name__ == '__main__':
  run()
