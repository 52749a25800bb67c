"""Converts C4's released JSON-lines shards to the ArrayRecord shards that laurel's C4 loader reads. No Beam, no TFDS.

  laurel-prepare-c4 --input=DIR --output=DIR [--splits=train,validation] [--workers=N]
  python -m laurel.prepare.c4 ...   # the same

--input (local or gs://) holds the `en` variant as released (github.com/allenai/c4, also
huggingface.co/datasets/allenai/c4): `c4-train.NNNNN-of-01024.json.gz` and `c4-validation.NNNNN-of-00008.json.gz`,
all of them or a subset. Each becomes `c4-<split>.NNNNN-of-MMMMM.array_record` in --output (local or gs://), one
record per document holding its text in UTF-8; train with `--config.data.name=c4 --config.data.path=OUTPUT`.
Files convert in parallel, one per worker process. A shard appears under its final name only once it is complete
(a local one is renamed, a gs:// object is uploaded whole), so an interrupted run resumes where it stopped: rerun
the same command and existing shards are skipped.
"""

import gzip
import io
import json
import os
import re
import shlex
import time
from collections.abc import Sequence

from absl import flags
from etils import epath

from laurel import data
from laurel.config_lib import InputError
from laurel.prepare import shards
from laurel.cli import console

FLAGS = flags.FlagValues()  # its own: laurel.prepare.text has flags of the same names
_INPUT = flags.DEFINE_string('input', None, "Directory of C4's c4-<split>.NNNNN-of-MMMMM.json.gz files.",
                             flag_values=FLAGS)
_OUTPUT = flags.DEFINE_string('output', None, 'Directory for the ArrayRecord shards (local or gs://).',
                              flag_values=FLAGS)
_SPLITS = flags.DEFINE_list('splits', ['train', 'validation'], 'Splits to convert.', flag_values=FLAGS)
_WORKERS = flags.DEFINE_integer('workers', os.cpu_count(), 'Files converted at once (processes).', flag_values=FLAGS)

INPUT_NAME = re.compile(r'c4-(?P<split>[\w-]+)\.(?P<shard>\d+-of-\d+)\.json(\.gz)?')


def shard_name(input_name: str) -> str | None:
  """'c4-train.00003-of-01024.json.gz' -> 'c4-train.00003-of-01024.array_record'; None for other files."""
  match = INPUT_NAME.fullmatch(input_name)
  return match and f'c4-{match["split"]}.{match["shard"]}{data.C4_SHARD_SUFFIX}'


def convert(source: str, dest: str) -> int:
  """One JSON-lines file -> one ArrayRecord shard; returns the number of documents."""
  source, count = epath.Path(source), 0
  with shards.array_record_shard(dest) as writer, source.open('rb') as raw, io.TextIOWrapper(
      gzip.open(raw) if source.name.endswith('.gz') else raw, encoding='utf-8') as lines:
    for line in lines:
      if line.strip():
        writer.write(json.loads(line)['text'].encode('utf-8'))
        count += 1
  return count


def _convert_job(job):
  source, dest = job
  start = time.time()
  return source, convert(source, dest), time.time() - start


def prepare():
  shards.require(_INPUT, _OUTPUT)
  if _WORKERS.value < 1:
    raise InputError(f'--workers={_WORKERS.value}: must be at least 1')
  source, out = epath.Path(_INPUT.value), epath.Path(_OUTPUT.value)
  if not source.is_dir():
    raise InputError(f'--input={_INPUT.value!r}: no such directory')
  inputs = sorted((p, shard_name(p.name)) for p in source.iterdir() if shard_name(p.name))
  inputs = [(p, name) for p, name in inputs if INPUT_NAME.fullmatch(p.name)['split'] in _SPLITS.value]
  if not inputs:
    raise InputError(f'--input={_INPUT.value!r}: no c4-<split>.NNNNN-of-MMMMM.json.gz files of the splits '
                     f'{",".join(_SPLITS.value)}')
  out.mkdir(parents=True, exist_ok=True)
  done = {p.name for p in out.iterdir()}
  jobs = [(os.fspath(p), os.fspath(out / name)) for p, name in inputs if name not in done]
  workers = min(_WORKERS.value, max(len(jobs), 1))
  print(f'{len(inputs) - len(jobs)} of {len(inputs)} shards already in {out}; converting {len(jobs)} with {workers} '
        f'worker{"s" * (workers > 1)}', flush=True)
  for i, (path, count, seconds) in enumerate(shards.parallel_map(_convert_job, jobs, workers)):
    print(f'[{i + 1}/{len(jobs)}] {os.path.basename(path)}: {count:,} documents in {seconds:.0f} s', flush=True)
  print(f'done: {len(inputs)} shards in {out}; train with T5\'s vocabulary (the paper preset\'s data.vocab_path '
        f'and model.vocab_size):\n  {console.python_command()} -m laurel.main --config=c4_ablation:rw_lr '
        f'--workdir=runs/c4_rw_lr --config.data.name=c4 --config.data.path={shlex.quote(os.fspath(out))} '
        f'--config.data.vocab_path={data.C4_VOCAB_PATH} '
        '--config.model.vocab_size=32768', flush=True)


def main(argv: Sequence[str]) -> int:
  """The command line `argv` (the program first): 0 when done, 2 with one line for bad input."""
  return shards.main(FLAGS, argv, prepare, __doc__)


def run():  # laurel-prepare-c4, python -m laurel.prepare.c4
  shards.run(main)


if __name__ == '__main__':
  run()
