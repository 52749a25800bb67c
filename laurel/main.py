"""Trains a config, or resumes it: laurel-train (or python -m laurel.main) --config=FILE.py:ROW --workdir=DIR

  laurel-train --config=c4_ablation:rw_lr,preset=tiny --workdir=runs/demo [--config.<field>=<value> ...]
  laurel-train --config=configs/c4_ablation.py:rw_lr --print_config   # the resolved config, then exit

--config: a config file with its argument, a shipped config by name (c4_ablation, imagenet_resnet50, llm,
residual_designs), or WORKDIR (or WORKDIR/config.json): the config a run saved. Rerun the same command to resume.
A run's design from outside the package is imported from the file its config.json names only with
--trust_design_file (or from your own PYTHONPATH); --print_config imports none.

Exit status (laurel.run.process):
  0    finished; outside a scheduler also stopped by SIGTERM or Ctrl-C in the train loop with a checkpoint
  1    an error: a bug or the environment, with its traceback or one line (a failed save, join or write); a hang
       the watchdog ended (config.watchdog_*: every thread's stack). A process whose peer died JAX aborts itself
  2    bad input, one line before anything is compiled or touched: a field, flag or path; a resume with another
       config (unless --allow_config_change); a workdir another live run holds
  3    a loss, or a state about to be saved, that is not finite
  42   under a scheduler (Slurm, Kubernetes, Open MPI, a TPU VM), or as --preempted_exit says: stopped by SIGTERM or
       Ctrl-C in the train loop with a checkpoint; rerun the same command to resume
  130  Ctrl-C or SIGTERM before the train loop (one line), or a second Ctrl-C
"""

from laurel.run import console, process  # pylint: disable=g-bad-import-order  # before JAX and TensorFlow load

INTERRUPTED = 'interrupted: exited; nothing was lost (rerun the same command to start or resume)'
if __name__ == '__main__':  # quiet and interruptible while JAX and TensorFlow load
  console.quiet_start()
  process.exit_on_interrupt(INTERRUPTED)

import contextlib  # pylint: disable=g-import-not-at-top,wrong-import-position
import json  # pylint: disable=g-import-not-at-top,wrong-import-position
import sys

from absl import flags, logging
from ml_collections import config_flags

from laurel import config_lib, step, train
from laurel.run import cluster, compile_cache, saved_config
from laurel.plan import aot, cost


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
  define('bool', 'trust_design_file', False, saved_config.TRUST_HELP)
  define('bool', 'compile_only', False, "Compile the step for --topology's TPU slice on this machine, check that it "
         'fits the HBM, run nothing (needs libtpu).')
  define('string', 'topology', None, 'With --compile_only: the TPU slice, e.g. v6e:4x4 or v6e-16 (v5p:2x2x4 or '
         'v5p-32).')
  define('string', 'compilation_cache', None, compile_cache.HELP)
  define('float', 'mfu', None, cost.MFU_HELP)
  return fv


def main(argv) -> int:
  """laurel-train's command line `argv` in this process; its exit status (the tests call it as the shell would)."""
  try:
    _main(argv)
  except SystemExit as e:  # config_lib.fail: one line, then its status
    return e.code if isinstance(e.code, int) else int(e.code is not None)
  return 0


def _main(argv):
  fv = define_flags(argv)
  if {'--help', '-h', '-?'} & set(argv[1:]):
    print(f'{__doc__}\n{fv.get_help()}')
    return
  set_design_policy(argv)
  args = config_lib.parse_flags(argv, fv)
  if len(args) > 1:
    config_lib.fail(f'unexpected arguments: {" ".join(args[1:])}')
  if fv.config is None:
    config_lib.fail('--config is required, e.g. --config=configs/c4_ablation.py:rw_lr,preset=tiny')
  if fv.topology and not fv.compile_only:
    config_lib.fail(f'--topology={fv.topology}: only with --compile_only (a run uses the devices it finds)')
  config_file, overrides = config_flags.get_config_filename(fv['config']), config_flags.get_override_values(fv['config'])
  if fv.print_config and (name := saved_config.unimported_design(fv.config)) is not None:
    print(f'notice: model.stream.design={name!r} is not imported (--print_config runs no code a run names): the '
          'config as the run saved it, its design unchecked', file=sys.stderr, flush=True)
    print(json.dumps(fv.config.to_dict(), indent=2, sort_keys=True))
    return
  try:
    config = step.build_config(fv.config)  # the one conversion: all that follows sees the typed config
    if (run := saved_config.run_of(config_file)) is not None:  # its data and vocabulary: shown before they are read
      saved_config.show_named_paths(config, run, overrides)
    for warning in step.check_overrides(config, config_file, overrides):
      print(warning, file=sys.stderr, flush=True)
    if fv.print_config:  # as config.json holds it: the chosen design's section alone
      step.validate_config(config)
      print(json.dumps(config_lib.to_dict(config), indent=2, sort_keys=True))
      return
    compile_cache.setup(fv.compilation_cache)  # before anything compiles
    if fv.compile_only:  # before anything starts a backend or touches a workdir
      aot.compile_only_process()
      print(aot.preflight(config, fv.topology, cost.checked_mfu(fv.mfu)), flush=True)
      return
  except config_lib.InputError as e:
    config_lib.fail(str(e))
  if not fv.workdir:
    config_lib.fail('--workdir is required')
  logging.set_verbosity(logging.WARNING)  # we print progress; orbax logs every save and restore at INFO
  # Joins the run's other processes where the flags or the environment name them (before any backend starts).
  cluster.join(fv.coordinator_address, fv.num_processes, fv.process_id, fv.join_timeout, fv.heartbeat_timeout)
  with process.errors_in_one_line(config_lib.fail):  # what an operator can act on: one line and its exit status
    final = train.train(config, fv.workdir, allow_config_change=fv.allow_config_change, hold_lock=True)
  if final.get('preempted'):
    sys.exit(cluster.preempted_exit(fv.preempted_exit))


def set_design_policy(argv) -> None:
  """What a run's saved config may import, from --trust_design_file and --print_config, before the flags are parsed:
  `--config=WORKDIR` reads it while they are."""
  early, names = flags.FlagValues(), ('trust_design_file', 'print_config')
  for name in names:
    flags.DEFINE_bool(name, False, '', flag_values=early)
  with contextlib.suppress(flags.Error):  # the full parse names a bad value
    early([argv[0], *(a for a in argv[1:] if a.lstrip('-').split('=')[0].removeprefix('no') in names)])
  saved_config.set_design_policy(trust=early.trust_design_file, imports=not early.print_config)


def run():
  """The console script laurel-train (and python -m laurel.main)."""
  console.quiet_start()
  process.exit_on_interrupt(INTERRUPTED)
  logging.use_absl_handler()
  flags.FLAGS.mark_as_parsed()  # absl's log and grain's worker processes read the global flags: their defaults
  sys.exit(main(sys.argv))


if __name__ == '__main__':
  run()
