"""Saves by orbax (issue 58): every committed checkpoint carries its checksum list (written in orbax's
post-finalization callback, before the commit), a byte flipped in any file of the newest checkpoint is never restored
silently, a checkpoint is good or damaged and a damaged one is moved aside for the one before, and a failed save stops
the run by its next save in one line, deleting no good checkpoint."""
import json
import os
import shutil
import threading
import time

import jax
import pytest
from etils import epath
from orbax.checkpoint._src.checkpointers import async_checkpointer
from orbax.checkpoint._src.metadata import checkpoint as metadata_checkpoint

from helpers import TINY_LM, checkpoint_steps, load_config, losses, train_cli
from laurel import train
from laurel.cli import process
from laurel.run import checkpoint
from laurel.serve import loader

SPEC = 'configs/c4_ablation.py:rw_lr,preset=tiny'
RUN = {**TINY_LM, 'checkpoint_every': 3}  # checkpoints 3 and 6
RERUN = {**RUN, 'steps': 7}
# How tensorstore reports a write to a full disk (orbax raises it from its background save).
ENOSPC = ValueError('RESOURCE_EXHAUSTED: Error writing "params.embed/0" in OCDBT database: Failed writing: "d/7f64": '
                    "Failed to write 17313 bytes to file 4: No space left on device [os_error_code='28']")


@pytest.fixture(scope='module')
def saved_run(tmp_path_factory):
  """A run of 6 steps with checkpoints 3 and 6, and its losses; orbax's background writes of step metadata slowed, as
  a busy host's can be, so that a list written before the last of them lands would not match."""
  workdir = tmp_path_factory.mktemp('saved') / 'run'
  store = metadata_checkpoint._MetadataStoreImpl  # pylint: disable=protected-access
  update = store.update

  def slow_update(*args, **kwargs):
    time.sleep(0.2)
    return update(*args, **kwargs)

  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(store, 'update', slow_update)
    train.train(load_config(SPEC, RUN), str(workdir), devices=jax.devices()[:1])
  return workdir, losses(workdir)


def _copy(saved_run, tmp_path):
  workdir = tmp_path / 'run'
  shutil.copytree(saved_run[0], workdir)
  return workdir


def _flip(path, at=None) -> None:
  data = bytearray(path.read_bytes())
  data[len(data) // 2 if at is None else at] ^= 0x01
  path.write_bytes(bytes(data))


def test_every_committed_checkpoint_is_vouched_for_and_a_flipped_byte_in_any_of_its_files_is_found(saved_run, tmp_path):
  """Every file of the newest checkpoint, the input iterator's state and orbax's own metadata among them, each with one
  byte flipped in its middle: the checkpoint is damaged."""
  for number in (3, 6):
    assert checkpoint.damage(saved_run[0] / 'checkpoints' / str(number)) is None
  newest = saved_run[0] / 'checkpoints' / '6'
  names = sorted(os.fspath(p.relative_to(newest)) for p in newest.rglob('*') if p.is_file())
  assert {checkpoint.LIST, 'data/process_0-of-1.json', 'config/metadata', checkpoint.METADATA,
          checkpoint.COMMITTED, 'state/manifest.ocdbt'} <= set(names)
  for name in names:
    step_dir = tmp_path / name.replace('/', '_')
    shutil.copytree(newest, step_dir)
    _flip(step_dir / name)
    assert checkpoint.damage(step_dir) is not None, name


@pytest.mark.slow
def test_a_flipped_byte_in_the_input_iterators_state_is_set_aside_for_the_checkpoint_before(saved_run, tmp_path,
                                                                                            capsys):
  """An edited iterator state (still valid JSON) would resume on other batches: the run resumes from 3 instead, and
  the steps after it come again with the losses of the run that was never damaged."""
  workdir = _copy(saved_run, tmp_path)
  iterator = workdir / 'checkpoints' / '6' / 'data' / 'process_0-of-1.json'
  text = iterator.read_text()
  digit = next(i for i, c in enumerate(text) if c.isdigit() and c != '9')
  iterator.write_text(text[:digit] + str(int(text[digit]) + 1) + text[digit + 1:])
  json.loads(iterator.read_text())
  train.train(load_config(SPEC, RUN), str(workdir), devices=jax.devices()[:1])
  out = capsys.readouterr()
  assert ('warning: checkpoint 6 is damaged (data/process_0-of-1.json: content checksum mismatch (xxh3_64 '
          in out.err) and 'resumed from checkpoint 3' in out.out
  assert [p.name.split('.')[0] for p in (workdir / 'unreadable_checkpoints').iterdir()] == ['6']
  assert losses(workdir) == saved_run[1]
  rows = [json.loads(l) for l in (workdir / 'metrics.jsonl').read_text().splitlines()]
  assert [r['step'] for r in rows if 'loss' in r] == [1, 2, 3, 4, 5, 6]  # no step twice
  assert rows[3]['step'] == 4 and rows[3]['moved_aside'] == [6]


@pytest.mark.parametrize('content', [None, b'[]', b'{"algorithm": "xxh3_64"}', bytes(range(128, 256)),
                                     b'{"algorithm": "md5", "files": {}}'])
def test_a_checkpoint_without_a_readable_list_is_damaged(saved_run, tmp_path, content):
  step_dir = tmp_path / '6'
  shutil.copytree(saved_run[0] / 'checkpoints' / '6', step_dir)
  if content is None:
    (step_dir / checkpoint.LIST).unlink()
  else:
    (step_dir / checkpoint.LIST).write_bytes(content)
  why = checkpoint.damage(step_dir)
  assert why in ('it has no checksums.json', ) or why.startswith('its checksums.json is no checksum list (')


def test_an_earlier_runs_lists_still_vouch_for_its_train_state(saved_run, tmp_path):
  """Code before this one wrote a list a host, of the train state's files alone (checksums.process_<i>.json)."""
  step_dir = tmp_path / '6'
  shutil.copytree(saved_run[0] / 'checkpoints' / '6', step_dir)
  listed = json.loads((step_dir / checkpoint.LIST).read_text())['files']
  (step_dir / checkpoint.LIST).unlink()
  state = {name: entry for name, entry in listed.items() if name.startswith('state/')}
  (step_dir / 'checksums.process_0.json').write_text(json.dumps({'algorithm': 'xxh3_64', 'files': state}))
  assert checkpoint.damage(step_dir) is None
  _flip(max(step_dir.glob('state/ocdbt.process_0/d/*'), key=lambda p: p.stat().st_size))
  assert 'content checksum mismatch' in checkpoint.damage(step_dir)


def _full_disk_at(step: int):
  """orbax's background wait for a save's writes, where the writes of checkpoint `step` fail as on a full disk."""
  wait = async_checkpointer._background_wait_for_commit_futures  # pylint: disable=protected-access

  def fail_at_step(directory, commit_futures, on_commit_callback, **kwargs):
    if epath.Path(directory).name != str(step):
      return wait(directory, commit_futures, on_commit_callback, **kwargs)
    wait(directory, commit_futures, lambda: None, **kwargs)  # the writes end, the checkpoint is never committed
    raise ENOSPC
  return fail_at_step


@pytest.mark.slow
def test_a_failed_save_stops_the_run_in_one_line_and_deletes_no_good_checkpoint(tmp_path, monkeypatch, capsys):
  """Checkpoint 4's writes fail, and orbax's finalize thread takes its time: the error is there at step 5's check, the
  thread has not seen it. Had the run taken it first, the thread would finish save 4 as good and its preservation
  policy (keep_checkpoints=1) delete checkpoint 2, the last good one."""
  monkeypatch.setattr(async_checkpointer, '_background_wait_for_commit_futures', _full_disk_at(4))
  checked, save = threading.Event(), checkpoint.save
  after_step, finalize = train.Checkpointing.after_step, checkpoint.Manager._finalize  # pylint: disable=protected-access

  def save_then_let_it_fail(mngr, number, *args):
    save(mngr, number, *args)
    for thread in threading.enumerate() if number == 4 else ():
      if thread.name == 'async_save':
        thread.join()

  def after_step_then_tell(action, run, step, metrics):
    try:
      after_step(action, run, step, metrics)
    finally:
      if step >= 5:
        checked.set()

  def finalize_after_the_check(mngr, step, *args):
    checked.wait(60 if step == 4 else 0)
    return finalize(mngr, step, *args)

  monkeypatch.setattr(checkpoint, 'save', save_then_let_it_fail)
  monkeypatch.setattr(train.Checkpointing, 'after_step', after_step_then_tell)
  monkeypatch.setattr(checkpoint.Manager, '_finalize', finalize_after_the_check)
  workdir = tmp_path / 'run'
  status, _, err = train_cli(capsys, SPEC, workdir, {**RUN, 'steps': 9, 'checkpoint_every': 2, 'keep_checkpoints': 1})
  assert status == process.ERROR and err.splitlines() == [
      f'error: checkpoint 4 could not be saved (No space left on device); last good checkpoint: 2 in '
      f'{workdir / "checkpoints"}'], err[-3000:]
  assert max(losses(workdir)) <= 6 and checkpoint_steps(workdir) == {2}  # stopped by its next save at the latest


@pytest.mark.slow
def test_inference_refuses_a_damaged_checkpoint_in_one_line(saved_run, tmp_path):
  workdir = _copy(saved_run, tmp_path)
  _flip(workdir / 'checkpoints' / '6' / 'config' / 'metadata')
  with pytest.raises(ValueError, match=r"checkpoint 6 is damaged \(config/metadata: content checksum mismatch"):
    with loader.lm_run_on_mesh(workdir):  # what generate and evaluate read
      pass
