"""laurel.cli.files: a write interrupted half-way leaves the old file whole and no temporary behind."""
import errno
import os
import tempfile

import pytest

from laurel.cli import files


def test_write_text_atomic_replaces_the_file(tmp_path):
  path = tmp_path / 'config.json'
  path.write_text('old')
  files.write_text_atomic(path, 'new')
  assert path.read_text() == 'new'
  assert os.listdir(tmp_path) == ['config.json']


def test_an_interrupted_write_keeps_the_old_content(tmp_path, monkeypatch):
  path = tmp_path / 'final.json'
  path.write_text('{"good": 1}')

  def killed(fd):  # the kill arrives after part of the new text is written, before the rename
    raise KeyboardInterrupt

  monkeypatch.setattr(os, 'fsync', killed)
  with pytest.raises(KeyboardInterrupt):
    files.write_text_atomic(path, '{"torn": ')
  assert path.read_text() == '{"good": 1}'
  assert os.listdir(tmp_path) == ['final.json']


def test_the_temporaries_of_writes_a_kill_cut_short_are_removed(tmp_path):
  left = os.path.basename(tempfile.mkstemp(prefix='.config.json.', suffix='.tmp', dir=tmp_path)[1])  # as a kill leaves
  (tmp_path / '.other.json.x.tmp').write_text('')  # another file's: not named, kept
  files.write_text_atomic(tmp_path / 'final.json', '{}')
  assert files.remove_temporaries(tmp_path, ['config.json', 'final.json']) == [left]
  assert sorted(os.listdir(tmp_path)) == ['.other.json.x.tmp', 'final.json']


def test_a_refused_write_is_named_by_its_cause_and_path():
  assert files.why(OSError(errno.ENOSPC, 'No space left on device', '/runs/a/final.json')) == (
      'ENOSPC (No space left on device): /runs/a/final.json')
  assert files.storage_error(OSError(errno.EROFS, 'Read-only file system'))
  assert not files.storage_error(OSError(errno.EPERM, 'Operation not permitted'))  # e.g. no hard links
