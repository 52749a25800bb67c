"""C4 without Beam: laurel.prepare.c4 on generated .json.gz shards (local and gs://), the loader on its shards and
on prepared TFDS directories of either version, the checks that name what is missing, and training on it; your own
corpus through laurel.prepare.text, to the training command it prints."""
import gzip
import json
import os
import pickle
import re
import shutil
import subprocess
import sys

import grain
import numpy as np
import pytest

from helpers import ROOT, TINY_LM, call_main, fake_gcs_env, train_cli, without_this_python
from laurel import config_lib, data, main
from laurel.prepare import c4 as prepare_c4, text as prepare_text
from laurel.plan import preflight
from laurel.cli import console
from test_data import lm_data, segments

SPLITS = {'train': ['c4-train.00000-of-01024.json.gz', 'c4-train.00001-of-01024.json.gz',
                    'c4-train.00002-of-01024.json.gz'],
          'validation': ['c4-validation.00000-of-00008.json.gz']}


def _documents(rng, n):
  return [' '.join(''.join(rng.choice(list('abcdefghij'), size=rng.integers(1, 8))) for _ in range(rng.integers(3, 60)))
          for _ in range(n)]


@pytest.fixture(scope='module')
def c4_json(tmp_path_factory):
  """C4's release layout in miniature: {file name: its documents}, the files in one folder (and a stray file)."""
  root, rng, texts = tmp_path_factory.mktemp('c4_json'), np.random.default_rng(0), {}
  for names in SPLITS.values():
    for name in names:
      texts[name] = _documents(rng, 40)
      with gzip.open(root / name, 'wt', encoding='utf-8') as f:
        for i, text in enumerate(texts[name]):
          f.write(json.dumps({'text': text, 'timestamp': '2019-04-25T12:00:00Z', 'url': f'https://x/{i}'}) + '\n')
  (root / 'README.md').write_text('not a shard')
  return root, texts


def prepare(*args):
  return call_main(prepare_c4.main, *args)


def read_shard(path) -> list[str]:
  source = grain.sources.ArrayRecordDataSource([str(path)])
  return [source[i].decode('utf-8') for i in range(len(source))]


@pytest.fixture(scope='module')
def c4_shards(c4_json, tmp_path_factory):
  out = tmp_path_factory.mktemp('c4_shards')
  status, _, err = prepare(f'--input={c4_json[0]}', f'--output={out}', '--workers=2')  # 2 processes
  assert status == 0, err[-3000:]
  return out


@pytest.mark.slow
def test_prepare_c4_converts_every_document_and_resumes(c4_json, c4_shards):
  root, texts = c4_json
  for name, docs in texts.items():
    assert read_shard(c4_shards / name.replace('.json.gz', '.array_record')) == docs
  assert sorted(p.name for p in c4_shards.iterdir()) == sorted(n.replace('.json.gz', '.array_record') for n in texts)

  # Interrupted: one shard missing, a partial file beside it. Only that one is converted again.
  resumed = c4_shards.parent / 'resumed'
  shutil.copytree(c4_shards, resumed)
  (resumed / 'c4-train.00001-of-01024.array_record').unlink()
  (resumed / 'c4-train.00001-of-01024.array_record.incomplete').write_bytes(b'partial')
  status, out, err = prepare(f'--input={root}', f'--output={resumed}', '--workers=2')
  assert status == 0, err[-3000:]
  assert '3 of 4 shards already' in out and 'converting 1 with 1 worker' in out
  assert read_shard(resumed / 'c4-train.00001-of-01024.array_record') == texts['c4-train.00001-of-01024.json.gz']
  assert not list(resumed.glob('*.incomplete'))

  status, _, err = prepare(f'--input={root}', f'--output={root.parent / "x"}', '--splits=test')
  assert status == 2 and err.count('\n') == 1
  assert err.startswith(f"error: --input='{root}': no c4-<split>.NNNNN-of-MMMMM.json.gz files of the splits test")


@pytest.mark.slow
def test_prepare_c4_reads_and_writes_gs_paths(c4_json, tmp_path):
  """A subprocess: the fake gs:// (tests/fake_gcs) is a process's."""
  root, texts = c4_json
  shutil.copytree(root, tmp_path / 'bucket' / 'raw')
  r = subprocess.run([sys.executable, '-m', 'laurel.prepare.c4', '--input=gs://bucket/raw', '--output=gs://bucket/c4',
                      '--splits=validation', '--workers=1'], cwd=ROOT, capture_output=True, text=True, timeout=300,
                     env=fake_gcs_env(tmp_path))
  assert r.returncode == 0, r.stderr[-3000:]
  name = SPLITS['validation'][0]
  assert read_shard(tmp_path / 'bucket' / 'c4' / name.replace('.json.gz', '.array_record')) == texts[name]


@pytest.mark.slow
def test_c4_shards_train_end_to_end(c4_shards, sp_model, tmp_path, capsys):
  status, _, err = train_cli(capsys, 'configs/c4_ablation.py:rw_lr,preset=tiny', tmp_path, {
      **TINY_LM, 'data.name': 'c4', 'data.path': c4_shards, 'data.vocab_path': sp_model, 'steps': 3})
  assert status == 0, err[-3000:]
  final = json.loads((tmp_path / 'final.json').read_text())
  assert 0 < final['eval_loss'] < np.log(264) + 1


@pytest.mark.slow
def test_c4_shards_batches_hold_the_documents(c4_json, c4_shards, sp_model):
  cfg = lm_data('c4', 32, path=str(c4_shards), vocab_path=sp_model)
  preflight.check_lm_data(cfg)
  tokenizer = data.make_tokenizer(cfg)
  assert (tokenizer.vocab_size, tokenizer.pad_id, tokenizer.eos_id) == (40, 0, 1)
  assert pickle.loads(pickle.dumps(tokenizer)).encode('abc def') == tokenizer.encode('abc def')
  for train, split in ((True, 'train'), (False, 'validation')):
    chunks = set()
    for name in SPLITS[split]:
      for text in c4_json[1][name]:
        tokens = tuple(int(t) for t in tokenizer.document(text))
        chunks.update(tokens[i:i + 32] for i in range(0, len(tokens), 32))
    it = iter(data.lm_dataset(cfg, train=train, batch_size=2, seed=0))
    seen = {s for _ in range(5) for s in segments(next(it))}
    it.close()
    assert seen and seen <= chunks


def _tfds_c4(data_dir, version: str, texts: dict):
  """A prepared TFDS c4/en of `version` in ArrayRecord files, built from `texts` ({split: documents})."""
  import tensorflow_datasets as tfds  # pylint: disable=import-outside-toplevel

  with tfds.core.registered.skip_registration():  # the real C4 builder is registered as 'c4'
    class C4(tfds.core.GeneratorBasedBuilder):
      VERSION = tfds.core.Version(version)
      BUILDER_CONFIGS = [tfds.core.BuilderConfig(name='en')]

      def _info(self):
        return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict(
            {'text': tfds.features.Text(), 'url': tfds.features.Text()}))

      def _split_generators(self, dl_manager):
        return {split: self._generate_examples(docs) for split, docs in texts.items()}

      def _generate_examples(self, docs):  # pylint: disable=arguments-differ
        for i, text in enumerate(docs):
          yield i, {'text': text, 'url': f'https://x/{i}'}

    C4(data_dir=str(data_dir), file_format='array_record').download_and_prepare()
  return data_dir / 'c4' / 'en' / version


@pytest.fixture(scope='module')
def tfds_dirs(tmp_path_factory):
  rng, root = np.random.default_rng(1), tmp_path_factory.mktemp('tfds')
  texts = {v: {'train': _documents(rng, 30), 'validation': _documents(rng, 10)} for v in ('3.0.1', '3.1.0')}
  for version, splits in texts.items():
    _tfds_c4(root / 'both', version, splits)
  _tfds_c4(root / 'old', '3.0.1', texts['3.0.1'])
  return root, texts


@pytest.mark.parametrize('data_dir, name, version', [('both', 'c4/en', '3.1.0'), ('both', 'c4/en:3.0.1', '3.0.1'),
                                                      ('old', 'c4/en', '3.0.1')])
def test_tfds_c4_is_read_at_the_version_found(tfds_dirs, sp_model, data_dir, name, version):
  root, texts = tfds_dirs
  cfg = lm_data('c4', 32, tfds_data_dir=str(root / data_dir), tfds_name=name, vocab_path=sp_model)
  preflight.check_lm_data(cfg)
  assert data.tfds_version_dir(cfg.tfds_data_dir, name).name == version
  for train, split in ((True, 'train'), (False, 'validation')):
    records = data._source(config_lib.build(data.LMDataConfig, cfg, 'data'), train)  # pylint: disable=protected-access
    assert sorted(r['text'].decode() for r in records) == sorted(texts[version][split])
    it = iter(data.lm_dataset(cfg, train=train, batch_size=2, seed=0))
    assert next(it)['tokens'].shape == (2, 32)
    it.close()


def test_missing_or_unusable_c4_is_one_line_naming_the_fix(tfds_dirs, sp_model, tmp_path):
  root, _ = tfds_dirs
  (tmp_path / 'empty').mkdir()
  tfrecord = tmp_path / 'tfrecord' / 'c4' / 'en' / '3.0.1'
  shutil.copytree(root / 'old' / 'c4' / 'en' / '3.0.1', tfrecord)
  info = json.loads((tfrecord / 'dataset_info.json').read_text())
  (tfrecord / 'dataset_info.json').write_text(json.dumps({**info, 'fileFormat': 'tfrecord'}))
  cases = [
      (dict(path=str(tmp_path / 'empty')), f"data.path='{tmp_path / 'empty'}': no c4-train.*.array_record shards; "
       f"write them with {console.python_command()} -m laurel.prepare.c4 --input=<folder of C4's c4-*.json.gz> "
       f"--output={tmp_path / 'empty'}"),
      (dict(tfds_data_dir=str(tmp_path / 'empty')), f"data.tfds_data_dir='{tmp_path / 'empty'}': no prepared c4/en "
       f'in {tmp_path / "empty"}; convert C4 with {console.python_command()} -m laurel.prepare.c4'),
      (dict(tfds_data_dir=str(root / 'both'), tfds_name='c4/en:2.2.0'), 'no prepared c4/en:2.2.0'),
      (dict(tfds_data_dir=str(tmp_path / 'tfrecord')), f'{tfrecord} holds tfrecord files, and random access needs '
       f'ArrayRecord: tfds convert_format --dataset_version_dir={tfrecord} --out_file_format=array_record'),
      (dict(tfds_data_dir=str(root / 'old'), eval_split='test'), "has no split 'test' (it has: train, validation)"),
      (dict(tfds_data_dir=str(root / 'old'), vocab_path=str(tmp_path / 'empty' / 'sp.model')),
       f"data.vocab_path='{tmp_path / 'empty' / 'sp.model'}': cannot read a SentencePiece model"),
  ]
  cases.append((dict(name='corpus', path=str(tmp_path / 'empty')),
                f"data.path='{tmp_path / 'empty'}': no corpus-train.*.array_record shards; write them with "
                f"{console.python_command()} -m laurel.prepare.text --input='<your *.jsonl.gz, *.json or *.txt "
                f"files>' --output={tmp_path / 'empty'}"))
  for fields, message in cases:
    with pytest.raises(ValueError, match=re.escape(message)) as e:
      preflight.check_lm_data(lm_data(fields.pop('name', 'c4'), 32, **{'vocab_path': sp_model, **fields}))
    assert '\n' not in str(e.value) and re.match(r"data\.\w+='", str(e.value)), str(e.value)


@pytest.mark.slow
def test_own_corpus_from_json_jsonl_gz_and_text_files_to_a_training_run(tmp_path, monkeypatch):
  """laurel.prepare.text: every document of JSON lines (gzipped), a JSON array and text files lands once in the
  shards, a vocabulary with the loader's ids is trained, and the closing command trains on them as printed."""
  rng, docs = np.random.default_rng(1), {}
  corpus = tmp_path / 'corpus'
  (corpus / 'notes').mkdir(parents=True)
  docs['lines'] = _documents(rng, 150)
  with gzip.open(corpus / 'a.jsonl.gz', 'wt', encoding='utf-8') as f:
    f.writelines(json.dumps({'text': t, 'id': i}) + '\n' for i, t in enumerate(docs['lines']))
  docs['array'] = _documents(rng, 60)
  (corpus / 'b.json').write_text(json.dumps([{'text': t} for t in docs['array'][:-1]] + [docs['array'][-1]]))
  docs['text'] = [t + '\n    indented\n' for t in _documents(rng, 5)]
  for i, text in enumerate(docs['text']):
    (corpus / 'notes' / f'{i}.txt').write_text(text)
  out = tmp_path / 'prepared'
  args = [f'--input={corpus}/*.json*', f'--input={corpus}/notes/*.txt', f'--output={out}', '--vocab_size=320',
          '--validation_fraction=0.1', '--workers=2']
  with monkeypatch.context() as shell:  # a shell in another folder, the venv not activated
    shell.setenv('PATH', without_this_python(os.environ['PATH']))
    shell.chdir(tmp_path)
    status, stdout, err = call_main(prepare_text.main, *args)
  assert status == 0, err[-3000:]
  shards = {split: sorted(out.glob(f'corpus-{split}.*.array_record')) for split in ('train', 'validation')}
  assert [len(s) for s in shards.values()] == [7, 7]  # one per input file
  written = {split: [t for p in paths for t in read_shard(p)] for split, paths in shards.items()}
  assert sorted(written['train'] + written['validation']) == sorted(t for ts in docs.values() for t in ts)
  assert 0 < len(written['validation']) < len(written['train'])
  import sentencepiece  # pylint: disable=import-outside-toplevel
  vocab = sentencepiece.SentencePieceProcessor(model_file=str(out / 'vocab.model'))
  assert (vocab.pad_id(), vocab.eos_id(), vocab.unk_id(), vocab.bos_id()) == (0, 1, 2, -1)
  assert vocab.decode(vocab.encode(docs['text'][0])) == docs['text'][0]  # byte fallback, whitespace as written

  command = stdout.strip().splitlines()[-1].split()
  assert command[:4] == [sys.executable, '-m', 'laurel.main', '--config=c4_ablation:rw_lr,preset=small'], stdout
  flags = dict(a.split('=', 1) for a in command[4:])
  vocab_size = int(flags.pop('--config.model.vocab_size'))
  assert flags == {'--workdir': 'runs/prepared', '--config.data.name': 'corpus', '--config.data.path': str(out),
                   '--config.data.vocab_path': str(out / 'vocab.model')}
  assert vocab_size % 128 == 0 and vocab_size >= vocab.get_piece_size()
  tiny = {k: v for k, v in TINY_LM.items() if k != 'data.name'}
  monkeypatch.chdir(tmp_path)  # as printed: laurel-train's main from the shell's folder
  status, _, err = call_main(main.main, *command[3:], *[f'--config.{k}={v}' for k, v in tiny.items()])
  assert status == 0, err[-3000:]
  assert 0 < json.loads((tmp_path / 'runs' / 'prepared' / 'final.json').read_text())['eval_loss'] < 10

  status, stdout, err = call_main(prepare_text.main, *args)  # resumes: all there
  assert status == 0 and '7 already there; writing 0' in stdout, err[-3000:]
  assert call_main(prepare_text.main, *args[:-2], '--validation_fraction=0.2') == (2, '', (
      f"error: --output='{out}': was prepared with validation_fraction=0.1 (now 0.2); use another --output\n"))


def test_prepare_text_after_a_failed_attempt_the_corrected_command_reuses_the_output(tmp_path, sp_model):
  """Two text files of 40 lines: one document per file puts none in validation (refused); the retry with one per line
  writes into the same --output, without the first attempt's shards. A finished output is still never overwritten."""
  corpus, out = tmp_path / 'corpus', tmp_path / 'mine'
  corpus.mkdir()
  lines = {name: [f'{name} says {i}' for i in range(40)] for name in ('a.txt', 'b.txt')}
  for name, text in lines.items():
    (corpus / name).write_text('\n'.join(text) + '\n')
  assert min(data._unit_hash(f'{name}:0') for name in lines) > 0.1  # pylint: disable=protected-access  # all train
  args = [f'--input={corpus}/*.txt', f'--output={out}', f'--vocab_path={sp_model}', '--validation_fraction=0.1',
          '--workers=1']
  run = lambda *extra: call_main(prepare_text.main, *args, *extra)
  status, _, err = run('--num_shards=2')
  assert status == 2 and 'no document went to the validation split' in err, err
  status, _, err = run('--text_unit=line', '--num_shards=1')  # the first attempt's two shards are removed
  assert status == 0, err[-3000:]
  shards = sorted(p.name for p in out.glob('*.array_record'))
  assert shards == ['corpus-train.00000-of-00001.array_record', 'corpus-validation.00000-of-00001.array_record']
  written = [t for name in shards for t in read_shard(out / name)]
  assert sorted(written) == sorted(t for text in lines.values() for t in text)
  status, _, err = run('--text_unit=file')
  assert status == 2 and err.endswith('use another --output\n'), err
  assert sorted(p.name for p in out.glob('*.array_record')) == shards
