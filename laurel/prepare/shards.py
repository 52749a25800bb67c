"""What laurel.prepare.c4 and laurel.prepare.text share: a shard that appears under its name only once complete, files
converted in parallel processes, and their command line (flags of their own, bad input one line with status 2)."""

import contextlib
import multiprocessing
import os
import sys
import tempfile
from collections.abc import Callable, Sequence

from absl import flags, logging
from etils import epath

from laurel.config_lib import InputError
from laurel.cli import console


@contextlib.contextmanager
def array_record_shard(dest):
  """An ArrayRecord writer (one record per `write`) for the shard `dest`, local or gs://, which appears under its
  name only once complete: a local one is written beside it and renamed, a gs:// one written here and uploaded
  whole (ArrayRecord's writer writes local files). An interrupted conversion thus never leaves a partial shard."""
  from array_record.python import array_record_module  # pylint: disable=import-outside-toplevel
  dest = epath.Path(dest)
  local = '://' not in os.fspath(dest)
  with tempfile.TemporaryDirectory() as tmp:
    partial = dest.with_name(dest.name + '.incomplete') if local else epath.Path(tmp) / dest.name
    writer = array_record_module.ArrayRecordWriter(os.fspath(partial), 'group_size:1')
    try:
      yield writer
    finally:
      writer.close()
    if local:
      partial.rename(dest)
    else:
      partial.copy(dest)


def parallel_map(fn, jobs: list, workers: int):
  """fn(job) for each job, as they finish: in this process with one worker, else in `workers` spawned processes
  (they start clean, never a fork of a process whose filesystem clients hold threads)."""
  with multiprocessing.get_context('spawn').Pool(workers) if workers > 1 else contextlib.nullcontext() as pool:
    yield from (pool.imap_unordered if pool else map)(fn, jobs)


def require(*holders: flags.FlagHolder) -> None:
  if missing := [holder.name for holder in holders if not holder.value]:
    raise InputError(f'--{missing[0]} is required')


def main(flag_values: flags.FlagValues, argv: Sequence[str], body: Callable[[], None], doc: str) -> int:
  """`body()` as the command line `argv` (the program first) runs it, its flags parsed into `flag_values` (from their
  defaults: a test calls this once per command line): 0 when done; --help shows `doc` and the flags; a bad flag, a
  stray argument or an InputError is one line `error: ...` on stderr and status 2; anything else keeps its
  traceback."""
  if {'--help', '-h', '-?', '--helpshort', '--helpfull'} & set(argv[1:]):
    described = flag_values.get_help(include_special_flags=False).splitlines()
    print('\n'.join([doc.rstrip(), '', 'flags:', *(line for line in described if line.startswith(' '))]))
    return 0
  flag_values.unparse_flags()
  try:
    if len(rest := flag_values(list(argv))) > 1:
      raise InputError(f'unexpected arguments: {" ".join(rest[1:])}')
    body()
  except (flags.Error, InputError) as e:
    print(f'error: {str(e).removeprefix("flag ")}', file=sys.stderr, flush=True)
    return 2
  return 0


def run(main_of_argv: Callable[[Sequence[str]], int]) -> None:
  """The process of a console script or `python -m`: the CPU where libtpu is installed but no accelerator is present
  (console.quiet_start), absl's warnings only, and main's status as the exit status."""
  console.quiet_start()
  logging.set_verbosity(logging.WARNING)
  sys.exit(main_of_argv(sys.argv))
