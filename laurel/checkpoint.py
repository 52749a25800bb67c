"""Checkpoints: the orbax manager, resuming with a damage quarantine, the config guard, parameters for inference.

  WORKDIR/checkpoints/<step>   state (TrainState), data (grain iterator), config (the config, RESUMABLE fields left
                               out), checksums.process_<i>.json (laurel.checksums)
  restore_latest               the latest checkpoint every host can read; a damaged one is moved aside, never deleted
  guard_config                 refuses to resume with another config (RESUMABLE fields excepted); config.json, history
  restore_params, lm_run_on_mesh   a run's parameters only, for sampling and evaluation
"""

import contextlib
import datetime
import json
import os
import re
import sys
import threading
import time
import weakref

import flax
import flax.linen as nn
import grain
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from etils import epath
from jax.experimental import multihost_utils

from laurel import checksums, config_lib, sharding, step, tasks
from laurel.config_lib import InputError
from laurel.files import write_text_atomic
from laurel.step import validate_config

# What a resumed run may change without --allow_config_change: how long it runs (the cosine decay stretches to the
# new `steps`), what it logs and when, and how it is laid out and fed. Anything else would train new settings on
# the old state.
RESUMABLE = ('steps', 'log_every', 'eval_every', 'eval_steps', 'checkpoint_every', 'keep_checkpoints', 'tensorboard',
             'wandb', 'profile_steps', 'watchdog_factor', 'watchdog_min_s', 'watchdog_s', 'mesh', 'logical_axis_rules',
             'optimizer.grad_accum_steps', 'model.remat', 'model.loss_chunk', 'data.num_workers',
             'data.prefetch')

def _model_signature(config) -> dict:
  """What a checkpoint must have been trained with: the task and the model, less the fields a resume may change
  (also dropped from a saved signature, so checkpoints that recorded them still match)."""
  signature = json.loads(ml_collections.ConfigDict({'task': config['task'], 'model': config['model']}).to_json())
  signature['model'] = {k: v for k, v in signature['model'].items() if f'model.{k}' not in RESUMABLE}
  return signature


def _run_signature(config) -> dict:
  """What a checkpoint records of its run's config: every field but the RESUMABLE ones (a checkpoint of older code
  recorded _model_signature only)."""
  flat = _flat(config.to_json_best_effort())
  return flax.traverse_util.unflatten_dict({k: v for k, v in flat.items() if not _resumable(k)}, sep='.')


def _resumable(key: str) -> bool:
  return any(key == f or key.startswith(f + '.') for f in RESUMABLE)


def _flat(config_json: str) -> dict:
  return flax.traverse_util.flatten_dict(json.loads(config_json), sep='.')


def _with_new_fields(saved: dict, config, keys) -> dict:
  """A saved config (flat) with the `keys` it lacks at their defaults: a run saved before a field existed trained
  with its default, so resuming with the default changes nothing."""
  task = tasks.get_task(config)
  defaults = _flat(step.base_config(model=config_lib.config_dict(type(task.model_cfg)),
                                    data=config_lib.config_dict(type(task.data_cfg))).to_json_best_effort())
  return {**{k: defaults[k] for k in keys if k in defaults}, **saved}


def _same_model(saved_signature: dict, config) -> bool:
  now = _flat(json.dumps(_model_signature(config)))
  return _with_new_fields(_flat(json.dumps(_model_signature(saved_signature))), config, now) == now


# Tensorstore's codes for a checkpoint's own data being missing or corrupt (a truncated file: OUT_OF_RANGE; bytes
# that do not decompress: FAILED_PRECONDITION). Only such a checkpoint is moved aside; any other failure (a storage
# service, permissions, a bug) is raised, and every checkpoint stays where it is.
DAMAGE_STATUS = ('DATA_LOSS', 'NOT_FOUND', 'OUT_OF_RANGE', 'FAILED_PRECONDITION')


def _damage(error: BaseException) -> str | None:
  """Why `error` (or what caused it) says the checkpoint's own files are missing or corrupt, as one line; else None."""
  while error is not None:
    line = f'{type(error).__name__}: {(str(error).splitlines() or [""])[0][:200]}'
    if isinstance(error, (FileNotFoundError, EOFError, json.JSONDecodeError)):
      return line
    if isinstance(error, KeyError) and 'not found in the checkpoint' in str(error):  # an item's directory is gone
      return line
    if isinstance(error, ValueError) and re.fullmatch(r'File .+ does not exist\.', str(error)):  # grain's file
      return line
    if any(f'{status}: ' in str(error) for status in DAMAGE_STATUS):
      return line
    error = error.__cause__ or error.__context__
  return None


def _tree_difference(saved_tree, abstract_state) -> str | None:
  """The first array path where a checkpoint's tree (orbax metadata) and the model's differ, as a phrase."""
  flat = lambda tree: {jax.tree_util.keystr(p, simple=True, separator='.'): x.shape
                       for p, x in jax.tree_util.tree_leaves_with_path(tree)}
  saved, model = flat(saved_tree), flat(abstract_state)
  for path, shape in model.items():
    if path not in saved:
      return f'{path} is in the model, not in the checkpoint'
    if tuple(saved[path]) != tuple(shape):
      return f'{path} has shape {tuple(saved[path])} in the checkpoint, {tuple(shape)} in the model'
  extra = next((path for path in saved if path not in model), None)
  return None if extra is None else f'{extra} is in the checkpoint, not in the model'


def _restore_step(mngr, step, workdir, config, abstract_state, train_iter, allow_change):
  """('ok', restored), ('damaged', why), or raises: InputError for a checkpoint of another model or parameter
  tree, or of another config unless `allow_change`; any error that is not damage as it is."""
  try:
    saved = mngr.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))['config']
    if not _same_model(saved, config):
      raise InputError(f'--workdir={str(workdir)!r}: holds checkpoints of a different task/model (step {step}); use '
                       'a new workdir or the original config')
    now = _flat(config.to_json_best_effort())
    changed = [f'{k}={v!r} (now {now.get(k)!r})' for k, v in _flat(json.dumps(saved)).items()
               if not _resumable(k) and now.get(k) != v and k != 'task' and not k.startswith('model.')]
    if changed and not allow_change:  # the checkpoint's own record: config.json may be gone or replaced
      raise InputError(f'--workdir={str(workdir)!r}: checkpoint {step} was trained with {", ".join(changed)}; '
                       'resume with that config, or pass --allow_config_change to go on with the new values')
    tree = ocp.StandardCheckpointHandler().metadata(epath.Path(mngr.directory) / str(step) / 'state').tree
    if (difference := _tree_difference(tree, abstract_state)) is not None:
      raise InputError(f'--workdir={str(workdir)!r}: checkpoint {step} does not match the model: {difference} (a '
                       'code change?); nothing was moved: resume with the code that wrote it, or use a new workdir')
    if (why := checksums.mismatch(epath.Path(mngr.directory) / str(step))) is not None:
      return 'damaged', why
    restored = mngr.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state), data=grain.checkpoint.CheckpointRestore(train_iter)))
    if not is_finite(restored['state']):  # saved by code that did not check: resuming it would diverge again
      return 'damaged', 'its state is not finite'
    return 'ok', restored
  except Exception as e:  # pylint: disable=broad-except
    if isinstance(e, InputError) or (why := _damage(e)) is None:
      raise
    return 'damaged', why


def restore_latest(mngr, workdir, config, abstract_state, train_iter, allow_change: bool = False):
  """(state, step, steps moved aside) of the latest checkpoint every host can read, or (None, 0, moved). A
  checkpoint whose own data is missing or corrupt is moved aside with a warning, never deleted; a checkpoint of
  another model or parameter tree is an InputError, and any other failure is raised: nothing in the workdir
  changes then."""
  moved = []
  for step in sorted(mngr.all_steps(), reverse=True):
    failure = None
    try:
      outcome, result = _restore_step(mngr, step, workdir, config, abstract_state, train_iter, allow_change)
    except Exception as e:  # pylint: disable=broad-except  # raised below, once every host knows
      outcome, failure = 'failed', e
    if jax.process_count() > 1:  # all hosts restore the same checkpoint, or all stop
      codes = multihost_utils.process_allgather(np.asarray(['ok', 'damaged', 'failed'].index(outcome)))
      if failure is None and np.any(codes == 2):
        failure = RuntimeError(f'restoring checkpoint {step} failed on another host; see its log')
      elif failure is None and outcome == 'ok' and np.any(codes == 1):
        outcome, result = 'damaged', 'unreadable on another host'
    if failure is not None:
      raise failure
    if outcome == 'ok':
      return result['state'], step, moved
    aside, why = workdir / 'unreadable_checkpoints' / f'{step}.{int(time.time())}', result
    logging.warning('checkpoint %d is unreadable (%s); moving it to %s', step, why, aside)
    if jax.process_index() == 0:
      print(f'warning: checkpoint {step} is unreadable ({why}); moved to {aside}', file=sys.stderr, flush=True)
      aside.parent.mkdir(parents=True, exist_ok=True)
      (epath.Path(mngr.directory) / str(step)).rename(aside)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices(f'moved checkpoint {step}')
    mngr.reload()
    moved.append(step)
  return None, 0, moved


@jax.jit
def _all_finite(tree) -> jax.Array:
  leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves])) if leaves else jnp.array(True)


def is_finite(state) -> bool:
  """Whether every floating-point value of `state` is finite (one reduction on the devices; the same answer on
  every host)."""
  return bool(jax.device_get(_all_finite(state).addressable_data(0)))


def quarantined_steps(workdir) -> list[int]:
  """The steps of the checkpoints restore_latest has moved aside in `workdir`, in order."""
  aside = epath.Path(workdir) / 'unreadable_checkpoints'
  return sorted({int(p.name.split('.')[0]) for p in aside.iterdir() if p.name.split('.')[0].isdigit()}
                if aside.is_dir() else ())


def read_config(workdir) -> ml_collections.ConfigDict:
  """The config a run saved in WORKDIR/config.json (or the JSON file itself), with the tuples JSON turned into lists
  restored."""
  path = epath.Path(workdir)
  path = path if path.name.endswith('.json') else path / 'config.json'
  if not path.exists():
    raise InputError(f'--workdir={str(workdir)!r}: no config.json; is it a laurel run?')
  saved = json.loads(path.read_text())
  saved['logical_axis_rules'] = tuple((name, tuple(axes) if isinstance(axes, list) else axes)
                                      for name, axes in saved['logical_axis_rules'])
  saved['profile_steps'] = tuple(saved['profile_steps'])
  return ml_collections.ConfigDict(saved)


def run_dir(workdir) -> epath.Path:
  """A run's directory: gs://… as it is, a local path made absolute (orbax refuses a relative one)."""
  return epath.Path(workdir if '://' in str(workdir) else os.path.abspath(workdir))


def restore_params(workdir, task, shardings=None):
  """(params, step) of the latest checkpoint of a run of `task`, e.g. to sample or evaluate it: the parameters only
  (the optimizer state is never read), each read straight into its sharding in `shardings` (a tree like the params;
  default: device 0)."""
  abstract = jax.eval_shape(lambda rng: nn.unbox(task.init(rng, task.example_batch(1)))['params'],
                            jax.eval_shape(jax.random.key, 0))
  if shardings is None:
    shardings = jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(jax.devices()[0]), abstract)
  item = {'params': jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)}
  mngr = ocp.CheckpointManager(run_dir(workdir) / 'checkpoints')
  try:
    step = mngr.latest_step()
    if step is None:
      raise InputError(f'--workdir={str(workdir)!r}: holds no checkpoint')
    if (why := checksums.mismatch(epath.Path(mngr.directory) / str(step))) is not None:
      raise InputError(f'--workdir={str(workdir)!r}: checkpoint {step} is damaged ({why}); resuming the run moves it '
                       'aside and goes on from the one before')
    restored = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
        item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item), partial_restore=True)))
  finally:
    mngr.close()
  return restored['state']['params'], step


@contextlib.contextmanager
def lm_run_on_mesh(workdir):
  """(task, params, step, mesh) of the latest checkpoint of an LM run, its params read into their shardings of
  training on the run's mesh, inside that mesh and the logical axis rules: where generate and evaluate compile and
  run. One-line InputErrors."""
  config = read_config(workdir)
  if config.task != 'lm':
    raise InputError(f'--workdir={str(workdir)!r}: a {config.task} run; only LM runs are sampled or scored')
  task = validate_config(config, num_devices=len(jax.devices()))
  rules, mesh = task.config.logical_axis_rules, sharding.make_mesh(task.config.mesh)
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    boxed = jax.eval_shape(task.init, jax.random.key(0), task.example_batch(1))['params']
    params, step = restore_params(workdir, task, sharding.logical_shardings(boxed, mesh, rules))
    yield task, params, step, mesh


def _checkpoint_steps(workdir: epath.Path) -> list[int]:
  directory = workdir / 'checkpoints'
  return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit()) if directory.is_dir() else []


def guard_config(config, workdir: epath.Path, allow_change: bool = False):
  """Refuses to resume checkpoints with a config that differs from the workdir's config.json in anything but the
  RESUMABLE fields, unless `allow_change`. Returns `record()`, which writes (on process 0) the config to config.json
  and, when it is new or changed, a line to config_history.jsonl (every config the workdir has trained with, and
  from which step): called once the checkpoint is restored, so that a refused one leaves both as they were. In a
  workdir without checkpoints they are written at once."""
  path, new = workdir / 'config.json', config.to_json_best_effort()
  now = _flat(new)
  saved = _with_new_fields(_flat(path.read_text()), config, now) if path.exists() else None
  changes = {k: (saved.get(k), now.get(k)) for k in sorted(set(saved) | set(now))
             if saved.get(k) != now.get(k)} if saved is not None else {}
  unsafe = [k for k in changes if not _resumable(k)]
  step = max(_checkpoint_steps(workdir), default=0)
  listed = lambda keys: ', '.join(f'{k}={changes[k][0]!r} (now {changes[k][1]!r})' for k in keys)
  if unsafe and step and not allow_change:
    raise InputError(f'--workdir={os.fspath(workdir)!r}: its checkpoints (step {step}) were trained with '
                     f'{listed(unsafe)}; resume with the saved config (--config={os.fspath(workdir)}), or pass '
                     '--allow_config_change to go on with the new values')
  if step and changes and jax.process_index() == 0:  # e.g. a longer run: said on the console, not only recorded
    print(f'resuming checkpoint {step} with a changed config: {listed(changes)}', flush=True)

  def record():
    if jax.process_index() == 0 and (saved is None or changes):
      entry = {'time': utc_now(), 'step': step, 'changes': {k: list(v) for k, v in changes.items()},
               'allowed_by_flag': bool(unsafe and step), 'config': json.loads(new)}
      history = workdir / 'config_history.jsonl'
      # read + write, not append: not every filesystem appends
      write_text_atomic(history, (history.read_text() if history.exists() else '') + json.dumps(entry) + '\n')
      write_text_atomic(path, config.to_json_best_effort(indent=2))
  if not step:  # no checkpoint that a restore could refuse: written now, before anything compiles
    record()
    return lambda: None
  return record


def utc_now() -> str:
  return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')



def manager(workdir: epath.Path, keep: int) -> ocp.CheckpointManager:
  """The run's checkpoints, `keep` of them; the temporary folders of a save that a kill cut short are removed."""
  return ocp.CheckpointManager(workdir / 'checkpoints', options=ocp.CheckpointManagerOptions(
      max_to_keep=keep, create=True, cleanup_tmp_directories=True))


_unrecorded = weakref.WeakKeyDictionary()  # manager -> the step of its save whose checksums are not written yet
_recording = weakref.WeakKeyDictionary()  # manager -> the thread writing a finished save's checksums


def finish(mngr, background: bool = False) -> None:
  """Waits for the save in flight, then records its files' checksums (laurel.checksums); with `background` in a
  thread that the next call joins, so that the train loop goes on meanwhile."""
  mngr.wait_until_finished()
  if (thread := _recording.pop(mngr, None)) is not None:
    thread.join()
  step_number = _unrecorded.pop(mngr, None)
  if step_number is None or step_number not in mngr.all_steps():
    return
  step_dir = epath.Path(mngr.directory) / str(step_number)
  if not background:
    checksums.record(step_dir)
    return

  def record():
    try:
      checksums.record(step_dir)
    except FileNotFoundError:  # max_to_keep removed the checkpoint meanwhile
      pass
  _recording[mngr] = threading.Thread(target=record, name=f'laurel-checksums-{step_number}')
  _recording[mngr].start()


def save(mngr, step_number: int, state, train_iter, config) -> None:
  """Checkpoint `step_number`: the state, the input iterator's position and the run's config signature (async).
  Orbax waits for the previous save first; its checksums are then written while this one is."""
  finish(mngr, background=True)
  _unrecorded[mngr] = step_number
  mngr.save(step_number, force=True, args=ocp.args.Composite(
      state=ocp.args.StandardSave(state), data=grain.checkpoint.CheckpointSave(train_iter),
      config=ocp.args.JsonSave(_run_signature(config))))
