"""Checkpoints: the orbax manager, resuming past damage, the config guard, a run's parameters for inference. Each
WORKDIR/checkpoints/<step> holds state, data (the grain iterator), config (all but the fields declared `resumable`,
which alone a resume may change without --allow_config_change) and checksums.process_<i>.json (laurel.checksums)."""

import contextlib
import dataclasses
import json
import os
import re
import sys
import threading
import time

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

from laurel import checksums, config_lib, designs, sharding, step, tasks
from laurel.config_lib import InputError
from laurel.files import utc, write_text_atomic


def _flat(config) -> dict:
  """A config (ConfigDict, JSON text or dict) as {'a.b': value}."""
  tree = json.loads(config if isinstance(config, str) else json.dumps(config) if isinstance(config, dict)
                    else config.to_json_best_effort())
  return flax.traverse_util.flatten_dict(tree, sep='.')


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
  """The flat defaults of `config`'s task, and its fields declared `resumable`."""
  task = tasks.get_task(config)
  model, data = type(task.model_cfg), type(task.data_cfg)
  defaults = _flat(step.base_config(model=config_lib.config_dict(model), data=config_lib.config_dict(data)))
  return defaults, _resumable(step.TrainConfig) + _resumable(model, 'model.') + _resumable(data, 'data.')


def _is_resumable(key: str, resumable) -> bool:
  return any(key == f or key.startswith(f + '.') for f in resumable)


def config_changes(saved, config) -> tuple[dict, list[str]]:
  """({field: (saved, now)} where a saved config and `config` differ, those a resume may not change). A field the
  saved config lacks counts at its default: the run was saved before it existed."""
  defaults, resumable = _schema(config)
  saved, now = _flat(saved), _flat(config)
  if 'seed' not in saved:  # a checkpoint of older code recorded the task and model only
    now = {k: v for k, v in now.items() if k == 'task' or k.startswith('model.')}
  saved = {**{k: defaults[k] for k in now if k in defaults}, **saved}
  changes = {k: (saved.get(k), now.get(k)) for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k)}
  return changes, [k for k in changes if not _is_resumable(k, resumable)]


def _listed(changes: dict, keys) -> str:
  return ', '.join(f'{k}={changes[k][0]!r} (now {changes[k][1]!r})' for k in keys)


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
    # Checksums first: orbax reading a damaged state leaves tensorstore callbacks that print tracebacks later.
    if (why := checksums.mismatch(step_dir)) is not None:
      return 'damaged', why
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


def restore_latest(mngr, workdir, config, abstract_state, train_iter, allow_change: bool = False):
  """(state, step, steps moved aside) of the latest checkpoint every host can read, or (None, 0, moved). A damaged
  one is moved to WORKDIR/unreadable_checkpoints, never deleted; any other failure is raised, moving nothing."""
  moved = []
  for number in sorted(mngr.all_steps(), reverse=True):
    failure = None
    try:
      outcome, result = _restore_step(mngr, number, workdir, config, abstract_state, train_iter, allow_change)
    except Exception as e:  # pylint: disable=broad-except  # raised below, once every host knows
      outcome, failure = 'failed', e
    if jax.process_count() > 1:  # all hosts restore the same checkpoint, or all stop
      codes = multihost_utils.process_allgather(np.asarray(['ok', 'damaged', 'failed'].index(outcome)))
      if failure is None and np.any(codes == 2):
        failure = RuntimeError(f'restoring checkpoint {number} failed on another host; see its log')
      elif failure is None and outcome == 'ok' and np.any(codes == 1):
        outcome, result = 'damaged', 'unreadable on another host'
    if failure is not None:
      raise failure
    if outcome == 'ok':
      return result['state'], number, moved
    aside = workdir / 'unreadable_checkpoints' / f'{number}.{int(time.time())}'
    if jax.process_index() == 0:  # the one that moves it says so, once
      print(f'warning: checkpoint {number} is unreadable ({result}); moved to {aside}', file=sys.stderr, flush=True)
      aside.parent.mkdir(parents=True, exist_ok=True)
      (epath.Path(mngr.directory) / str(number)).rename(aside)
    else:
      logging.warning('checkpoint %d is unreadable (%s); process 0 moves it to %s', number, result, aside)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices(f'moved checkpoint {number}')
    mngr.reload()
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


def read_config(workdir) -> ml_collections.ConfigDict:
  """The config a run saved in WORKDIR/config.json (or that file), its tuples (lists in JSON) restored."""
  path = epath.Path(workdir)
  path = path if path.name.endswith('.json') else path / 'config.json'
  if not path.exists():
    raise InputError(f'--workdir={str(workdir)!r}: no config.json; is it a laurel run?')
  try:
    saved = designs.read_config_json(path.read_text())
  except json.JSONDecodeError as e:
    raise InputError(f'--workdir={str(workdir)!r}: {path.name} is not JSON ({e})') from None
  saved['logical_axis_rules'] = tuple((name, tuple(axes) if isinstance(axes, list) else axes)
                                      for name, axes in saved['logical_axis_rules'])
  saved['profile_steps'] = tuple(saved['profile_steps'])
  return ml_collections.ConfigDict(saved)


def run_dir(workdir) -> epath.Path:
  """A run's directory: gs://… as it is, a local path made absolute (orbax refuses a relative one)."""
  return epath.Path(workdir if '://' in str(workdir) else os.path.abspath(workdir))


@contextlib.contextmanager
def lm_run_on_mesh(workdir):
  """(task, params, step, mesh) of an LM run's latest checkpoint, inside its mesh and logical axis rules: the
  parameters only, each read straight into its sharding of training."""
  config = read_config(workdir)
  if config.task != 'lm':
    raise InputError(f'--workdir={str(workdir)!r}: a {config.task} run; only LM runs are sampled or scored')
  task = step.validate_config(config, num_devices=len(jax.devices()))
  rules, mesh = task.config.logical_axis_rules, sharding.make_mesh(task.config.mesh)
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules), contextlib.closing(
      ocp.CheckpointManager(run_dir(workdir) / 'checkpoints')) as mngr:
    boxed = jax.eval_shape(task.init, jax.random.key(0), task.example_batch(1))['params']
    abstract = jax.eval_shape(nn.unbox, boxed)
    item = {'params': jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract,
                                   sharding.logical_shardings(boxed, mesh, rules))}
    number = mngr.latest_step()
    if number is None:
      raise InputError(f'--workdir={str(workdir)!r}: holds no checkpoint')
    if (why := checksums.mismatch(epath.Path(mngr.directory) / str(number))) is not None:
      raise InputError(f'--workdir={str(workdir)!r}: checkpoint {number} is damaged ({why}); resuming the run moves '
                       'it aside and goes on from the one before')
    restored = mngr.restore(number, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
        item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item), partial_restore=True)))
    yield task, restored['state']['params'], number, mesh


def guard_config(config, workdir: epath.Path, allow_change: bool = False):
  """Refuses checkpoints trained with a config differing from config.json in a field not resumable, unless
  `allow_change`. Returns `record()`, which writes config.json and a config_history.jsonl line where new or changed;
  train calls it once the checkpoint is restored, so a refused one leaves both as they were."""
  path, where = workdir / 'config.json', os.fspath(workdir)
  saved = path.read_text() if path.exists() else None
  try:
    saved_config = designs.read_config_json(saved, import_design=False) if saved is not None else None
    changes, unsafe = config_changes(saved_config, config) if saved is not None else ({}, [])
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
               'allowed_by_flag': bool(unsafe and number), 'config': json.loads(config.to_json_best_effort())}
      history = workdir / 'config_history.jsonl'  # read + write, not append: not every filesystem appends
      lines = history.read_text() if history.exists() else ''
      if not _recorded(lines, entry):  # not where a kill came between the two writes of the run before
        write_text_atomic(history, lines + json.dumps(entry) + '\n')
      write_text_atomic(path, config.to_json_best_effort(indent=2))
      designs.record_design_file(path, config)
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


def manager(workdir: epath.Path, keep: int) -> ocp.CheckpointManager:
  """The run's checkpoints, `keep` of them; the temporary folders of a save a kill cut short are removed."""
  return ocp.CheckpointManager(workdir / 'checkpoints', options=ocp.CheckpointManagerOptions(
      max_to_keep=keep, create=True, cleanup_tmp_directories=True))


def finish(mngr, background: bool = False) -> None:
  """Waits for the save in flight, then records its checksums; with `background` in a thread the next call joins."""
  mngr.wait_until_finished()
  if (thread := getattr(mngr, 'laurel_checksums', None)) is not None:
    thread.join()
  number, mngr.laurel_unrecorded, mngr.laurel_checksums = getattr(mngr, 'laurel_unrecorded', None), None, None
  if number not in mngr.all_steps():
    return

  def record():
    with contextlib.suppress(FileNotFoundError):  # max_to_keep removed the checkpoint meanwhile
      checksums.record(epath.Path(mngr.directory) / str(number))
  if not background:
    return record()
  mngr.laurel_checksums = threading.Thread(target=record, name=f'laurel-checksums-{number}')
  mngr.laurel_checksums.start()


def save(mngr, number: int, state, train_iter, config) -> None:
  """Checkpoint `number` (async): the state, the input's position and the config's signature."""
  finish(mngr, background=True)
  mngr.laurel_unrecorded = number
  resumable = _schema(config)[1]
  signature = {k: v for k, v in _flat(config).items() if not _is_resumable(k, resumable)}
  mngr.save(number, force=True, args=ocp.args.Composite(
      state=ocp.args.StandardSave(state), data=grain.checkpoint.CheckpointSave(train_iter),
      config=ocp.args.JsonSave(flax.traverse_util.unflatten_dict(signature, sep='.'))))
