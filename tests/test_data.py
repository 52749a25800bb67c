"""laurel.data: packing invariants, no data loss, splits, sharding, resumable iterators, validate (C4: test_c4.py)."""

import json
import os
import re
import shutil

import numpy as np
import pytest

from laurel import config_lib
from laurel import data

SEQ_LEN = 128
EOS = data.BYTE_VOCAB_SIZE - 1


@pytest.fixture(scope='module')
def corpus(tmp_path_factory):
  """60 files in nested folders with unique contents, some longer than SEQ_LEN, some non-UTF-8 bytes."""
  root = tmp_path_factory.mktemp('corpus')
  rng = np.random.default_rng(0)
  for i in range(60):
    folder = root / f'd{i % 3}' / f'e{i % 2}'
    folder.mkdir(parents=True, exist_ok=True)
    body = rng.integers(0, 256, size=int(rng.integers(50, 400)), dtype=np.uint8).tobytes()
    (folder / f'f{i}.txt').write_bytes(f'file {i}\n'.encode() + body)
  (root / 'ignored.bin').write_bytes(b'not matched by the glob')
  return root


def lm_data(name, seq_len, **overrides):
  """`config.data` of an LM run (every LMDataConfig field) with `name` and `seq_len`."""
  return config_lib.config_dict(data.LMDataConfig, name=name, seq_len=seq_len, **overrides)


def text_cfg(root, seq_len=SEQ_LEN, fraction=0.3):
  cfg = lm_data('text', seq_len)
  cfg.path = os.path.join(str(root), '**', '*.txt')
  cfg.validation_fraction = fraction
  return cfg


def file_chunks(paths, seq_len=SEQ_LEN) -> set[tuple[int, ...]]:
  """The segments a file must become: byte tokens + EOS, cut every seq_len tokens."""
  out = set()
  for path in paths:
    tokens = list(np.frombuffer(open(path, 'rb').read(), np.uint8).astype(int) + 1) + [EOS]
    out.update(tuple(tokens[i:i + seq_len]) for i in range(0, len(tokens), seq_len))
  return out


def segments(batch) -> list[tuple[int, ...]]:
  """Checks the packing invariants of one batch and returns the token tuple of every segment."""
  tokens, seg, pos = batch['tokens'], batch['segment_ids'], batch['positions']
  assert tokens.dtype == seg.dtype == pos.dtype == np.int32
  assert tokens.shape == seg.shape == pos.shape
  out = []
  for tokens_l, seg_l, pos_l in zip(tokens, seg, pos):
    ids = seg_l[seg_l > 0]
    assert list(np.unique(ids)) == list(range(1, len(np.unique(ids)) + 1))  # 1, 2, ... in a row
    assert (np.diff(seg_l[seg_l > 0]) >= 0).all()  # each segment is contiguous
    assert (tokens_l[seg_l == 0] == 0).all() and (pos_l[seg_l == 0] == 0).all()  # padding
    assert (seg_l[np.argmax(seg_l == 0):] == 0).all() or (seg_l > 0).all()  # padding only at the end
    for s in np.unique(ids):
      np.testing.assert_array_equal(pos_l[seg_l == s], np.arange((seg_l == s).sum()))
      out.append(tuple(int(t) for t in tokens_l[seg_l == s]))
  return out


def take_segments(ds, num_batches) -> set[tuple[int, ...]]:
  it = iter(ds)
  out = set()
  for _ in range(num_batches):
    out.update(segments(next(it)))
  it.close()
  return out


def test_split_is_disjoint_deterministic_and_depends_only_on_relative_paths(corpus, tmp_path):
  cfg = text_cfg(corpus)
  train, val = data.split_files(cfg.path, cfg.validation_fraction)
  assert len(train) + len(val) == 60 and not set(train) & set(val)
  assert 5 <= len(val) <= 35  # about 30% of 60
  assert data.split_files(cfg.path, cfg.validation_fraction) == (train, val)
  shutil.copytree(corpus, tmp_path / 'copy')
  train2, val2 = data.split_files(text_cfg(tmp_path / 'copy').path, cfg.validation_fraction)
  rel = lambda paths, root: sorted(os.path.relpath(p, root) for p in paths)
  assert rel(train2, tmp_path / 'copy') == rel(train, corpus)
  assert rel(val2, tmp_path / 'copy') == rel(val, corpus)


@pytest.mark.parametrize('train', [True, False])
def test_text_batches_hold_every_byte_and_nothing_else(corpus, train):
  cfg = text_cfg(corpus)
  train_files, val_files = data.split_files(cfg.path, cfg.validation_fraction)
  ds = data.lm_dataset(cfg, train=train, batch_size=4, seed=3)
  batch = next(iter(ds))
  assert {k: v.shape for k, v in batch.items()} == {k: (4, SEQ_LEN) for k in ('tokens', 'segment_ids', 'positions')}
  seen = take_segments(ds, 40)  # > 2 epochs of either split
  assert seen == file_chunks(train_files if train else val_files)


def test_per_process_shards_are_disjoint_and_cover_the_split(corpus):
  cfg = text_cfg(corpus)
  shards = [take_segments(data.lm_dataset(cfg, train=False, batch_size=2, seed=0, process_index=i,
                                          process_count=2), 30) for i in range(2)]
  assert not shards[0] & shards[1]
  assert shards[0] | shards[1] == file_chunks(data.split_files(cfg.path, cfg.validation_fraction)[1])
  # Train: the first batch lies inside the first (shuffled) epoch, whose halves are disjoint.
  first = [take_segments(data.lm_dataset(cfg, train=True, batch_size=2, seed=5, process_index=i,
                                         process_count=2), 1) for i in range(2)]
  assert first[0] and first[1] and not first[0] & first[1]


def test_train_order_depends_on_seed_and_eval_order_is_fixed(corpus):
  cfg = text_cfg(corpus)
  first = lambda **kw: next(iter(data.lm_dataset(cfg, batch_size=2, **kw)))['tokens']
  np.testing.assert_array_equal(first(train=True, seed=1), first(train=True, seed=1))
  assert not np.array_equal(first(train=True, seed=1), first(train=True, seed=2))
  np.testing.assert_array_equal(first(train=False, seed=1), first(train=False, seed=2))


@pytest.mark.parametrize('name,train,prefetch', [('text', True, 2), ('text', False, 0), ('synthetic', True, 2)])
def test_iterator_state_round_trips(corpus, name, train, prefetch):
  cfg = text_cfg(corpus, seq_len=64) if name == 'text' else lm_data(name, 64)
  cfg.prefetch = prefetch
  ds = data.lm_dataset(cfg, train=train, batch_size=3, seed=7)
  it = iter(ds)
  for _ in range(5):
    next(it)
  state = json.loads(json.dumps(it.get_state()))  # grain's CheckpointSave stores it as JSON
  expected = [next(it) for _ in range(4)]
  resumed = iter(ds)
  resumed.set_state(state)
  for want, got in zip(expected, [next(resumed) for _ in range(4)]):
    for key in want:
      np.testing.assert_array_equal(want[key], got[key])
  it.close()
  resumed.close()


def test_synthetic_is_deterministic_and_byte_level():
  cfg = lm_data('synthetic', 64)
  assert data.validate(cfg, data.BYTE_VOCAB_SIZE) == data.LMDataConfig(name='synthetic', seq_len=64)
  a = next(iter(data.lm_dataset(cfg, train=False, batch_size=2, seed=0)))
  b = next(iter(data.lm_dataset(cfg, train=False, batch_size=2, seed=0)))
  np.testing.assert_array_equal(a['tokens'], b['tokens'])
  assert a['tokens'].max() < data.BYTE_VOCAB_SIZE
  segments(a)
  assert data.SyntheticSource(10, 0)[3] != data.SyntheticSource(10, 1)[3]  # train and validation differ


@pytest.mark.slow
def test_multiprocess_prefetch_resumes(corpus):
  cfg = text_cfg(corpus, seq_len=64)
  cfg.num_workers = 1
  ds = data.lm_dataset(cfg, train=True, batch_size=2, seed=0)
  it = iter(ds)
  next(it)
  state = json.loads(json.dumps(it.get_state()))
  expected = [next(it) for _ in range(2)]
  it.close()
  resumed = iter(ds)
  resumed.set_state(state)
  for want in expected:
    np.testing.assert_array_equal(want['tokens'], next(resumed)['tokens'])
  resumed.close()


def test_default_corpus_is_the_standard_library():
  cfg = lm_data('text', 64)
  assert cfg.path == ''
  data.validate(cfg, data.BYTE_VOCAB_SIZE)
  train, val = data.split_files('', cfg.validation_fraction)
  assert len(val) > 10 and len(train) > 10 * len(val)
  assert not any('site-packages' in p for p in train + val)
  it = iter(data.lm_dataset(cfg, train=True, batch_size=2, seed=0, process_index=1, process_count=4))
  assert next(it)['tokens'].shape == (2, 64)
  it.close()


def make_installed_host(root, extra_package=False) -> list[tuple[str, str]]:
  """A host's installed Python: a standard library (with a __pycache__ and a site-packages of its own, neither read)
  and two site-packages folders, one shadowing a module of the other; installed_roots()'s form."""
  stdlib = {f'mod{i}.py': f'x = {i}\n' for i in range(30)} | {f'json/part{i}.py': f'j = {i}\n' for i in range(10)}
  files = {'stdlib': stdlib,
           'venv/site-packages': {f'pkg{i}/__init__.py': f'p = {i}\n' for i in range(30)} | {'six.py': 'first'},
           'user/site-packages': {'six.py': 'shadowed', 'extra/__init__.py': 'e = 1\n'} if extra_package else
                                 {'six.py': 'shadowed'},
           'stdlib/__pycache__': {'mod0.cpython.py': 'cache'}, 'stdlib/site-packages': {'inner.py': 'not read'}}
  for folder, contents in files.items():
    for name, text in contents.items():
      (root / folder / name).parent.mkdir(parents=True, exist_ok=True)
      (root / folder / name).write_text(text)
  (root / 'stdlib' / 'README.txt').write_text('not python')
  return [('stdlib', str(root / 'stdlib')), ('site-packages', str(root / 'venv' / 'site-packages')),
          ('site-packages', str(root / 'user' / 'site-packages'))]


def installed_split(monkeypatch, roots, fraction=0.3):
  monkeypatch.setattr(data, 'installed_roots', lambda: roots)
  data._list_files.cache_clear()  # pylint: disable=protected-access
  try:
    return data.split_files(data.INSTALLED, fraction)
  finally:
    data._list_files.cache_clear()  # pylint: disable=protected-access


def test_installed_sources_split_by_file_the_same_on_every_host(tmp_path, monkeypatch):
  roots_a = make_installed_host(tmp_path / 'host_a')
  roots_b = make_installed_host(tmp_path / 'elsewhere' / 'host_b', extra_package=True)
  keys = [k for k, _ in data.python_sources(roots_a)]
  assert keys == sorted(keys) and len(keys) == 30 + 10 + 30 + 1  # no cache, no README, no nested site-packages
  assert not any('__pycache__' in k or 'inner' in k for k in keys)
  assert dict(data.python_sources(roots_a))['site-packages/six.py'].endswith(os.path.join('venv', 'site-packages',
                                                                                          'six.py'))
  train, val = installed_split(monkeypatch, roots_a)
  assert len(train) + len(val) == len(keys) and not set(train) & set(val)
  assert 5 <= len(val) <= 40  # about 30% of 71
  assert installed_split(monkeypatch, roots_a) == (train, val)  # deterministic
  # Host B: the same files elsewhere, plus one package. Every shared file falls on the same side, in the same order.
  train_b, val_b = installed_split(monkeypatch, roots_b)
  relative = lambda files, host: [os.path.relpath(f, host) for f in files]
  shared = lambda files: [f for f in files if 'extra' not in f]
  assert shared(relative(train_b, tmp_path / 'elsewhere' / 'host_b')) == relative(train, tmp_path / 'host_a')
  assert shared(relative(val_b, tmp_path / 'elsewhere' / 'host_b')) == relative(val, tmp_path / 'host_a')


def test_installed_batches_read_only_their_split(tmp_path, monkeypatch):
  roots = make_installed_host(tmp_path)
  _, val = installed_split(monkeypatch, roots)
  monkeypatch.setattr(data, 'installed_roots', lambda: roots)
  data._list_files.cache_clear()  # pylint: disable=protected-access
  cfg = lm_data('text', 16, path=data.INSTALLED, validation_fraction=0.3)
  data.validate(cfg, data.BYTE_VOCAB_SIZE)
  seen = take_segments(data.lm_dataset(cfg, train=False, batch_size=4, seed=0), 10)
  data._list_files.cache_clear()  # pylint: disable=protected-access
  texts = {bytes(t - 1 for t in s if t != EOS).decode() for s in seen}
  assert texts == {open(f).read() for f in val}


def test_installed_roots_are_the_stdlib_and_each_site_packages_on_sys_path_once(tmp_path, monkeypatch):
  (tmp_path / 'a' / 'site-packages').mkdir(parents=True)
  (tmp_path / 'b' / 'dist-packages').mkdir(parents=True)
  monkeypatch.setattr('sys.path', [str(tmp_path / 'repo'), str(tmp_path / 'a' / 'site-packages'),
                                   str(tmp_path / 'b' / 'dist-packages'), str(tmp_path / 'a' / 'site-packages'),
                                   str(tmp_path / 'missing' / 'site-packages')])
  roots = data.installed_roots()
  assert roots[0][0] == 'stdlib' and os.path.isdir(roots[0][1])
  assert roots[1:] == [('site-packages', str(tmp_path / 'a' / 'site-packages')),
                       ('site-packages', str(tmp_path / 'b' / 'dist-packages'))]


@pytest.mark.parametrize('name,field,value,message', [
    ('text', 'name', 'foo', "data.name='foo': must be one of c4, corpus, text, synthetic"),
    ('text', 'seq_len', 0, 'data.seq_len=0: must be an integer >= 2'),
    ('text', 'seq_len', 1.5, 'data.seq_len=1.5'),
    ('text', 'path', '/nope/*.txt', "data.path='/nope/*.txt': matches no files"),
    ('text', 'validation_fraction', 1.0, 'data.validation_fraction=1.0'),
    ('text', 'validation_fraction', 0.0, 'data.validation_fraction=0.0'),
    ('text', 'num_workers', -1, 'data.num_workers=-1'),
    ('text', 'prefetch', -2, 'data.prefetch=-2'),
    ('c4', 'vocab_path', '/nope/sp.model', "data.vocab_path='/nope/sp.model'"),
    ('c4', 'vocab_path', '', "data.vocab_path=''"),
    ('corpus', 'path', '', "data.path='': corpus reads the directory that python -m laurel.prepare.text wrote"),
])
def test_validate_names_the_bad_field(name, field, value, message):
  cfg = lm_data(name, 64)
  with cfg.ignore_type():
    setattr(cfg, field, value)
  with pytest.raises(ValueError, match='^' + re.escape(message)) as e:
    data.validate(cfg, 32128)
  assert '\n' not in str(e.value)


def test_validate_vocab_sizes_and_fields(corpus, sp_model, tmp_path):
  with pytest.raises(ValueError, match=r"^model.vocab_size=100: smaller than the tokenizer's 258$"):
    data.validate(lm_data('synthetic', 8), 100)
  cfg = lm_data('c4', 8, vocab_path=data.C4_VOCAB_PATH)
  data.validate(cfg, 32128)  # gs:// is not read here
  cfg.vocab_path = sp_model
  with pytest.raises(ValueError, match=r"^model.vocab_size=39: smaller than the tokenizer's 40$"):
    data.validate(cfg, 39)
  (tmp_path / 'bad.model').write_bytes(b'not a model')
  cfg.vocab_path = str(tmp_path / 'bad.model')
  with pytest.raises(ValueError, match=r"^data.vocab_path='.*bad.model': cannot read a SentencePiece model"):
    data.validate(cfg, 32128)
  (tmp_path / 'one').mkdir()
  (tmp_path / 'one' / 'a.txt').write_text('x')
  with pytest.raises(ValueError, match=r'^data.path=.*matches 1 file'):
    data.validate(text_cfg(tmp_path / 'one'), 258)
  data.validate(text_cfg(corpus), 258)
