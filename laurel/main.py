"""Trains a config, or resumes it: laurel-train (or python -m laurel.main) --config=FILE.py:ROW --workdir=DIR

  laurel-train --config=c4_ablation:rw_lr,preset=tiny --workdir=runs/demo [--config.<field>=<value> ...]
  laurel-train --config=configs/c4_ablation.py:rw_lr --print_config   # the resolved config, then exit

--config: a config file with its argument, a shipped config by name (c4_ablation, imagenet_resnet50, llm,
residual_designs), or WORKDIR (or WORKDIR/config.json): the config a run saved. Rerun the same command to resume.
A run's design from outside the package is imported from the file its config.json names only with
--trust_design_file (or from your own PYTHONPATH); --print_config imports none.
Exit status: 2 and one line for bad input (resuming with another config included, unless --allow_config_change),
before anything is compiled or touched; after SIGTERM or Ctrl-C in the train loop, which saves a checkpoint,
--preempted_exit: by default 42 (PREEMPTED) under a scheduler (Slurm, Kubernetes, Open MPI, a TPU VM), which must
not read the stopped run as finished, else 0; 130 (143 for SIGTERM) and one line for either before the loop; 3 for a
loss that is not finite or a checkpoint save that failed; 4 for processes that did not all join, or a process of the
run lost (docs/clusters.md); 5 for a workdir another live run holds; 6 for a run whose workdir another run took over
(it stopped before writing again); 74 and one line for a write the storage refused (full, read-only, no permission);
75 for a hung loop (config.watchdog_*); 1 with a traceback for anything else.
"""

from laurel.run import console, process  # pylint: disable=g-bad-import-order  # before JAX and TensorFlow load

INTERRUPTED = 'interrupted: exited; nothing was lost (rerun the same command to start or resume)'
if __name__ == '__main__':  # quiet and interruptible while JAX and TensorFlow load
  console.quiet_start()
  process.exit_on_interrupt(INTERRUPTED)

import contextlib  # pylint: disable=g-import-not-at-top,wrong-import-position
import json  # pylint: disable=g-import-not-at-top,wrong-import-position
import logging as logging_std  # pylint: disable=g-import-not-at-top,wrong-import-position
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from laurel import config_lib, step, train
from laurel.run import cluster, compile_cache, saved_config
from laurel.plan import aot, cost

_CONFIG = config_flags.DEFINE_config_file('config', None, 'configs/<file>.py:<arg>', lock_config=True)
_WORKDIR = flags.DEFINE_string('workdir', None, 'Directory for checkpoints, metrics and final.json.')
_COORDINATOR = flags.DEFINE_string('coordinator_address', None, 'host:port of process 0 (multi-process).')
_NUM_PROCESSES = flags.DEFINE_integer('num_processes', None, 'Number of processes (multi-process).')
_PROCESS_ID = flags.DEFINE_integer('process_id', None, 'This process (multi-process).')
_JOIN_TIMEOUT = flags.DEFINE_float('join_timeout', cluster.JOIN_TIMEOUT_S, 'Seconds for every process of a '
                                   'multi-process run to join before each exits with status 4 (docs/clusters.md).')
_PREEMPTED_EXIT = flags.DEFINE_integer('preempted_exit', None, 'Exit status of a run that SIGTERM or Ctrl-C stopped, '
                                      'with a checkpoint, before it finished: by default 42 under a scheduler '
                                      '(Slurm, Kubernetes, Open MPI, a TPU VM), which xpk, JobSet and '
                                      'scripts/slurm_train.sbatch restart, else 0 (docs/clusters.md).')
_ALLOW_CONFIG_CHANGE = flags.DEFINE_bool(
    'allow_config_change', False, 'Resume checkpoints trained with another config in fields other than the resumable '
    'ones (steps, the log/eval/checkpoint cadence, the mesh, input workers), which always may change. The change is '
    'recorded in WORKDIR/config_history.jsonl.')
_ALLOW_FRESH_START = flags.DEFINE_bool(
    'allow_fresh_start', False, 'Train from step 0 in a workdir whose every checkpoint was unreadable (moved to '
    'WORKDIR/unreadable_checkpoints); without it such a run stops.')
_PRINT_CONFIG = flags.DEFINE_bool('print_config', False, 'Print the resolved config (row and overrides, checked) as '
                                  "JSON and exit; a run's design from outside the package is not imported (its "
                                  'section is shown as saved).')
_TRUST_DESIGN_FILE = flags.DEFINE_bool('trust_design_file', False, saved_config.TRUST_HELP)
_COMPILE_ONLY = flags.DEFINE_bool('compile_only', False, "Compile the step for --topology's TPU slice on this "
                                  'machine, check that it fits the HBM, run nothing (needs libtpu).')
_TOPOLOGY = flags.DEFINE_string('topology', None, 'With --compile_only: the TPU slice, e.g. v6e:4x4 or v6e-16 '
                                '(v5p:2x2x4 or v5p-32).')
flags.adopt_module_key_flags(compile_cache)  # --help lists --compilation_cache
flags.adopt_module_key_flags(cost)  # and --mfu


def main(argv):
  if len(argv) > 1:
    config_lib.fail(f'unexpected arguments: {" ".join(argv[1:])}')
  if _CONFIG.value is None:
    config_lib.fail('--config is required, e.g. --config=configs/c4_ablation.py:rw_lr,preset=tiny')
  if _TOPOLOGY.value and not _COMPILE_ONLY.value:
    config_lib.fail(f'--topology={_TOPOLOGY.value}: only with --compile_only (a run uses the devices it finds)')
  config_file = config_flags.get_config_filename(flags.FLAGS['config'])
  overrides = config_flags.get_override_values(flags.FLAGS['config'])
  if _PRINT_CONFIG.value and (name := saved_config.unimported_design(_CONFIG.value)) is not None:
    print(f'notice: model.stream.design={name!r} is not imported (--print_config runs no code a run names): the '
          'config as the run saved it, its design unchecked', file=sys.stderr, flush=True)
    print(json.dumps(_CONFIG.value.to_dict(), indent=2, sort_keys=True))
    return
  try:
    config = step.build_config(_CONFIG.value)  # the one conversion: all that follows sees the typed config
    if (run := saved_config.run_of(config_file)) is not None:  # its data and vocabulary: shown before they are read
      saved_config.show_named_paths(config, run, overrides)
    for warning in step.check_overrides(config, config_file, overrides):
      print(warning, file=sys.stderr, flush=True)
    if _PRINT_CONFIG.value:  # as config.json holds it: the chosen design's section alone
      step.validate_config(config)
      print(json.dumps(config_lib.to_dict(config), indent=2, sort_keys=True))
      return
    compile_cache.setup()  # before anything compiles (--compilation_cache)
    if _COMPILE_ONLY.value:  # before anything starts a backend or touches a workdir
      aot.compile_only_process()
      print(aot.preflight(config, _TOPOLOGY.value), flush=True)
      return
  except config_lib.InputError as e:
    config_lib.fail(str(e))
  if not _WORKDIR.value:
    config_lib.fail('--workdir is required')
  logging.set_verbosity(logging.INFO)
  logging.get_absl_handler().addFilter(lambda record: record.levelno >= logging_std.WARNING)  # we print progress
  # Joins the run's other processes where the flags or the environment name them (before any backend starts).
  cluster.join(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value, _JOIN_TIMEOUT.value)
  try:  # an error an operator can act on is one line with its exit status; anything else keeps its traceback
    with process.errors_in_one_line(config_lib.fail):
      final = train.train(config, _WORKDIR.value, allow_config_change=_ALLOW_CONFIG_CHANGE.value,
                          allow_fresh_start=_ALLOW_FRESH_START.value, hold_lease=True)
  except Exception:  # a collective that failed as a peer died: one line naming it (laurel.run.cluster), not this
    cluster.await_lost_peer()
    raise
  cluster.finish_peer_watch()
  if final.get('preempted'):
    sys.exit(cluster.preempted_exit(_PREEMPTED_EXIT.value))


def run():
  console.quiet_start()
  process.exit_on_interrupt(INTERRUPTED)
  if sys.modules['__main__'] is not sys.modules[__name__]:  # the laurel-train console script: --help shows ours
    sys.modules['__main__'].__doc__ = __doc__
    for flag in flags.FLAGS.get_key_flags_for_module(__name__):
      flags.FLAGS.register_key_flag_for_module(sys.argv[0], flag)
  app.run(main, flags_parser=parse_flags)


def parse_flags(argv):
  """config_lib.parse_flags, once --trust_design_file and --print_config have said what a run's saved config may
  import: `--config=WORKDIR` reads it while the flags are parsed."""
  early, names = flags.FlagValues(), (_TRUST_DESIGN_FILE.name, _PRINT_CONFIG.name)
  for name in names:
    flags.DEFINE_bool(name, False, '', flag_values=early)
  with contextlib.suppress(flags.Error):  # the full parse names a bad value
    early([argv[0], *(a for a in argv[1:] if a.lstrip('-').split('=')[0].removeprefix('no') in names)])
  saved_config.set_design_policy(trust=early.trust_design_file, imports=not early.print_config)
  return config_lib.parse_flags(argv)


if __name__ == '__main__':
  run()
