"""Trains a config, or resumes it: laurel-train (or python -m laurel.main) --config=FILE.py:ROW --workdir=DIR

  laurel-train --config=c4_ablation:rw_lr,preset=tiny --workdir=runs/demo [--config.<field>=<value> ...]
  laurel-train --config=configs/c4_ablation.py:rw_lr --print_config   # the resolved config, then exit

--config: a config file with its argument, a shipped config by name (c4_ablation, imagenet_resnet50, llm,
residual_designs), or WORKDIR (or WORKDIR/config.json): the config a run saved. Rerun the same command to resume.
A run's design from outside the package is imported from the file its config.json names only with
--trust_design_file (or from your own PYTHONPATH); --print_config imports none.

Exit status (laurel.cli.process):
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

from laurel.cli import console, process  # pylint: disable=g-bad-import-order  # before JAX and TensorFlow load

INTERRUPTED = 'interrupted: exited; nothing was lost (rerun the same command to start or resume)'
if __name__ == '__main__':  # quiet and interruptible while JAX and TensorFlow load
  console.quiet_start()
  process.exit_on_interrupt(INTERRUPTED)

import json  # pylint: disable=g-import-not-at-top,wrong-import-position
import sys

from absl import logging
from ml_collections import config_flags

from laurel import command_line, config_lib, train, train_config
from laurel.cli import compile_cache
from laurel.run import cluster
from laurel.plan import aot, cost


def main(argv) -> int:
  """laurel-train's command line `argv` in this process; its exit status (the tests call it as the shell would)."""
  with train_config.design_policy():  # the policy its flags set ends with it, not a later command's in this process
    return process.exit_status(_main, argv)


def _main(argv):
  fv = command_line.define_flags(argv)
  if {'--help', '-h', '-?'} & set(argv[1:]):
    print(f'{__doc__}\n{fv.get_help()}')
    return
  command_line.set_design_policy(argv)
  args = command_line.parse_flags(argv, fv)
  if len(args) > 1:
    process.fail(f'unexpected arguments: {" ".join(args[1:])}')
  if fv.config is None:
    process.fail('--config is required, e.g. --config=configs/c4_ablation.py:rw_lr,preset=tiny')
  if fv.topology and not fv.compile_only:
    process.fail(f'--topology={fv.topology}: only with --compile_only (a run uses the devices it finds)')
  spec, overrides = command_line.config_spec(argv), config_flags.get_override_values(fv['config'])
  if fv.print_config and (name := train_config.unimported_design(fv.config)) is not None:
    print(f'notice: model.stream.design={name!r} is not imported (--print_config runs no code a run names): the '
          'config as the run saved it, its design unchecked', file=sys.stderr, flush=True)
    print(json.dumps(fv.config.to_dict(), indent=2, sort_keys=True))
    return
  try:
    config = train_config.build_config(fv.config)  # the one conversion: all that follows sees the typed config
    if (run := train_config.run_of(spec)) is not None:  # its data and vocabulary: shown before they are read
      train_config.show_named_paths(config, run, overrides)
    for warning in command_line.check_overrides(config, spec, overrides):
      print(warning, file=sys.stderr, flush=True)
    if fv.print_config:  # as config.json holds it: the chosen design's section alone
      train_config.validate_config(config)
      print(json.dumps(config_lib.to_dict(config), indent=2, sort_keys=True))
      return
    compile_cache.setup(fv.compilation_cache)  # before anything compiles
    if fv.compile_only:  # before anything starts a backend or touches a workdir
      aot.compile_only_process()
      print(aot.preflight(config, fv.topology, cost.checked_mfu(fv.mfu)), flush=True)
      return
  except config_lib.InputError as e:
    process.fail(str(e))
  if not fv.workdir:
    process.fail('--workdir is required')
  logging.set_verbosity(logging.WARNING)  # we print progress; orbax logs every save and restore at INFO
  # Joins the run's other processes where the flags or the environment name them (before any backend starts).
  cluster.join(fv.coordinator_address, fv.num_processes, fv.process_id, fv.join_timeout, fv.heartbeat_timeout)
  with process.errors_in_one_line(process.fail):  # what an operator can act on: one line and its exit status
    final = train.train(config, fv.workdir, allow_config_change=fv.allow_config_change, hold_lock=True)
  if final.get('preempted'):
    sys.exit(cluster.preempted_exit(fv.preempted_exit))


def run():
  """The console script laurel-train (and python -m laurel.main)."""
  console.run_command(main, INTERRUPTED)


if __name__ == '__main__':
  run()
