"""Damaged data in one line (issue 60): a truncated or foreign ArrayRecord shard, a SentencePiece model that cannot be
read, and a vocabulary smaller than a corpus's characters (laurel.prepare.text, before any shard is written)
each name the file or flag and the fix."""
import re

import pytest

from helpers import call_main
from laurel import data
from laurel.config_lib import InputError
from laurel.prepare import text as prepare_text
from laurel.plan import preflight
from test_data import lm_data


def write_shard(path, documents):
  from array_record.python import array_record_module  # pylint: disable=import-outside-toplevel
  writer = array_record_module.ArrayRecordWriter(str(path), 'group_size:1')
  for document in documents:
    writer.write(document.encode('utf-8'))
  writer.close()


@pytest.mark.parametrize('damage, reason', [
    (lambda whole: whole[:len(whole) // 2], 'RuntimeError'),  # a copy cut short
    (lambda whole: b'', 'RuntimeError: ArrayRecord file should be at least 64KB big'),
    (lambda whole: b'{"text": "not a shard"}\n' * 4000, 'RuntimeError: Corrupted Riegeli/records file'),
], ids=['cut_short', 'empty', 'json_lines'])
def test_an_unreadable_shard_is_one_line_naming_it_and_the_command_that_writes_it(tmp_path, sp_model, damage, reason):
  for split in ('train', 'validation'):
    write_shard(tmp_path / f'corpus-{split}.00000-of-00002.array_record', [f'document {i} ' * 40 for i in range(500)])
    write_shard(tmp_path / f'corpus-{split}.00001-of-00002.array_record', ['another document'])
  bad = tmp_path / 'corpus-validation.00000-of-00002.array_record'
  bad.write_bytes(damage(bad.read_bytes()))
  cfg = lm_data('corpus', 32, path=str(tmp_path), vocab_path=sp_model)
  for read in (lambda: preflight.check_lm_data(cfg),  # before training
               lambda: data.lm_dataset(cfg, train=False, batch_size=2, seed=0)):  # the eval loop, held_out's source
    with pytest.raises(InputError) as refused:
      read()
    message = str(refused.value)
    assert message.startswith(f"data.path='{tmp_path}': shard {bad.name} is not a readable ArrayRecord file "
                              f'({reason}') and message.endswith(
        '); remove it and rerun python -m laurel.prepare.text with the arguments that wrote it: it writes the missing '
        'shards again') and '\n' not in message


def test_a_sentencepiece_model_that_cannot_be_read_names_it_and_the_fix(tmp_path):
  (tmp_path / 'vocab.model').write_bytes(b'\x0a\x05cut sh')  # a model cut short
  cfg = lm_data('corpus', 32, path=str(tmp_path), vocab_path=str(tmp_path / 'vocab.model'))
  with pytest.raises(InputError) as refused:
    data.make_tokenizer(cfg)  # what sampling, scoring, training and the checks before them read
  assert str(refused.value).startswith(f"data.vocab_path='{tmp_path / 'vocab.model'}': cannot read a SentencePiece "
                                       'model: RuntimeError: ')
  assert str(refused.value).endswith('; point it at a model SentencePiece wrote (python -m laurel.prepare.text writes '
                                     'vocab.model: rerun it for a damaged one)')
  corpus = tmp_path / 'corpus.txt'
  corpus.write_text('some text\n')
  status, out, err = call_main(prepare_text.main, f'--input={corpus}', f'--output={tmp_path / "out"}',
                               f'--vocab_path={tmp_path / "vocab.model"}')
  assert (status, out) == (2, '') and re.fullmatch(
      r"error: --vocab_path='.+vocab\.model': cannot read a SentencePiece model \(RuntimeError: .+\); give a \.model "
      r'file SentencePiece wrote, or leave --vocab_path out to train one on the corpus\n', err), err
  assert not (tmp_path / 'out').exists()  # nothing written


def test_a_vocabulary_below_the_corpus_characters_is_refused_before_any_shard_is_written(tmp_path):
  """125 CJK characters, a, b and the space (as ▁): SentencePiece needs 128 + 259 pieces (byte fallback's and the
  special ones), and said so in a traceback after the shards were written; the count here is SentencePiece's."""
  characters = [chr(0x4e00 + i) for i in range(125)]
  lines = [''.join(characters[(7 * i + j) % 125] for j in range(60)) + ' ab' for i in range(200)]
  (tmp_path / 'corpus.txt').write_text('\n'.join(lines) + '\n')
  out = tmp_path / 'out'
  assert call_main(prepare_text.main, f'--input={tmp_path / "corpus.txt"}', f'--output={out}', '--vocab_size=300',
                   '--workers=1') == (2, '', (
      'error: --vocab_size=300: below the 387 pieces this corpus needs (128 characters cover 99.95% of 1 document of '
      '--input, and the special and byte pieces take 259): set --vocab_size=387 or more, or --vocab_path=an existing '
      'model\n'))
  assert not out.exists()
  with pytest.raises(InputError, match=r'^--vocab_size=386: below the 387 pieces this corpus needs \(128 characters '
                     r'cover 99\.95% of the sample, '):  # SentencePiece's own count, one line too
    prepare_text.sentencepiece_model(iter(lines), 386, 'unigram', 'the sample')
  assert prepare_text.sentencepiece_model(iter(lines), 387, 'unigram', 'the sample')
