"""LM input (docs/data.md): documents -> tokens + EOS -> chunks of <= seq_len -> first-fit packing -> batches of
int32 'tokens', 'segment_ids' (0 = padding) and 'positions'. Nothing is downloaded."""

import dataclasses
import functools
import glob
import hashlib
import itertools
import os
import pathlib
import re
import sys
import sysconfig

from etils import epath
import grain
from grain import experimental as grain_exp
import numpy as np

from laurel.config_lib import (NON_NEGATIVE_INT, STRING, InputError, build, field, in_range,
                               io_error_reason, is_int, one_of, optional_import, require)

BYTE_VOCAB_SIZE = 258  # ByteTokenizer's: 256 bytes, padding and end of document
C4_VOCAB_PATH = 'gs://t5-data/vocabs/cc_all.32000/sentencepiece.model'  # T5's 32k SentencePiece model
C4_SHARD_SUFFIX = '.array_record'  # laurel.prepare.c4 writes c4-<split>.NNNNN-of-MMMMM.array_record
SENTENCEPIECE_SOURCES = ('c4', 'corpus')  # tokenized with data.vocab_path, read from <name>-<split>.* shards
READ_OPTIONS = grain.ReadOptions(num_threads=4, prefetch_buffer_size=64)  # threads reading and tokenizing
MIN_PACKING_BINS = 16  # more open bins pack tighter (less padding) at the cost of a little memory
INSTALLED = '<installed>'  # data.path of 'text': every Python source installed here (installed_roots)


@dataclasses.dataclass(frozen=True)
class LMDataConfig:
  """`config.data` of an LM run."""
  name: str = field('synthetic', one_of('c4', 'corpus', 'text', 'synthetic'))
  seq_len: int = field(128, (lambda v: is_int(v) and v >= 2, 'must be an integer >= 2 (a row of one token has '
                                                              'no next token to predict)'))
  # text: a glob, '' = this interpreter's standard library (*.py), INSTALLED = it and every site-packages on
  # sys.path; c4: laurel.prepare.c4's shards, '' = a TFDS C4 in tfds_data_dir; corpus: laurel.prepare.text's.
  path: str = field('', STRING)
  validation_fraction: float = field(0.05, in_range(0, 1, closed=(False, False)))  # text: files held out
  tfds_name: str = field('c4/en', STRING)  # the version found in tfds_data_dir; 'c4/en:3.0.1' pins one
  tfds_data_dir: str = field('', STRING)  # '' = TFDS's default ($TFDS_DATA_DIR or ~/tensorflow_datasets)
  train_split: str = field('train', STRING)
  eval_split: str = field('validation', STRING)
  vocab_path: str = field('', STRING)  # c4, corpus: a SentencePiece model, e.g. C4_VOCAB_PATH
  # grain worker processes, 0: none (they read absl flags: parsed)
  num_workers: int = field(0, NON_NEGATIVE_INT, resumable=True)
  prefetch: int = field(2, NON_NEGATIVE_INT, resumable=True)


class ByteTokenizer:
  """0 = padding, byte b -> b + 1, 257 = end of document (BYTE_VOCAB_SIZE)."""
  vocab_size, pad_id, eos_id = BYTE_VOCAB_SIZE, 0, BYTE_VOCAB_SIZE - 1

  def encode(self, text: str) -> list[int]:
    return [b + 1 for b in text.encode('utf-8')]

  def decode(self, ids) -> str:
    return bytes(i - 1 for i in ids if 1 <= i <= 256).decode('utf-8', errors='replace')

  def document(self, text: str | bytes) -> np.ndarray:
    """Tokens of one document, EOS appended."""
    data = text.encode('utf-8') if isinstance(text, str) else bytes(text)
    return np.append(np.frombuffer(data, np.uint8).astype(np.int32) + 1, np.int32(self.eos_id))


class SentencePieceTokenizer:
  """The model's own ids; pickles as its proto for grain's workers; pads with 0 if the model has no pad piece."""

  def __init__(self, model_proto: bytes):
    import sentencepiece  # pylint: disable=g-import-not-at-top
    self._proto, self._sp = model_proto, sentencepiece.SentencePieceProcessor(model_proto=model_proto)
    self.vocab_size, self.eos_id = self._sp.get_piece_size(), self._sp.eos_id()
    self.pad_id = max(self._sp.pad_id(), 0)

  def __reduce__(self):
    return (SentencePieceTokenizer, (self._proto,))

  def encode(self, text: str) -> list[int]:
    return self._sp.encode(text)

  def decode(self, ids) -> str:
    return self._sp.decode([int(i) for i in ids])

  def document(self, text: str | bytes) -> np.ndarray:
    text = text.decode('utf-8', errors='replace') if isinstance(text, bytes) else text
    return np.asarray(self._sp.encode(text) + [self.eos_id], np.int32)


@functools.lru_cache(maxsize=8)
def _read_vocab(path: str) -> bytes:
  return epath.Path(path).read_bytes()  # epath reads gs:// where GCS is reachable


def make_tokenizer(data_cfg) -> ByteTokenizer | SentencePieceTokenizer:
  if data_cfg.name not in SENTENCEPIECE_SOURCES:
    return ByteTokenizer()
  try:
    tokenizer = SentencePieceTokenizer(_read_vocab(data_cfg.vocab_path))
  except Exception as e:  # pylint: disable=broad-except  # any filesystem's error, or sentencepiece's for a non-model
    fix = '' if isinstance(e, ImportError) else (
        '; point it at a model SentencePiece wrote (python -m laurel.prepare.text writes vocab.model: rerun it for a '
        'damaged one)')
    require(False, 'data.vocab_path', data_cfg.vocab_path, f'cannot read a SentencePiece model: '
            f'{io_error_reason(e)}{fix}')
  require(tokenizer.eos_id >= 0, 'data.vocab_path', data_cfg.vocab_path, 'the SentencePiece model defines no EOS id')
  return tokenizer


def _glob_root(pattern: str) -> str:
  """The directory before the first wildcard, which relative paths (and so the split) do not depend on."""
  fixed = itertools.takewhile(lambda part: not glob.has_magic(part), pattern.split(os.sep)[:-1])
  return os.sep.join(fixed) or (os.sep if pattern.startswith(os.sep) else os.curdir)


def installed_roots() -> list[tuple[str, str]]:
  """('stdlib', its folder), then ('site-packages', folder) of each site- or dist-packages on sys.path, once."""
  roots, seen = [('stdlib', sysconfig.get_paths()['stdlib'])], set()
  for folder in sys.path:
    real = os.path.realpath(folder or os.curdir)
    if os.path.basename(real) in ('site-packages', 'dist-packages') and os.path.isdir(real) and real not in seen:
      seen.add(real)
      roots.append(('site-packages', folder))
  return roots


def python_sources(roots) -> tuple[tuple[str, str], ...]:
  """(prefix/relative path, file) of every *.py under the roots, sorted; a key under two roots keeps the first's, as
  an import would."""
  found = {}
  for prefix, root in roots:
    for folder, dirs, names in os.walk(root):
      dirs[:] = [d for d in dirs if d not in ('__pycache__', 'site-packages', 'dist-packages')]
      for name in names:
        if name.endswith('.py') and os.path.isfile(path := os.path.join(folder, name)):
          found.setdefault(pathlib.PurePath(prefix, os.path.relpath(path, root)).as_posix(), path)
  return tuple(sorted(found.items()))


@functools.lru_cache(maxsize=8)
def _list_files(path: str) -> tuple[tuple[str, str], ...]:
  """(key, file) sorted by key, the key (what the split hashes) being a path relative to the glob's fixed part."""
  if path == INSTALLED:
    return python_sources(installed_roots())
  if not path:
    return python_sources([('', sysconfig.get_paths()['stdlib'])])
  root = _glob_root(path := os.path.expanduser(path))
  return tuple(sorted((pathlib.PurePath(os.path.relpath(f, root)).as_posix(), f)
                      for f in glob.glob(path, recursive=True) if os.path.isfile(f)))


def _unit_hash(text: str) -> float:
  """A stable (across runs, machines and Python versions) hash in [0, 1)."""
  return int.from_bytes(hashlib.sha256(text.encode('utf-8')).digest()[:8], 'big') / 2.0**64


def split_files(path: str, validation_fraction: float) -> tuple[list[str], list[str]]:
  """(train, validation) files, sorted by key; held out when its key's hash < fraction, >= 1 file in each."""
  keyed = sorted((_unit_hash(key), key, f) for key, f in _list_files(path))
  num_val = min(max(sum(h < validation_fraction for h, _, _ in keyed), 1), len(keyed) - 1)
  by_key = lambda part: [f for _, f in sorted((key, f) for _, key, f in part)]  # one order on every host
  return by_key(keyed[num_val:]), by_key(keyed[:num_val])


class SyntheticSource:
  """Document i of a split: a walk, seeded by (split, i), on 64 random words with 2 successors each."""

  def __init__(self, num_docs: int, split: int):
    self._num_docs, self._split = num_docs, split
    rng = np.random.default_rng(1234)
    letters = np.array(list('abcdefghijklmnopqrstuvwxyz'))
    self._words = [''.join(rng.choice(letters, size=rng.integers(2, 8))) for _ in range(64)]
    self._successors = rng.integers(0, len(self._words), size=(len(self._words), 2))

  def __len__(self) -> int:
    return self._num_docs

  def __getitem__(self, index: int) -> str:
    rng = np.random.default_rng((self._split, index))
    word, out = int(rng.integers(len(self._words))), []
    for choice in rng.integers(0, 2, size=rng.integers(8, 128)):
      out.append(self._words[word])
      word = int(self._successors[word, choice])
    return ' '.join(out) + '.\n'


def _source(cfg: LMDataConfig, train: bool) -> grain.MapDataset:
  split = cfg.train_split if train else cfg.eval_split
  if cfg.name in SENTENCEPIECE_SOURCES and cfg.path:  # records are the documents' UTF-8 bytes
    return grain.MapDataset.source(array_records(c4_shards(cfg.path, split, cfg.name)))
  if cfg.name in SENTENCEPIECE_SOURCES:  # from the directory itself: any version, no builder code, no download
    tfds = optional_import('tensorflow_datasets', 'tfds', f'data.tfds_data_dir={cfg.tfds_data_dir!r}')
    builder = tfds.builder_from_directory(tfds_version_dir(cfg.tfds_data_dir, cfg.tfds_name),
                                          file_format='array_record')
    return grain.MapDataset.source(builder.as_data_source(split=split))
  if cfg.name == 'text':  # a file is read only when its document is asked for
    files = split_files(cfg.path, cfg.validation_fraction)[0 if train else 1]
    return grain.MapDataset.source([pathlib.Path(f) for f in files]).map(pathlib.Path.read_bytes)
  return grain.MapDataset.source(SyntheticSource(1 << 20 if train else 512, split=0 if train else 1))


def _tokenize(tokenizer, record) -> np.ndarray:
  """A record -> int32 tokens with EOS (a module function: grain's workers pickle it)."""
  return tokenizer.document(record['text'] if isinstance(record, dict) else record)


class _Chunk(grain_exp.FlatMapTransform):
  """Tokens -> [{'tokens': chunk}] with chunks of <= seq_len."""
  max_fan_out = 1 << 20  # only read by the MapDataset flat map; the IterDataset one takes any count

  def __init__(self, seq_len: int):
    self._seq_len = seq_len

  def flat_map(self, tokens_n: np.ndarray) -> list[dict[str, np.ndarray]]:
    return [{'tokens': tokens_n[i:i + self._seq_len]} for i in range(0, len(tokens_n), self._seq_len)]


def _rename(packed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  return {'tokens': packed['tokens'], 'segment_ids': packed['tokens_segment_ids'],
          'positions': packed['tokens_positions']}


def lm_dataset(data_cfg, *, train: bool, batch_size: int, seed: int, process_index: int = 0,
               process_count: int = 1, max_segments: int = 0) -> grain.IterDataset:
  """Endless batches for one process (document i of an epoch to process i % process_count): train reshuffled every
  epoch, validation in a fixed order. Rows hold at most `max_segments` chunks (0: as many as fit)."""
  cfg = build(LMDataConfig, data_cfg, 'data')
  tokenizer = make_tokenizer(cfg)
  ds = _source(cfg, train)
  ds = (ds.seed(seed).shuffle() if train else ds)[process_index::process_count]
  if not len(ds):  # pylint: disable=g-explicit-length-test
    raise InputError(f'data.name={cfg.name!r}: no documents for process {process_index} of {process_count} in '
                     f'the {"train" if train else "validation"} split')
  # Repeat after the shard: each epoch reshuffles, and a process keeps its share of every epoch.
  ds = ds.repeat().map(functools.partial(_tokenize, tokenizer)).to_iter_dataset(READ_OPTIONS)
  ds = grain_exp.FirstFitPackIterDataset(
      grain_exp.FlatMapIterDataset(ds, _Chunk(cfg.seq_len)), length_struct={'tokens': cfg.seq_len},
      num_packing_bins=max(batch_size, MIN_PACKING_BINS), seed=seed, shuffle_bins=train,
      padding_struct={'tokens': tokenizer.pad_id}, max_sequences_per_bin=max_segments or None)
  ds = ds.map(_rename).batch(batch_size, drop_remainder=True)
  if cfg.num_workers > 0:
    return ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=cfg.num_workers,
                                                       per_worker_buffer_size=max(cfg.prefetch, 1)))
  return grain_exp.ThreadPrefetchIterDataset(ds, prefetch_buffer_size=cfg.prefetch) if cfg.prefetch else ds


def check_vocab(cfg: LMDataConfig, vocab_size: int | None, context: str = '') -> None:
  """An InputError if the tokenizer's model cannot be read or its vocabulary is larger than `vocab_size`."""
  tokenizer_vocab = make_tokenizer(cfg).vocab_size
  if vocab_size is not None:
    require(vocab_size >= tokenizer_vocab, 'model.vocab_size', vocab_size,
            f"smaller than the tokenizer's {tokenizer_vocab}{context}")


def validate(data_cfg, vocab_size: int) -> LMDataConfig:
  """One-line InputErrors naming the bad field, before anything is read in bulk."""
  cfg = build(LMDataConfig, data_cfg, 'data')
  fail = lambda name, why: require(False, f'data.{name}', getattr(cfg, name), why)
  if cfg.name == 'text':
    if (num_files := len(_list_files(cfg.path))) < 2:
      fail('path', 'matches 1 file; need at least 2 to split train and validation' if num_files else
           'matches no files')
    for split, files in zip(('train', 'validation'), split_files(cfg.path, cfg.validation_fraction)):
      if not any(os.path.getsize(f) for f in files):
        fail('path', f'its {len(files)} {split} file{"s" * (len(files) > 1)} are empty: nothing to '
             f'{"train" if split == "train" else "evaluate"} on')
  if cfg.name == 'corpus' and not cfg.path:
    fail('path', "corpus reads the directory that python -m laurel.prepare.text wrote (its closing line names every "
         'flag)')
  if cfg.name in SENTENCEPIECE_SOURCES and not cfg.vocab_path:
    fail('vocab_path', f'{cfg.name} needs a SentencePiece model')
  if not (cfg.vocab_path.startswith('gs://') and cfg.name in SENTENCEPIECE_SOURCES):
    check_vocab(cfg, vocab_size)  # gs://: preflight checks it, on the training hosts
  return cfg


def unused_fields(cfg: LMDataConfig) -> dict[str, str]:
  """{field: why} of the fields the chosen source does not read."""
  name, byte_level = f'data.name={cfg.name!r}', cfg.name not in SENTENCEPIECE_SOURCES
  no_tfds = (cfg.name != 'c4' or bool(cfg.path), f'{name} reads no TFDS' if cfg.name != 'c4' else
             'data.path is set: C4 is read from its shards there, not from TFDS')
  checks = {'path': (cfg.name == 'synthetic', f'{name} reads no files'),
            'validation_fraction': (cfg.name != 'text', f'{name}: only text holds files out'),
            'vocab_path': (byte_level, f'{name} is byte-level'),
            'train_split': (byte_level, f'{name} has no named splits'),
            'eval_split': (byte_level, f'{name} has no named splits'), 'tfds_name': no_tfds, 'tfds_data_dir': no_tfds}
  return {f'data.{field}': why for field, (no_effect, why) in checks.items() if no_effect}


def c4_shards(path: str, split: str, name: str = 'c4') -> list[str]:
  """The shards <name>-<split>.*.array_record in directory `path` (local or gs://), in order."""
  return sorted(os.fspath(p) for p in epath.Path(path).glob(f'{name}-{split}.*{C4_SHARD_SUFFIX}'))


def array_records(shards: list[str]) -> grain.sources.ArrayRecordDataSource:
  """The documents of ArrayRecord shards; a shard that cannot be opened (truncated, or not ArrayRecord) is a one-line
  InputError naming it and the command that writes it again."""
  try:
    return grain.sources.ArrayRecordDataSource(shards)
  except Exception:  # pylint: disable=broad-except  # ArrayRecord's RuntimeError: find the shard, name it
    for shard in shards:
      try:
        grain.sources.ArrayRecordDataSource([shard])
      except Exception as e:  # pylint: disable=broad-except
        folder, name = os.path.split(shard)
        tool = 'laurel.prepare.c4' if name.startswith('c4-') else 'laurel.prepare.text'
        why = io_error_reason(e).removesuffix(': ')  # ArrayRecord may say nothing of a file cut short
        require(False, 'data.path', folder, f'shard {name} is not a readable ArrayRecord file ({why}); remove it and '
                f'rerun python -m {tool} with the arguments that wrote it: it writes the missing shards again')
    raise


def num_records(shards: list[str]) -> int:
  """How many documents ArrayRecord shards hold, from their footers (gs:// included)."""
  return len(array_records(shards))


def tfds_version_dir(data_dir: str, name: str) -> epath.Path | None:
  """<data_dir>/<name>/<version> of a prepared TFDS dataset, the version pinned in `name` or the newest; or None."""
  constants = optional_import('tensorflow_datasets.core.constants', 'tfds', f'data.tfds_data_dir={data_dir!r}')
  name, _, version = name.partition(':')
  root = epath.Path(os.path.expanduser(data_dir or constants.DATA_DIR)) / name
  versions = [version] if version else sorted(
      (p.name for p in (root.iterdir() if root.is_dir() else []) if re.fullmatch(r'\d+\.\d+\.\d+', p.name)),
      key=lambda v: tuple(map(int, v.split('.'))), reverse=True)
  return next((root / v for v in versions if (root / v / 'dataset_info.json').exists()), None)


def default_tfds_c4(cfg) -> epath.Path | None:
  """A C4 that TFDS prepared in its default directory, or None (also without the tfds extra)."""
  try:
    return tfds_version_dir('', cfg.tfds_name)
  except InputError:  # no tfds: no C4 of its own either
    return None
