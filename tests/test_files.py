"""laurel.files: a write interrupted half-way leaves the old file whole and no temporary behind."""
import os

import pytest

from laurel import files


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
