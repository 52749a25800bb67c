"""Saves (issue 54 items 3-5): a checkpoint's checksum list is written as soon as its save completes, a rerun
restores a checkpoint no list vouches for only where no verified one exists, a damaged list is one line and sets no
intact data aside, and a failed save stops the run at once; a disk without room for a checkpoint stops a rerun."""
import json
import logging
import os
import shutil
import subprocess
import sys
import time
import types

import pytest
from etils import epath
from orbax.checkpoint._src.checkpointers import async_checkpointer

from helpers import ROOT, TINY_LM, checkpoint_steps, cli_env, load_config, losses
from laurel import config_lib, train
from laurel.run import checkpoint, checksums, process
from laurel.serve import loader

SPEC = 'configs/c4_ablation.py:rw_lr,preset=tiny'
RUN = {**TINY_LM, 'checkpoint_every': 3}  # checkpoints 3 and 6
RERUN = {**RUN, 'steps': 7}
# How tensorstore reports a write to a full disk (orbax raises it from its background save).
ENOSPC = ValueError('RESOURCE_EXHAUSTED: Error writing "params.embed/0" in OCDBT database: Failed writing: "d/7f64": '
                    "Failed to write 17313 bytes to file 4: No space left on device [os_error_code='28']")


class Crash(Exception):
  """Ends the train loop where a kill would, before any of its exit path."""


@pytest.fixture(scope='module')
def crashed_run(tmp_path_factory):
  """A run of 6 steps that crashed right after checkpoint 6 was saved, and whether 6 had its checksum list then (the
  crash waits up to 30 s for it)."""
  workdir = tmp_path_factory.mktemp('crashed') / 'run'
  listing = workdir / 'checkpoints' / '6' / checksums.LISTING.format(0)
  beat, listed = process.Watchdog.beat, []

  def crash_after_the_last_save(watchdog, step=None):
    beat(watchdog, step)
    if step == 6:  # the train loop's last call before its exit path
      deadline = time.monotonic() + 30
      while not listing.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
      listed.append(listing.exists())
      raise Crash

  with pytest.MonkeyPatch.context() as patch, pytest.raises(Crash):
    patch.setattr(process.Watchdog, 'beat', crash_after_the_last_save)
    train.train(load_config(SPEC, RUN), str(workdir))
  return workdir, listed


def _copy(crashed_run, tmp_path):
  workdir = tmp_path / 'run'
  shutil.copytree(crashed_run[0], workdir)
  return workdir


@pytest.mark.slow
def test_a_crash_right_after_a_save_leaves_its_checksum_list(crashed_run):
  assert crashed_run[1] == [True]
  for step in (3, 6):
    assert checksums.verify(crashed_run[0] / 'checkpoints' / str(step)) == ('verified', None)


@pytest.mark.slow
def test_a_flipped_bit_in_the_newest_checkpoint_is_set_aside(crashed_run, tmp_path, capsys):
  workdir = _copy(crashed_run, tmp_path)
  array_file = max((workdir / 'checkpoints' / '6' / 'state').rglob('d/*'), key=lambda p: p.stat().st_size)
  data = bytearray(array_file.read_bytes())
  data[len(data) // 2] ^= 0x01
  array_file.write_bytes(bytes(data))
  train.train(load_config(SPEC, RERUN), str(workdir))
  out = capsys.readouterr()
  assert 'checkpoint 6 is unreadable (state/' in out.err and 'content checksum mismatch' in out.err
  assert 'resumed from checkpoint 3' in out.out and checkpoint.quarantined_steps(workdir) == [6]


@pytest.mark.slow
@pytest.mark.parametrize('removed, resumed', [
    ([checksums.LISTING.format(0)], 3),  # its run writes lists: unvouched, and 3 is verified
    ([checksums.LISTING.format(0), 'checksummed'], 6),  # written by a run without lists: taken as it is
])
def test_a_newest_checkpoint_without_a_list_is_restored_only_if_its_run_wrote_none(crashed_run, tmp_path, capsys,
                                                                                   removed, resumed):
  workdir = _copy(crashed_run, tmp_path)
  for name in removed:
    path = workdir / 'checkpoints' / '6' / name
    shutil.rmtree(path) if path.is_dir() else path.unlink()
  train.train(load_config(SPEC, RERUN), str(workdir))
  out = capsys.readouterr()
  assert f'resumed from checkpoint {resumed}' in out.out
  if resumed == 3:
    assert ('warning: checkpoint 6 has no checksum list that vouches for it (no checksums.process_0.json) and '
            'checkpoint 3 is verified; moved to') in out.err
    assert checkpoint.quarantined_steps(workdir) == [6]
  else:
    assert not (workdir / 'unreadable_checkpoints').exists()


DAMAGED_LISTS = {
    'random bytes': bytes(range(128, 256)),
    'a list': b'[]',
    'no files': b'{"algorithm": "xxh3_64"}',
    'cut': b'{"algorithm": "xxh3_64", "files": {"state/d/a": ["1f',
    'a bad entry': b'{"algorithm": "xxh3_64", "files": {"state/d/a": 5}}',
    'an unknown algorithm': b'{"algorithm": "md5", "files": {"state/d/a": ["1f", 3]}}',
}


@pytest.mark.parametrize('name', [*DAMAGED_LISTS, 'a folder'])
def test_a_damaged_list_is_one_phrase(tmp_path, name):
  if name == 'a folder':
    (tmp_path / checksums.LISTING.format(0)).mkdir()
  else:
    (tmp_path / checksums.LISTING.format(0)).write_bytes(DAMAGED_LISTS[name])
  why = checksums.verify(tmp_path)[1]  # the phrase the restore and the inference loader name
  assert why.startswith('checksums.process_0.json is ') and '\n' not in why
  assert checksums.verify(tmp_path) == ('unreadable', why)


@pytest.mark.slow
def test_damaged_lists_set_no_intact_checkpoint_aside(crashed_run, tmp_path, capsys):
  workdir = _copy(crashed_run, tmp_path)
  for step, name in ((3, 'a list'), (6, 'random bytes')):
    (workdir / 'checkpoints' / str(step) / checksums.LISTING.format(0)).write_bytes(DAMAGED_LISTS[name])
  train.train(load_config(SPEC, RERUN), str(workdir))
  out = capsys.readouterr()
  assert ('warning: checkpoint 6 is restored unchecked: checksums.process_0.json is unreadable (UnicodeDecodeError: '
          in out.err)
  assert 'resumed from checkpoint 6' in out.out and not (workdir / 'unreadable_checkpoints').exists()


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
def test_a_failed_save_stops_the_run_before_the_next_save(tmp_path, monkeypatch, caplog):
  monkeypatch.setattr(async_checkpointer, '_background_wait_for_commit_futures', _full_disk_at(4))
  workdir = tmp_path / 'run'
  with pytest.raises(train.TrainingDiverged) as failed:  # status 3 (laurel.main), as train.SaveFailed
    train.train(load_config(SPEC, {**RUN, 'steps': 9, 'checkpoint_every': 2}), str(workdir))
  assert str(failed.value) == ('checkpoint 4 could not be saved (No space left on device); last good checkpoint: 2 '
                               f'in {workdir / "checkpoints"}')
  assert max(losses(workdir)) <= 6 and checkpoint_steps(workdir) == {2}  # stopped by its next save at the latest
  assert not [r for r in caplog.records if r.exc_info]  # orbax's tracebacks of it held back


@pytest.mark.slow
def test_a_failed_save_is_one_line_and_status_3(tmp_path):
  workdir = tmp_path / 'run'
  code = ('import sys; from orbax.checkpoint._src.checkpointers import async_checkpointer; import test_saves; '
          'async_checkpointer._background_wait_for_commit_futures = test_saves._full_disk_at(3); '
          f'from laurel import main; sys.argv = {["laurel-train", f"--config={ROOT / SPEC}", f"--workdir={workdir}"]!r}'
          f' + {[f"--config.{k}={v}" for k, v in RUN.items()]!r}; main.run()')
  env = {**cli_env(), 'PYTHONPATH': os.pathsep.join([str(ROOT), str(ROOT / 'tests')])}
  result = subprocess.run([sys.executable, '-c', code], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=300, check=False)
  assert result.returncode == 3, result.stderr[-3000:]
  assert result.stderr.strip().splitlines() == [
      f'error: checkpoint 3 could not be saved (No space left on device); last good checkpoint: none in '
      f'{workdir / "checkpoints"}']


@pytest.mark.slow
def test_a_rerun_on_a_disk_without_room_for_a_checkpoint_stops_before_training(crashed_run, tmp_path, monkeypatch):
  workdir = _copy(crashed_run, tmp_path)
  logged = (workdir / 'metrics.jsonl').read_text()
  size = sum(p.stat().st_size for p in (workdir / 'checkpoints' / '6').rglob('*') if p.is_file())
  usage = shutil.disk_usage(workdir)
  monkeypatch.setattr(shutil, 'disk_usage', lambda path: usage._replace(free=size - 1))
  with pytest.raises(config_lib.InputError) as refused:
    train.train(load_config(SPEC, RERUN), str(workdir))
  assert str(refused.value) == (
      f'--workdir={str(workdir)!r}: {(size - 1) / 2**20:,.1f} MiB free on its disk, less than a checkpoint needs '
      f'({size / 2**20:,.1f} MiB, the size of checkpoint 6); free space or use another workdir')
  assert (workdir / 'metrics.jsonl').read_text() == logged and json.loads(
      (workdir / 'config.json').read_text())['steps'] == 6  # nothing trained, nothing recorded


def test_the_tracebacks_of_a_failed_write_are_held_back(tmp_path, caplog):
  """A save to a full disk ends in one line (test_a_failed_save_is_one_line_and_status_3): the asyncio tasks orbax ran
  for its writes log theirs when collected, and tensorstore reports each write that ends after orbax closed their
  event loop as unraisable."""
  checkpoint.manager(epath.Path(tmp_path), keep=1).close()
  logger = logging.getLogger('asyncio')
  for error in (ENOSPC, ValueError('a bug')):
    logger.error('Task exception was never retrieved', exc_info=(type(error), error, None))
  assert [str(r.exc_info[1]) for r in caplog.records] == ['a bug']
  unraisable = []
  hook = checkpoint._without_closed_loop_errors(unraisable.append)  # pylint: disable=protected-access
  for error in (RuntimeError('Event loop is closed'), RuntimeError('another')):
    hook(types.SimpleNamespace(exc_type=RuntimeError, exc_value=error, exc_traceback=None, err_msg=None, object=None))
  assert [str(info.exc_value) for info in unraisable] == ['another']


def test_the_temporaries_of_checksum_lists_a_kill_cut_short_are_removed(tmp_path):
  step_dir = tmp_path / 'checkpoints' / '30'
  step_dir.mkdir(parents=True)
  left = step_dir / f'.{checksums.LISTING.format(1)}.k1ll3d.tmp'  # as a kill inside write_text_atomic leaves it
  other = step_dir / '.state.x.tmp'  # not a list's: orbax's to handle
  for path in (left, other):
    path.write_text('')
  (tmp_path / 'checkpoints' / 'not_a_folder').write_text('')
  assert checksums.remove_list_temporaries(tmp_path / 'checkpoints') == [left.name]
  assert sorted(os.listdir(step_dir)) == [other.name]


@pytest.mark.slow
def test_inference_reads_a_checkpoint_whose_list_is_damaged_with_one_warning(crashed_run, tmp_path, capsys):
  workdir = _copy(crashed_run, tmp_path)
  newest = max(int(p.name) for p in (workdir / 'checkpoints').iterdir() if p.name.isdigit())
  (workdir / 'checkpoints' / str(newest) / checksums.LISTING.format(0)).write_bytes(DAMAGED_LISTS['random bytes'])
  with loader.lm_run_on_mesh(workdir) as (_, _, number, _):  # what generate and evaluate read
    assert number == newest
  assert f'warning: checkpoint {newest} is read unchecked: checksums.process_0.json is unreadable' in (
      capsys.readouterr().err)
