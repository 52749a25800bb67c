"""Checkpoints by orbax: its policies decide when a save happens (preemption, every `checkpoint_every` steps, the last
step) and which are kept (the latest `keep_checkpoints`), and a save that failed raises where it is waited for. Each
WORKDIR/checkpoints/<step> holds state, data (the grain iterator), config (the config's signature: all but the
fields declared `resumable`) and checksums.json, the XXH3 hash and size of every other file, which process 0 writes
in orbax's post-finalization callback, once every host has written its part and before the commit: no committed
checkpoint is without its list. A checkpoint is good (every file as listed) or damaged; ours are the config guard,
the finite check before a save, and the fallback past a damaged checkpoint, which is moved aside, never deleted."""

import concurrent.futures
import json
import os
import re
import sys
import time

import grain
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import xxhash
from absl import logging
from etils import epath
from jax.experimental import multihost_utils
from orbax.checkpoint import checkpoint_managers as policies

from laurel import config_lib
from laurel.config_lib import InputError
from laurel.cli.files import utc, write_text_atomic
from laurel.train_config import as_json, config_changes, listed, read_json

LIST = 'checksums.json'
ALGORITHM = 'xxh3_64'
METADATA, COMMITTED = '_CHECKPOINT_METADATA', 'commit_success.txt'  # what orbax writes at the commit, after the list
CHUNK = 2**24  # a file is hashed as it streams, 16 MiB at a time


def run_dir(workdir) -> epath.Path:
  """A run's directory: gs://… as it is, a local path made absolute (orbax refuses a relative one)."""
  return epath.Path(workdir if '://' in str(workdir) else os.path.abspath(workdir))


def checksum(path: epath.Path) -> str:
  hasher = xxhash.xxh3_64()  # hashes without the GIL: several files at once on several threads
  with epath.Path(path).open('rb') as f:
    while chunk := f.read(CHUNK):
      hasher.update(chunk)
  return hasher.hexdigest()


def _metadata_checksum(text: bytes) -> str:
  """orbax's step metadata but the commit's time, which it adds after the list: the one value no list vouches for."""
  metadata = json.loads(text)
  kept = {k: v for k, v in metadata.items() if k != 'commit_timestamp_nsecs'}
  return xxhash.xxh3_64_hexdigest(json.dumps(kept, sort_keys=True).encode())


def record(step_dir, final: epath.Path) -> None:
  """Writes step_dir/checksums.json, the hash and size of every file of a checkpoint about to be committed as
  `final`; of the two files orbax writes at the commit, its step metadata but the commit's time, and its marker as it
  will read."""
  step_dir = epath.Path(step_dir)
  paths = sorted(root / name for root, _, names in step_dir.walk() for name in names
                 if root != step_dir or name not in (LIST, METADATA))
  sizes = [p.stat().length for p in paths]
  with concurrent.futures.ThreadPoolExecutor(8) as pool:
    hashes = list(pool.map(checksum, paths))
  listed = {os.fspath(p.relative_to(step_dir)): [h, n] for p, h, n in zip(paths, hashes, sizes)}
  marker = f'Checkpoint commit was successful to {final}'.encode()  # as orbax's commit writes it
  listed.update({METADATA: [_metadata_checksum((step_dir / METADATA).read_bytes()), None],
                 COMMITTED: [xxhash.xxh3_64_hexdigest(marker), len(marker)]})
  write_text_atomic(step_dir / LIST, json.dumps({'algorithm': ALGORITHM, 'files': listed}, indent=0) + '\n')


def _listing(step_dir: epath.Path) -> dict:
  """{file: (hash, size)} of a checkpoint's list (an earlier run's: one list a host, its train state's files);
  ValueError, its message a phrase, where there is none or it is no list."""
  lists = [step_dir / LIST] if (step_dir / LIST).exists() else sorted(step_dir.glob('checksums.process_*.json'))
  if not lists:
    raise ValueError(f'it has no {LIST}')
  listed = {}
  for path in lists:
    try:
      listing = json.loads(path.read_bytes())  # random bytes: a UnicodeDecodeError, a ValueError as JSON's errors
      files = listing['files'] if listing['algorithm'] == ALGORITHM else None
      listed.update({name: (str(h), n if n is None else int(n)) for name, (h, n) in files.items()})
    except (IsADirectoryError, ValueError, KeyError, TypeError, AttributeError) as e:
      raise ValueError(f'its {path.name} is no checksum list ({type(e).__name__})') from None
  return listed


def damage(step_dir) -> str | None:
  """Why a checkpoint is damaged, as this host finds it checking its share of the files; None where it is good."""
  step_dir = epath.Path(step_dir)
  try:
    listed = _listing(step_dir)
  except ValueError as e:
    return str(e)
  for name in sorted(listed)[jax.process_index()::jax.process_count()]:
    path, (saved, size) = step_dir / name, listed[name]
    if not path.exists():
      return f'{name} is missing'
    if size is not None and (now_size := path.stat().length) != size:
      return f'{name} has {now_size} bytes, {size} when saved'
    try:
      now = _metadata_checksum(path.read_bytes()) if name == METADATA else checksum(path)
    except ValueError:  # the metadata is no JSON
      now = 'unreadable'
    if now != saved:
      return f'{name}: content checksum mismatch ({ALGORITHM} {now}, {saved} when saved)'
  return None


class Manager(ocp.CheckpointManager):
  """orbax's manager, knowing the steps whose saves it started (its post-finalization callback takes no argument)
  and the failed save the run has reported (`failed`: orbax raises it again in each thread that waits)."""
  saving: list[int]
  failed: BaseException | None = None

  def wait_for_metadata(self) -> None:
    """Waits for orbax's queued writes of step metadata: its store writes in the background, and the last update of
    a save can land after the post-finalization callback has begun."""
    self._non_blocking_metadata_store.wait_until_finished()


def manager(workdir: epath.Path, config) -> Manager:
  """The run's checkpoints: saved where orbax's policies say (a preemption, which JAX's service tells every process
  of several; every `checkpoint_every` steps; the last step), the latest `keep_checkpoints` kept. A save's checksum
  list is written before its commit; temporaries of a save a kill cut short are removed."""
  directory = epath.Path(workdir) / 'checkpoints'
  saving = []

  def vouch():  # on process 0 once every host has written its part; on an object store the commit writes in place
    mngr.wait_for_metadata()  # else the list could vouch for metadata that a queued update then rewrites
    final = directory / str(saving[-1])
    tmp = directory / f'{saving[-1]}{ocp.path.atomicity_types.TMP_DIR_SUFFIX}'
    record(tmp if tmp.exists() else final, final)

  save_policy = policies.AnySavePolicy([policies.PreemptionCheckpointingPolicy(),
                                        policies.FixedIntervalPolicy(config.checkpoint_every),
                                        policies.SpecificStepsPolicy({config.steps})])
  mngr = Manager(directory, options=ocp.CheckpointManagerOptions(
      save_decision_policy=save_policy, preservation_policy=policies.LatestN(config.keep_checkpoints),
      cleanup_tmp_directories=True, async_options=ocp.AsyncOptions(post_finalization_callback=vouch)))
  mngr.saving = saving
  return mngr


def save(mngr: Manager, number: int, state, train_iter, signature: dict) -> None:
  """Checkpoint `number` (async): the state, the input's position and the config's signature."""
  mngr.wait_until_finished()  # as orbax's save does first: the save before is committed, with its list
  mngr.saving.append(number)
  mngr.save(number, force=True, args=ocp.args.Composite(
      state=ocp.args.StandardSave(state), data=grain.checkpoint.CheckpointSave(train_iter),
      config=ocp.args.JsonSave(signature)))


def close(mngr: Manager) -> None:
  """Closes the manager once its saves are done; a failed save the run has reported is not raised again."""
  try:
    mngr.close()
  except Exception:  # pylint: disable=broad-except
    if mngr.failed is None:
      raise


def io_cause(error: BaseException | None) -> str | None:
  """The system's reason where `error` (or its cause) is a failed read or write, e.g. 'No space left on device'."""
  while error is not None:
    if isinstance(error, OSError) and error.errno:
      return os.strerror(error.errno)
    if code := re.search(r"os_error_code='?(\d+)", str(error)):  # tensorstore's errors name the OS's
      return os.strerror(int(code[1]))
    error = error.__cause__ or error.__context__
  return None


@jax.jit
def _all_finite(tree) -> jax.Array:
  leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves])) if leaves else jnp.array(True)


def is_finite(state) -> bool:
  """Whether every floating-point value of `state` is finite (the same answer on every host)."""
  return bool(jax.device_get(_all_finite(state).addressable_data(0)))


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


def _damage_on_any_host(step_dir) -> str | None:
  """damage(), the same on every host: each checks its share of the files."""
  why = damage(step_dir)
  if jax.process_count() > 1 and np.any(multihost_utils.process_allgather(np.asarray(why is not None))):
    why = why or 'damaged, as another host found (see its log)'
  return why


def _restore(mngr, number: int, config, abstract_state, train_iter, allow_change: bool, where: str):
  """(state, None) of a good checkpoint, or (None, why) of a damaged one; InputError for another task, model,
  parameter tree or (unless `allow_change`) config, moving nothing."""
  step_dir = epath.Path(mngr.directory) / str(number)
  if (why := _damage_on_any_host(step_dir)) is not None:
    return None, why
  saved = mngr.restore(number, args=ocp.args.Composite(config=ocp.args.JsonRestore()))['config']
  changes, unsafe = config_changes(saved, config)  # the checkpoint's own record: config.json may be gone or replaced
  _refuse_changes(where, number, changes, unsafe, allow_change, f'checkpoint {number} was trained with', 'that config')
  tree = ocp.StandardCheckpointHandler().metadata(step_dir / 'state').tree
  if (difference := _tree_difference(tree, abstract_state)) is not None:
    raise InputError(f'{where}: checkpoint {number} does not match the model: {difference} (a code change?); '
                     'nothing was moved: resume with the code that wrote it, or use a new workdir')
  state = mngr.restore(number, args=ocp.args.Composite(
      state=ocp.args.StandardRestore(abstract_state), data=grain.checkpoint.CheckpointRestore(train_iter)))['state']
  return (state, None) if is_finite(state) else (None, 'its state is not finite')


def restore_latest(mngr, workdir, config, abstract_state, train_iter, allow_change: bool = False):
  """(state, step, steps moved aside) of the newest good checkpoint, or (None, 0, moved) where none is. A damaged
  one is moved to WORKDIR/unreadable_checkpoints with one line, never deleted, and the one before is tried; any
  other failure is raised, moving nothing."""
  moved, where = [], f'--workdir={str(workdir)!r}'
  for number in sorted(mngr.all_steps(), reverse=True):
    state, why = _restore(mngr, number, config, abstract_state, train_iter, allow_change, where)
    if why is None:
      return state, number, moved
    aside = epath.Path(workdir) / 'unreadable_checkpoints' / f'{number}.{int(time.time())}'
    if jax.process_index() == 0:
      print(f'warning: checkpoint {number} is damaged ({why}); moved to {aside}', file=sys.stderr, flush=True)
      aside.parent.mkdir(parents=True, exist_ok=True)
      (epath.Path(mngr.directory) / str(number)).rename(aside)
    else:
      logging.warning('checkpoint %d is damaged (%s); process 0 moves it to %s', number, why, aside)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices(f'moved checkpoint {number}')
    mngr.reload()
    moved.append(number)
  return None, 0, moved


def _refuse_changes(where: str, number: int, changes: dict, unsafe: list, allow_change: bool, trained: str,
                    resume_with: str) -> None:
  """An InputError where checkpoint `number` was trained with another task or model (no flag restores those), or
  with other values of fields a resume may not change, unless `allow_change`."""
  if model := [k for k in unsafe if k == 'task' or k.startswith('model.')]:
    raise InputError(f'{where}: holds checkpoints of a different task/model (step {number}: '
                     f'{listed(changes, model)}); use a new workdir or the original config')
  if unsafe and not allow_change:
    raise InputError(f'{where}: {trained} {listed(changes, unsafe)}; resume with {resume_with}, or pass '
                     '--allow_config_change to go on with the new values')


def guard_config(config, workdir: epath.Path, allow_change: bool = False):
  """Refuses checkpoints trained with a typed config differing from config.json in a field not resumable, unless
  `allow_change`; writes nothing. Returns `record()`, which writes config.json and a config_history.jsonl line where
  new or changed: train calls it before compiling where there is no checkpoint, else once the checkpoint is
  restored, so that a refused one leaves both as they were."""
  path, where = workdir / 'config.json', os.fspath(workdir)
  saved = path.read_text() if path.exists() else None
  try:
    changes, unsafe = ({}, []) if saved is None else config_changes(read_json(saved, False), config)
  except json.JSONDecodeError:  # a torn copy: each checkpoint's own config signature is checked on restore instead
    print(f'warning: {path}: config.json is not JSON; it is rewritten once the checkpoint is restored',
          file=sys.stderr, flush=True)
    changes, unsafe, saved = {}, [], None
  folder = workdir / 'checkpoints'
  number = max((int(p.name) for p in folder.iterdir() if p.name.isdigit()), default=0) if folder.is_dir() else 0
  if number:
    _refuse_changes(f'--workdir={where!r}', number, changes, unsafe, allow_change,
                    f'its checkpoints (step {number}) were trained with', f'the saved config (--config={where})')
  if number and changes and jax.process_index() == 0:  # e.g. a longer run: said on the console, not only recorded
    print(f'resuming checkpoint {number} with a changed config: {listed(changes, changes)}', flush=True)

  def record():
    if jax.process_index() == 0 and (changes or saved is None):
      entry = {'time': utc(), 'step': number, 'changes': {k: list(v) for k, v in changes.items()},
               'allowed_by_flag': bool(unsafe and number), 'config': config_lib.to_dict(config)}
      history = workdir / 'config_history.jsonl'  # read + write, not append: not every filesystem appends
      lines = history.read_text() if history.exists() else ''
      if not _recorded(lines, entry):  # not where a kill came between the two writes of the run before
        write_text_atomic(history, lines + json.dumps(entry) + '\n')
      write_text_atomic(path, as_json(config))
  return record


def _recorded(history: str, entry: dict) -> bool:
  """Whether the last line of config_history.jsonl is `entry` but for its time."""
  try:
    last = json.loads(history.splitlines()[-1]) if history.strip() else None
  except ValueError:
    return False
  return isinstance(last, dict) and {**last, 'time': None} == {**entry, 'time': None}
