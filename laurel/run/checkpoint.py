"""Checkpoints: the orbax manager, resuming past damage, the config guard. Each
WORKDIR/checkpoints/<step> holds state, data (the grain iterator), config (all but the fields declared `resumable`,
which alone a resume may change without --allow_config_change), checksummed (that its run writes checksum lists) and
checksums.process_<i>.json (laurel.run.checksums)."""

import dataclasses
import functools
import json
import logging as logging_std
import os
import re
import shutil
import sys
import threading
import time

import flax
import grain
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from etils import epath
from jax.experimental import multihost_utils

from laurel import config_lib, designs, step
from laurel.run import checksums, process, saved_config
from laurel.config_lib import InputError
from laurel.run.files import is_remote, utc, write_text_atomic

PROMISE = 'checksummed'  # the item that says a checkpoint's run writes checksum lists: without one it is unvouched
VERDICTS = ('verified', 'unchecked', 'unvouched', 'damaged')  # of a checkpoint's files, best first


def _flat(config) -> dict:
  """A typed config, or a saved one (a dict), as {'a.b': value}."""
  return flax.traverse_util.flatten_dict(config if isinstance(config, dict) else config_lib.to_dict(config), sep='.')


def _resumable(schema, prefix: str = '') -> list[str]:
  """The fields of a config dataclass declared `resumable`, flat, nested sections included."""
  keys = []
  for f in dataclasses.fields(schema):
    if f.metadata.get('resumable'):
      keys.append(prefix + f.name)
    elif dataclasses.is_dataclass(f.default):
      keys += _resumable(f.default, f'{prefix}{f.name}.')
  return keys


def _schema(config) -> tuple[dict, list[str]]:
  """The flat defaults of a typed config's task (its design's section at its defaults), and its fields declared
  `resumable`."""
  model, data = type(config.model), type(config.data)
  defaults = _flat(step.TrainConfig(model=model(stream=type(config.model.stream)()), data=data()))
  return defaults, _resumable(step.TrainConfig) + _resumable(model, 'model.') + _resumable(data, 'data.')


def _is_resumable(key: str, resumable) -> bool:
  return any(key == f or key.startswith(f + '.') for f in resumable)


def config_changes(saved: dict, config) -> tuple[dict, list[str]]:
  """({field: (saved, now)} where a saved config (upgraded: saved_config.upgrade) and the typed `config` differ,
  those a resume may not change). A field the saved config lacks counts at its default: the run was saved before it
  existed."""
  defaults, resumable = _schema(config)
  saved, now = _flat(saved_config.upgrade(saved)), _flat(config)
  if 'seed' not in saved:  # a checkpoint of older code recorded the task and model only
    now = {k: v for k, v in now.items() if k == 'task' or k.startswith('model.')}
  saved = {**{k: defaults[k] for k in now if k in defaults}, **saved}
  changes = {k: (saved.get(k), now.get(k)) for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k)}
  return changes, [k for k in changes if not _is_resumable(k, resumable)]


DECISIVE = ('task', 'model.stream.design')  # a change of these makes every other difference follow


def _listed(changes: dict, keys) -> str:
  """`field=saved (now new)` of each of `keys`, the decisive fields first; the fields of a design's section that the
  other design lacks (saved or now None, where the design changed) as one count per section."""
  keys = sorted(keys, key=lambda k: (k not in DECISIVE, k))
  sections = {}
  if 'model.stream.design' in keys:
    saved_design, new_design = changes['model.stream.design']
    for k in keys:
      section = k.split('.')[1] if k.startswith('model.') and k.count('.') >= 2 else None
      if section != 'stream' and section in {d.section for d in designs.REGISTRY.values()} and None in changes[k]:
        sections.setdefault((section, new_design if changes[k][1] is None else saved_design), []).append(k)
  grouped = {k for ks in sections.values() for k in ks}
  parts = [f'{k}={changes[k][0]!r} (now {changes[k][1]!r})' for k in keys if k not in grouped]
  parts += [f'the {len(ks)} field{"s" * (len(ks) > 1)} of model.{section}, which design {design!r} does not have'
            for (section, design), ks in sections.items()]
  return ', '.join(parts)


# Tensorstore's codes for a checkpoint's own data missing or corrupt (truncated: OUT_OF_RANGE; not decompressing:
# FAILED_PRECONDITION). Only such a checkpoint is moved aside; any other failure is raised, moving nothing.
DAMAGE_STATUS = ('DATA_LOSS', 'NOT_FOUND', 'OUT_OF_RANGE', 'FAILED_PRECONDITION')


def _damage(error: BaseException) -> str | None:
  """Why `error` (or its cause) says the checkpoint's own files are missing or corrupt, as one line; else None."""
  while error is not None:
    text = str(error)
    if (isinstance(error, (FileNotFoundError, EOFError, json.JSONDecodeError))
        or (isinstance(error, KeyError) and 'not found in the checkpoint' in text)  # an item's directory is gone
        or (isinstance(error, ValueError) and re.fullmatch(r'File .+ does not exist\.', text))  # grain's file
        or any(f'{status}: ' in text for status in DAMAGE_STATUS)):
      return config_lib.io_error_reason(error)
    error = error.__cause__ or error.__context__
  return None


def _tree_difference(saved_tree, abstract_state) -> str | None:
  """The first array path where a checkpoint's tree (orbax metadata) and the model's differ, as a phrase."""
  flat = lambda tree: {jax.tree_util.keystr(p, simple=True, separator='.'): tuple(x.shape)
                       for p, x in jax.tree_util.tree_leaves_with_path(tree)}
  saved, model = flat(saved_tree), flat(abstract_state)
  for path, shape in model.items():
    if path not in saved:
      return f'{path} is in the model, not in the checkpoint'
    if saved[path] != shape:
      return f'{path} has shape {saved[path]} in the checkpoint, {shape} in the model'
  extra = next((path for path in saved if path not in model), None)
  return None if extra is None else f'{extra} is in the checkpoint, not in the model'


def _restore_step(mngr, number, workdir, config, abstract_state, train_iter, allow_change):
  """('ok', restored) or ('damaged', why); InputError for another task, model, parameter tree or (unless
  `allow_change`) config; any other error that is not damage as it is."""
  where, step_dir = f'--workdir={str(workdir)!r}', epath.Path(mngr.directory) / str(number)
  try:
    saved = mngr.restore(number, args=ocp.args.Composite(config=ocp.args.JsonRestore()))['config']
    changes, unsafe = config_changes(saved, config)
    if model := [k for k in unsafe if k == 'task' or k.startswith('model.')]:
      raise InputError(f'{where}: holds checkpoints of a different task/model (step {number}: '
                       f'{_listed(changes, model)}); use a new workdir or the original config')
    if unsafe and not allow_change:  # the checkpoint's own record: config.json may be gone or replaced
      raise InputError(f'{where}: checkpoint {number} was trained with {_listed(changes, unsafe)}; resume with that '
                       'config, or pass --allow_config_change to go on with the new values')
    tree = ocp.StandardCheckpointHandler().metadata(step_dir / 'state').tree
    if (difference := _tree_difference(tree, abstract_state)) is not None:
      raise InputError(f'{where}: checkpoint {number} does not match the model: {difference} (a code change?); '
                       'nothing was moved: resume with the code that wrote it, or use a new workdir')
    restored = mngr.restore(number, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state), data=grain.checkpoint.CheckpointRestore(train_iter)))
    if not is_finite(restored['state']):  # saved by code that did not check: resuming it would diverge again
      return 'damaged', 'its state is not finite'
    return 'ok', restored
  except Exception as e:  # pylint: disable=broad-except
    if isinstance(e, InputError) or (why := _damage(e)) is None:
      raise
    return 'damaged', why


def verdict(step_dir: epath.Path) -> tuple[str, str | None]:
  """This host's word on a checkpoint's files (VERDICTS) and why: 'unchecked' where its run wrote no checksum lists
  (older code) or its list is damaged (a damaged list says nothing of the data: never a reason to set it aside),
  'unvouched' where its list never came (a crash after the save), 'damaged' where a file differs from its list."""
  found, why = checksums.verify(step_dir)
  if found == 'mismatch':
    return 'damaged', why
  if found == 'unreadable':
    return 'unchecked', why
  if found == 'none' and (step_dir / PROMISE).exists():  # its run writes lists: this one never came (a crash)
    return 'unvouched', f'no {checksums.LISTING.format(jax.process_index())}'
  return ('verified' if found == 'verified' else 'unchecked'), None


def _on_every_host(attempt, outcomes: tuple[str, ...], what: str):
  """attempt()'s (outcome, detail), the same on every host: the worst of `outcomes` (best first) any host had; an
  exception on one host is raised on all, once every host knows."""
  failure = None
  try:
    outcome, detail = attempt()
  except Exception as e:  # pylint: disable=broad-except  # raised below
    outcome, detail, failure = None, None, e
  if jax.process_count() > 1:
    code = len(outcomes) if failure is not None else outcomes.index(outcome)  # len(outcomes): an exception
    worst = int(np.max(multihost_utils.process_allgather(np.asarray(code))))
    if failure is None and worst == len(outcomes):
      failure = RuntimeError(f'{what} failed on another host; see its log')
    elif failure is None and outcomes[worst] != outcome:
      outcome, detail = outcomes[worst], f'{outcomes[worst]} on another host'
  if failure is not None:
    raise failure
  return outcome, detail


def _move_aside(mngr, workdir, number: int, why: str) -> None:
  """Moves checkpoint `number` to WORKDIR/unreadable_checkpoints (never deleted), saying `why` once."""
  aside = workdir / 'unreadable_checkpoints' / f'{number}.{int(time.time())}'
  if jax.process_index() == 0:  # the one that moves it says so, once
    print(f'warning: checkpoint {number} {why}; moved to {aside}', file=sys.stderr, flush=True)
    aside.parent.mkdir(parents=True, exist_ok=True)
    (epath.Path(mngr.directory) / str(number)).rename(aside)
  else:
    logging.warning('checkpoint %d %s; process 0 moves it to %s', number, why, aside)
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(f'moved checkpoint {number}')
  mngr.reload()


def restore_latest(mngr, workdir, config, abstract_state, train_iter, allow_change: bool = False):
  """(state, step, steps moved aside) of the latest checkpoint every host can read, or (None, 0, moved). One whose
  files differ from their checksum list, or that orbax finds damaged, is moved to WORKDIR/unreadable_checkpoints,
  never deleted. One whose list never came (a crash after its save) is restored only where no verified one exists;
  where an older one is restored, it is moved aside too. One whose list is damaged is restored, with a warning. Any
  other failure is raised, moving nothing."""
  moved, unvouched = [], []  # unvouched: (step, why), newest first

  def restore(number):
    return _on_every_host(lambda: _restore_step(mngr, number, workdir, config, abstract_state, train_iter,
                                                allow_change), ('ok', 'damaged'), f'restoring checkpoint {number}')

  for number in sorted(mngr.all_steps(), reverse=True):
    # Checksums first: orbax reading a damaged state leaves tensorstore callbacks that print tracebacks later.
    judged, why = _on_every_host(functools.partial(verdict, epath.Path(mngr.directory) / str(number)), VERDICTS,
                                  f'verifying checkpoint {number}')
    if judged == 'unvouched':
      unvouched.append((number, why))
      continue
    outcome, result = ('damaged', why) if judged == 'damaged' else restore(number)
    if outcome == 'ok':
      if why and jax.process_index() == 0:  # unchecked: its list is damaged
        print(f'warning: checkpoint {number} is restored unchecked: {why}', file=sys.stderr, flush=True)
      trusted = 'is verified' if judged == 'verified' else 'has a damaged list' if why else 'predates checksum lists'
      for newer, reason in unvouched:
        _move_aside(mngr, workdir, newer, f'has no checksum list that vouches for it ({reason}) and checkpoint '
                    f'{number} {trusted}')
      return result['state'], number, moved + [newer for newer, _ in unvouched]
    _move_aside(mngr, workdir, number, f'is unreadable ({result})')
    moved.append(number)
  for number, why in unvouched:  # no verified checkpoint: the newest that orbax restores, unverified
    outcome, result = restore(number)
    if outcome == 'ok':
      if jax.process_index() == 0:
        print(f'warning: checkpoint {number} is restored unverified: no checksum list vouches for it ({why}) and no '
              'verified checkpoint exists', file=sys.stderr, flush=True)
      return result['state'], number, moved
    _move_aside(mngr, workdir, number, f'is unreadable ({result})')
    moved.append(number)
  return None, 0, moved


@jax.jit
def _all_finite(tree) -> jax.Array:
  leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves])) if leaves else jnp.array(True)


def is_finite(state) -> bool:
  """Whether every floating-point value of `state` is finite (the same answer on every host)."""
  return bool(jax.device_get(_all_finite(state).addressable_data(0)))


def quarantined_steps(workdir) -> list[int]:
  """The steps of the checkpoints restore_latest has moved aside in `workdir`, in order."""
  aside = epath.Path(workdir) / 'unreadable_checkpoints'
  return sorted({int(p.name.split('.')[0]) for p in aside.iterdir() if p.name.split('.')[0].isdigit()}
                if aside.is_dir() else ())


def run_dir(workdir) -> epath.Path:
  """A run's directory: gs://… as it is, a local path made absolute (orbax refuses a relative one)."""
  return epath.Path(workdir if '://' in str(workdir) else os.path.abspath(workdir))


def guard_config(config, workdir: epath.Path, allow_change: bool = False):
  """Refuses checkpoints trained with a typed config differing from config.json in a field not resumable, unless
  `allow_change`. Returns `record()`, which writes config.json and a config_history.jsonl line where new or changed;
  train calls it once the checkpoint is restored, so a refused one leaves both as they were."""
  path, where = workdir / 'config.json', os.fspath(workdir)
  saved = path.read_text() if path.exists() else None
  try:
    changes, unsafe = ({}, []) if saved is None else config_changes(saved_config.read_json(saved, False), config)
  except json.JSONDecodeError:  # a torn copy: each checkpoint's own config signature is checked on restore instead
    print(f'warning: {path} is not JSON; it is rewritten, and the checkpoints are checked against their own record '
          'of the config', file=sys.stderr, flush=True)
    saved, changes, unsafe = None, {}, []
  folder = workdir / 'checkpoints'
  number = max((int(p.name) for p in folder.iterdir() if p.name.isdigit()), default=0) if folder.is_dir() else 0
  if number and (model := [k for k in unsafe if k == 'task' or k.startswith('model.')]):  # no flag restores those
    raise InputError(f'--workdir={where!r}: holds checkpoints of a different task/model (step {number}: '
                     f'{_listed(changes, model)}); use a new workdir or the original config')
  if unsafe and number and not allow_change:
    raise InputError(f'--workdir={where!r}: its checkpoints (step {number}) were trained with '
                     f'{_listed(changes, unsafe)}; resume with the saved config (--config={where}), or pass '
                     '--allow_config_change to go on with the new values')
  if number and changes and jax.process_index() == 0:  # e.g. a longer run: said on the console, not only recorded
    print(f'resuming checkpoint {number} with a changed config: {_listed(changes, changes)}', flush=True)

  def record():
    if jax.process_index() == 0 and (changes or saved is None):
      entry = {'time': utc(), 'step': number, 'changes': {k: list(v) for k, v in changes.items()},
               'allowed_by_flag': bool(unsafe and number), 'config': config_lib.to_dict(config)}
      history = workdir / 'config_history.jsonl'  # read + write, not append: not every filesystem appends
      lines = history.read_text() if history.exists() else ''
      if not _recorded(lines, entry):  # not where a kill came between the two writes of the run before
        write_text_atomic(history, lines + json.dumps(entry) + '\n')
      write_text_atomic(path, saved_config.as_json(config))
  if number:
    return record
  record()  # no checkpoint that a restore could refuse: written now, before anything compiles
  return lambda: None


def _recorded(history: str, entry: dict) -> bool:
  """Whether the last line of config_history.jsonl is `entry` but for its time."""
  try:
    last = json.loads(history.splitlines()[-1]) if history.strip() else None
  except ValueError:
    return False
  return isinstance(last, dict) and {**last, 'time': None} == {**entry, 'time': None}


def _io_cause(error: BaseException | None) -> str | None:
  """The system's reason where `error` (or its cause) is a failed read or write, e.g. 'No space left on device'."""
  while error is not None:
    if isinstance(error, OSError) and error.errno:
      return os.strerror(error.errno)
    if code := re.search(r"os_error_code='?(\d+)", str(error)):  # tensorstore's errors name the OS's
      return os.strerror(int(code[1]))
    error = error.__cause__ or error.__context__
  return None


class _QuietIOFailures(logging_std.Filter):
  """Drops the logged tracebacks of a failed read or write from orbax and the asyncio tasks it runs: each of its
  threads and tasks logs one (some 460 lines for one save to a full disk), and the run reports the failure itself in
  one line (`failure`, restore_latest)."""
  def filter(self, record):
    error = record.exc_info[1] if record.exc_info else None
    ours = record.name == 'asyncio' or f'{os.sep}orbax{os.sep}' in record.pathname
    return not (ours and _io_cause(error) is not None)


_QUIET_IO_FAILURES = _QuietIOFailures()


def _without_closed_loop_errors(hook):
  """sys.unraisablehook without tensorstore's 'Event loop is closed' of each write that ends after orbax closed the
  event loop of a failed save (the failure itself is reported in one line)."""
  def unraisable(info):
    if not (isinstance(info.exc_value, RuntimeError) and str(info.exc_value) == 'Event loop is closed'):
      hook(info)
  unraisable.laurel_quiet = True
  return unraisable


@dataclasses.dataclass
class _Saves:
  """A manager's saves: the thread that waits for the one in flight and then writes its checksum list, and the save
  that failed, with its error."""
  recorder: threading.Thread | None = None
  failed: tuple[int, BaseException] | None = None


def manager(workdir: epath.Path, keep: int) -> ocp.CheckpointManager:
  """The run's checkpoints, `keep` of them; the temporary folders of a save a kill cut short are removed."""
  mngr = ocp.CheckpointManager(workdir / 'checkpoints', options=ocp.CheckpointManagerOptions(
      max_to_keep=keep, create=True, cleanup_tmp_directories=True))
  mngr.laurel_saves = _Saves()
  for logger in ('absl', 'asyncio'):
    logging_std.getLogger(logger).addFilter(_QUIET_IO_FAILURES)  # once: a filter is added only where absent
  if not getattr(sys.unraisablehook, 'laurel_quiet', False):
    sys.unraisablehook = _without_closed_loop_errors(sys.unraisablehook)
  return mngr


def _record_when_saved(mngr, number: int) -> None:
  """Waits for save `number`, then at once writes this host's checksum list of it: a crash after the save leaves a
  checkpoint that a rerun verifies. A failure of either is kept for `failure`."""
  try:
    mngr.wait_until_finished()
    checksums.record(epath.Path(mngr.directory) / str(number))
  except Exception as e:  # pylint: disable=broad-except  # the train loop stops at its next step
    mngr.laurel_saves.failed = (number, e)


def failure(mngr) -> str | None:
  """Why a save failed, in one line naming the cause and the last good checkpoint; None where none failed (yet)."""
  if mngr.laurel_saves.failed is None:
    return None
  number, error = mngr.laurel_saves.failed
  good = max((s for s in mngr.all_steps() if s != number), default=None)
  return (f'checkpoint {number} could not be saved ({_io_cause(error) or config_lib.io_error_reason(error)}); last '
          f'good checkpoint: {"none" if good is None else good} in {epath.Path(mngr.directory)}')


def finish(mngr) -> str | None:
  """Waits for the save in flight and its checksum list; then `failure`."""
  if mngr.laurel_saves.recorder is not None:
    mngr.laurel_saves.recorder.join()
  return failure(mngr)


def close(mngr) -> None:
  """Waits for the save in flight and closes the manager; a failed save, which `failure` reports, is not raised."""
  finish(mngr)
  try:
    mngr.close()
  except Exception as e:  # pylint: disable=broad-except
    if mngr.laurel_saves.failed is None or e is not mngr.laurel_saves.failed[1]:
      raise
    mngr.close()  # orbax raises a failed save once in each thread that waits: now it closes


def save(mngr, number: int, state, train_iter, config) -> None:
  """Checkpoint `number` (async): the state, the input's position and the config's signature. Its checksum list is
  written as soon as it completes. After a failed save (`failure`) nothing more is saved."""
  if finish(mngr) is not None:  # the one before and its list first: max_to_keep may not delete it before its list
    return
  resumable = _schema(config)[1]
  signature = {k: v for k, v in _flat(config).items() if not _is_resumable(k, resumable)}
  try:
    mngr.save(number, force=True, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), data=grain.checkpoint.CheckpointSave(train_iter),
        config=ocp.args.JsonSave(flax.traverse_util.unflatten_dict(signature, sep='.')),
        **{PROMISE: ocp.args.JsonSave({'lists': checksums.LISTING, 'algorithm': checksums.ALGORITHM})}))
  except Exception as e:  # pylint: disable=broad-except
    if _io_cause(e) is None:  # not the disk: a bug, with its traceback
      raise
    mngr.laurel_saves.failed = (number, e)
    return
  mngr.laurel_saves.recorder = process.start_thread(f'laurel-checksums-{number}', _record_when_saved, mngr, number)


def check_room(mngr, workdir, abstract_state) -> None:
  """A one-line InputError where the checkpoints' disk has less room than a checkpoint takes (the latest on disk,
  else the state's bytes), before training: a save would fail. Every host checks its own; all stop together."""
  folder = epath.Path(mngr.directory)
  short = None
  if not is_remote(folder):  # an object store does not fill up
    latest = mngr.latest_step()
    if latest is None:
      need, what = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract_state)), 'the train state'
    else:
      files = [os.path.join(root, name) for root, _, names in os.walk(folder / str(latest)) for name in names]
      need, what = sum(map(os.path.getsize, files)), f'the size of checkpoint {latest}'
    free = shutil.disk_usage(folder).free
    if free < need:
      short = (f'--workdir={str(workdir)!r}: {free / 2**20:,.1f} MiB free on its disk, less than a checkpoint needs '
               f'({need / 2**20:,.1f} MiB, {what}); free space or use another workdir')
  if jax.process_count() > 1:
    if np.any(multihost_utils.process_allgather(np.asarray(short is not None))) and short is None:
      short = f"--workdir={str(workdir)!r}: another host's disk has no room for a checkpoint; see its log"
  if short is not None:
    raise InputError(short)
