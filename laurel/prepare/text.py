"""Your own documents, ready to train on in one command: ArrayRecord shards and a SentencePiece vocabulary.

  laurel-prepare-text --input='~/corpus/*.jsonl.gz' [--input='notes/**/*.txt' ...] --output=data/mine
      [--vocab_size=16000 | --vocab_path=EXISTING.model] [--text_field=text] [--text_unit=file|line]
      [--validation_fraction=0.02] [--num_shards=N] [--workers=N]
  python -m laurel.prepare.text ...   # the same

Inputs (globs, local or gs://; ** recurses), each optionally gzipped (.gz): JSON lines (.jsonl, or .json with one
object per line, as C4's files are), a JSON array (a .json file starting with '['), or text (any other name). A JSON
value's document is its --text_field (or the value itself, if a string); a text file is one document
(--text_unit=file) or one per non-empty line (--text_unit=line). A document goes to the validation split when a
stable hash of its file and position falls below --validation_fraction, else to train.

Output, in --output (local or gs://): corpus-<split>.NNNNN-of-MMMMM.array_record, one record per document (its UTF-8
text), the inputs spread over MMMMM shards converted in parallel (--workers); and vocab.model, a SentencePiece model
trained on up to --vocab_sample_docs train documents with the ids laurel's loader needs (pad 0, eos 1, unk 2, no bos),
byte fallback (no unknown characters) and whitespace kept as written (code keeps its indentation); before any shard
is written, --vocab_size is checked against the pieces the inputs' characters need (those covering 99.95% of the
first --vocab_sample_docs documents, as SentencePiece counts them, and the 259 special and byte pieces). --vocab_path
uses an existing model instead (e.g. T5's, data.C4_VOCAB_PATH), checked to be one before anything is written. A
rerun with the same arguments resumes: finished shards and the vocabulary are kept (prepare.json records the
arguments). Once finished, other inputs or options need another --output; after an attempt that failed, a corrected
command reuses the folder (what the attempt wrote is removed). The closing lines print the training command with
every flag it needs.
"""

import collections
import glob
import gzip
import io
import json
import os
import re
import shlex
import time
import unicodedata
from collections.abc import Sequence

import numpy as np
from absl import flags
from etils import epath

from laurel import data
from laurel.config_lib import InputError, io_error_reason
from laurel.prepare import shards
from laurel.cli import console
from laurel.cli.files import write_bytes_atomic, write_text_atomic

PREFIX = 'corpus'  # the loader's data.name for these shards
SPLITS = ('train', 'validation')
MAX_SHARDS = 64  # default --num_shards: one per input file, up to this many
SPECIAL_AND_BYTE_PIECES = 3 + 256  # pad, eos, unk and byte fallback's 256: SentencePiece's meta pieces
CHARACTER_COVERAGE = 0.9995  # SentencePiece's: the characters covering this share of the text get pieces of their own

FLAGS = flags.FlagValues()  # its own: laurel.prepare.c4 has flags of the same names
_INPUT = flags.DEFINE_multi_string('input', [], 'Glob of input files (repeatable), local or gs://.', flag_values=FLAGS)
_OUTPUT = flags.DEFINE_string('output', None, 'Directory for the shards and the vocabulary (local or gs://).',
                              flag_values=FLAGS)
_TEXT_FIELD = flags.DEFINE_string('text_field', 'text', "JSON inputs: the field holding a document's text.",
                                  flag_values=FLAGS)
_TEXT_UNIT = flags.DEFINE_enum('text_unit', 'file', ['file', 'line'], 'Text inputs: a document per file or per '
                               'non-empty line.', flag_values=FLAGS)
_VALIDATION_FRACTION = flags.DEFINE_float('validation_fraction', 0.02, 'Share of the documents held out.',
                                          flag_values=FLAGS)
_NUM_SHARDS = flags.DEFINE_integer('num_shards', 0, f'Shards per split; 0 = one per input file, at most {MAX_SHARDS}.',
                                   flag_values=FLAGS)
_WORKERS = flags.DEFINE_integer('workers', os.cpu_count(), 'Shards written at once (processes).', flag_values=FLAGS)
_VOCAB_SIZE = flags.DEFINE_integer('vocab_size', 16000, 'Pieces of the SentencePiece vocabulary to train.',
                                   flag_values=FLAGS)
_VOCAB_PATH = flags.DEFINE_string('vocab_path', '', 'Use this SentencePiece model instead of training one.',
                                  flag_values=FLAGS)
_VOCAB_MODEL_TYPE = flags.DEFINE_enum('vocab_model_type', 'unigram', ['unigram', 'bpe'], "SentencePiece's algorithm.",
                                      flag_values=FLAGS)
_VOCAB_SAMPLE_DOCS = flags.DEFINE_integer('vocab_sample_docs', 100_000, 'Train documents the vocabulary learns from '
                                          '(spread evenly over the split).', flag_values=FLAGS)


def input_files(patterns: list[str]) -> list[str]:
  """Every file the globs match (local or gs://), sorted; a one-line ValueError for a glob that matches none."""
  files = set()
  for pattern in patterns:
    if '://' in pattern:
      root = data._glob_root(pattern)  # pylint: disable=protected-access
      found = [os.fspath(p) for p in epath.Path(root).glob(pattern[len(root):].lstrip('/')) if p.is_file()]
    else:
      found = [f for f in glob.glob(os.path.expanduser(pattern), recursive=True) if os.path.isfile(f)]
    if not found:
      raise InputError(f'--input={pattern!r}: matches no files')
    files.update(found)
  return sorted(files)


def documents(path: str, text_field: str, text_unit: str):
  """The documents of one input file, in order (module docstring)."""
  name = path.removesuffix('.gz')
  with epath.Path(path).open('rb') as raw, io.TextIOWrapper(gzip.open(raw) if path.endswith('.gz') else raw,
                                                             encoding='utf-8') as stream:
    if not name.endswith(('.json', '.jsonl')):
      text = stream.read()
      yield from ([text] if text_unit == 'file' else [line for line in text.splitlines() if line.strip()])
      return
    head = stream.read(1)
    while head.isspace():
      head = stream.read(1)
    if head == '[':
      values = enumerate(json.loads(head + stream.read()), 1)
    else:
      values = ((i, json.loads(line)) for i, line in enumerate(
          (head + stream.readline(), *stream), 1) if line.strip())
    for i, value in values:
      if isinstance(value, dict) and isinstance(value.get(text_field), str):
        yield value[text_field]
      elif isinstance(value, str):
        yield value
      else:
        raise InputError(f'{path}: item {i} is neither a string nor an object with a string --text_field='
                         f'{text_field!r}')


def shard_names(num_shards: int) -> dict[str, list[str]]:
  return {split: [f'{PREFIX}-{split}.{i:05d}-of-{num_shards:05d}{data.C4_SHARD_SUFFIX}' for i in range(num_shards)]
          for split in SPLITS}


def write_shard(job) -> tuple[dict[str, int], float]:
  """Shard i of both splits from its input files; returns the documents per split and the seconds it took."""
  files, root, dests, options = job
  start, counts = time.time(), dict.fromkeys(SPLITS, 0)
  with shards.array_record_shard(dests['train']) as train, shards.array_record_shard(dests['validation']) as val:
    for path in files:
      for i, text in enumerate(documents(path, options['text_field'], options['text_unit'])):
        # Keyed by the path below the inputs' common folder: the same split wherever the corpus lies.
        held_out = data._unit_hash(f'{path[len(root):]}:{i}') < options['validation_fraction']  # pylint: disable=protected-access
        (val if held_out else train).write(text.encode('utf-8'))
        counts['validation' if held_out else 'train'] += 1
  return counts, time.time() - start


def required_pieces(texts) -> tuple[int, str]:
  """The pieces a vocabulary of `texts` needs at least, as SentencePiece counts them: the most frequent characters
  (after NFKC, a space as ▁) that cover CHARACTER_COVERAGE of the text, and the special and byte pieces; and why."""
  counts, documents_read = collections.Counter(), 0
  for documents_read, text in enumerate(texts, 1):
    for line in text.splitlines():
      counts.update(unicodedata.normalize('NFKC', line).replace(' ', '\u2581'))
  total, covered, characters = sum(counts.values()), 0, 0
  for _, count in counts.most_common():
    if covered >= CHARACTER_COVERAGE * total:
      break
    covered, characters = covered + count, characters + 1
  return characters + SPECIAL_AND_BYTE_PIECES, (f'{characters:,} characters cover {CHARACTER_COVERAGE:.2%} of '
                                                f'{documents_read:,} document{"s" * (documents_read != 1)} of --input')


def check_vocab_size(vocab_size: int, needed: int, why: str) -> None:
  if vocab_size < needed:
    raise InputError(f'--vocab_size={vocab_size}: below the {needed:,} pieces this corpus needs ({why}, and the '
                     f'special and byte pieces take {SPECIAL_AND_BYTE_PIECES}): set --vocab_size={needed} or more, or '
                     '--vocab_path=an existing model')


def first_documents(files: list[str], count: int, text_field: str, text_unit: str):
  """Up to `count` documents of the inputs, in order."""
  docs = (text for path in files for text in documents(path, text_field, text_unit))
  return (text for _, text in zip(range(count), docs))


def read_vocab(path, flag: str, fix: str) -> int:
  """The pieces of the SentencePiece model at `path`; one line naming it and `fix` where it cannot be read."""
  try:
    return data.SentencePieceTokenizer(epath.Path(path).read_bytes()).vocab_size
  except Exception as e:  # pylint: disable=broad-except  # a filesystem's error, or sentencepiece's for a non-model
    raise InputError(f'{flag}={os.fspath(path)!r}: cannot read a SentencePiece model ({io_error_reason(e)}); '
                     f'{fix}') from None


def train_vocab(train_shards: list[str], dest: epath.Path, vocab_size: int, model_type: str, sample_docs: int):
  """A SentencePiece model on up to `sample_docs` train documents, spread evenly, one sentence per line."""
  import grain  # pylint: disable=import-outside-toplevel
  source = grain.sources.ArrayRecordDataSource(train_shards)
  picked = np.unique(np.linspace(0, len(source) - 1, min(len(source), sample_docs)).astype(int))
  lines = (line for i in picked for line in source[int(i)].decode('utf-8').splitlines() if line.strip())
  write_bytes_atomic(dest, sentencepiece_model(lines, vocab_size, model_type, 'its sample of the train split'))


def sentencepiece_model(lines, vocab_size: int, model_type: str, sample: str) -> bytes:
  """A SentencePiece model of `lines` with the ids laurel's loader needs; a vocabulary smaller than the characters of
  `sample` (the lines) need is one line."""
  import sentencepiece  # pylint: disable=import-outside-toplevel
  model = io.BytesIO()
  try:
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=lines, model_writer=model, vocab_size=vocab_size, model_type=model_type,
        pad_id=0, eos_id=1, unk_id=2, bos_id=-1, byte_fallback=True, normalization_rule_name='nfkc',
        remove_extra_whitespaces=False, allow_whitespace_only_pieces=True, character_coverage=CHARACTER_COVERAGE,
        input_sentence_size=2_000_000, shuffle_input_sentence=True, hard_vocab_limit=False,
        num_threads=os.cpu_count(), minloglevel=2)
  except RuntimeError as e:  # its sample needs more than check_vocab_size's count of the inputs did
    if not (found := re.search(r'smaller than required_chars\. \d+ vs (\d+)', str(e))):
      raise
    needed = int(found.group(1))
    check_vocab_size(vocab_size, needed, f'{needed - SPECIAL_AND_BYTE_PIECES:,} characters cover '
                     f'{CHARACTER_COVERAGE:.2%} of {sample}')
    raise
  return model.getvalue()


def check_resumable(out: epath.Path, options: dict):
  """prepare.json records the options and whether they finished. A finished --output with other options is refused;
  what an unfinished attempt with other options wrote (its shards, its vocabulary) is removed, so the corrected
  command runs in the same folder."""
  manifest = out / 'prepare.json'
  saved = json.loads(manifest.read_text()) if manifest.exists() else None
  if saved is not None and {k: v for k, v in saved.items() if k != 'complete'} != options:
    if saved.get('complete', True):  # a good corpus is never overwritten
      changed = ', '.join(f'{k}={saved.get(k)!r} (now {v!r})' for k, v in options.items() if saved.get(k) != v)
      raise InputError(f'--output={_OUTPUT.value!r}: was prepared with {changed}; use another --output')
    stale = [name for names in shard_names(saved['num_shards']).values() for name in names]
    for name in stale + ['vocab.model'] * isinstance(saved['vocab'], dict):  # a vocabulary of its own shards
      (out / name).unlink(missing_ok=True)
  write_text_atomic(manifest, json.dumps({**options, 'complete': False}, indent=2) + '\n')


def prepare():
  shards.require(_INPUT, _OUTPUT)
  for flag, ok, why in (('workers', _WORKERS.value >= 1, 'at least 1'), ('num_shards', _NUM_SHARDS.value >= 0, '>= 0'),
                        ('validation_fraction', 0 < _VALIDATION_FRACTION.value < 1, 'in (0, 1)'),
                        ('vocab_size', _VOCAB_SIZE.value >= 300 or _VOCAB_PATH.value,
                         'at least 300 (the special and byte pieces take 259)'),
                        ('vocab_sample_docs', _VOCAB_SAMPLE_DOCS.value >= 1, 'at least 1')):
    if not ok:
      raise InputError(f'--{flag}={FLAGS[flag].value!r}: must be {why}')
  if _VOCAB_PATH.value and not epath.Path(_VOCAB_PATH.value).exists():
    raise InputError(f'--vocab_path={_VOCAB_PATH.value!r}: no such file')
  if _VOCAB_PATH.value:
    read_vocab(_VOCAB_PATH.value, '--vocab_path',
               'give a .model file SentencePiece wrote, or leave --vocab_path out to train one on the corpus')
  files, out = input_files(_INPUT.value), epath.Path(_OUTPUT.value)
  if not _VOCAB_PATH.value and not (out / 'vocab.model').exists():  # before any shard is written
    check_vocab_size(_VOCAB_SIZE.value, *required_pieces(
        first_documents(files, _VOCAB_SAMPLE_DOCS.value, _TEXT_FIELD.value, _TEXT_UNIT.value)))
  num_shards = _NUM_SHARDS.value or min(len(files), MAX_SHARDS)
  prefix = os.path.commonprefix(files)
  root = prefix[:prefix.rfind('/') + 1]  # the inputs' common folder, local or gs://
  options = {'inputs': files, 'num_shards': num_shards, 'text_field': _TEXT_FIELD.value,
             'text_unit': _TEXT_UNIT.value, 'validation_fraction': _VALIDATION_FRACTION.value,
             'vocab': _VOCAB_PATH.value or {'size': _VOCAB_SIZE.value, 'model_type': _VOCAB_MODEL_TYPE.value,
                                            'sample_docs': _VOCAB_SAMPLE_DOCS.value}}
  out.mkdir(parents=True, exist_ok=True)
  check_resumable(out, options)
  names, done = shard_names(num_shards), {p.name for p in out.iterdir()}
  jobs = [(files[i::num_shards], root, {split: os.fspath(out / names[split][i]) for split in SPLITS}, options)
          for i in range(num_shards) if not all(names[split][i] in done for split in SPLITS)]
  workers = min(_WORKERS.value, max(len(jobs), 1))
  print(f'{len(files)} input files -> {num_shards} shards per split in {out}: {num_shards - len(jobs)} already '
        f'there; writing {len(jobs)} with {workers} worker{"s" * (workers > 1)}', flush=True)
  for i, (counts, seconds) in enumerate(shards.parallel_map(write_shard, jobs, workers)):
    print(f'[{i + 1}/{len(jobs)}] {counts["train"]:,} train and {counts["validation"]:,} validation documents in '
          f'{seconds:.0f} s', flush=True)
  import grain  # pylint: disable=import-outside-toplevel
  written = {split: [os.fspath(out / name) for name in names[split]] for split in SPLITS}
  counts = {split: len(grain.sources.ArrayRecordDataSource(paths)) for split, paths in written.items()}
  if not sum(counts.values()):  # empty shards would be taken as done by a rerun on good input
    for path in [*(p for paths in written.values() for p in paths), os.fspath(out / 'prepare.json')]:
      epath.Path(path).unlink(missing_ok=True)
    raise InputError(f'--input={",".join(_INPUT.value)}: its {len(files)} file{"s" * (len(files) > 1)} hold no '
                     'documents; nothing was kept')
  for split, count in counts.items():
    if not count:
      raise InputError(f'--input: no document went to the {split} split; '
                       + ('raise --validation_fraction' if split == 'validation' else 'lower --validation_fraction'))

  vocab = epath.Path(_VOCAB_PATH.value) if _VOCAB_PATH.value else out / 'vocab.model'
  if not vocab.exists():
    print(f'training a {_VOCAB_SIZE.value:,}-piece SentencePiece vocabulary on up to {_VOCAB_SAMPLE_DOCS.value:,} '
          'train documents...', flush=True)
    train_vocab(written['train'], vocab, _VOCAB_SIZE.value, _VOCAB_MODEL_TYPE.value, _VOCAB_SAMPLE_DOCS.value)
  pieces = read_vocab(vocab, '--vocab_path' if _VOCAB_PATH.value else '--output',
                      f'remove {vocab} and rerun the same command: it trains the vocabulary again')
  write_text_atomic(out / 'prepare.json', json.dumps({**options, 'complete': True}, indent=2) + '\n')
  model_vocab = -(-pieces // 128) * 128  # the vocab axis then shards over up to 128 devices
  run = f'runs/{out.name}'
  print(f'done: {counts["train"]:,} train and {counts["validation"]:,} validation documents in {num_shards} shards '
        f'per split in {out}; vocabulary {vocab} ({pieces:,} pieces)\n'
        f'train a small model on it (any row of configs/c4_ablation.py; --config.model.* changes the shape):\n'
        f'  {console.python_command()} -m laurel.main --config=c4_ablation:rw_lr,preset=small '
        f'--workdir={shlex.quote(run)} --config.data.name={PREFIX} --config.data.path={shlex.quote(os.fspath(out))} '
        f'--config.data.vocab_path={shlex.quote(os.fspath(vocab))} --config.model.vocab_size={model_vocab}',
        flush=True)


def main(argv: Sequence[str]) -> int:
  """The command line `argv` (the program first): 0 when done, 2 with one line for bad input."""
  return shards.main(FLAGS, argv, prepare, __doc__)


def run():  # laurel-prepare-text, python -m laurel.prepare.text
  shards.run(main)


if __name__ == '__main__':
  run()
