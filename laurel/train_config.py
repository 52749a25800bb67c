"""The typed config's one home: TrainConfig and its sections (built once at the edge by build_config, checked against
the devices by validate_config), the rule of which fields a resume may change, and a run's saved config.json (written,
read back and upgraded, and the trust policy for a design file it names). The schema engine (field(), build()) is
laurel.config_lib's: the designs and model modules declare their sections with it and TrainConfig names the tasks,
so one module holding both would be an import cycle."""

import contextlib
import dataclasses
import hashlib
import importlib.util
import json
import math
import os
import sys
from typing import Any

import flax
import jax
import ml_collections
from etils import epath

from laurel import config_lib, designs, sharding, tasks
from laurel.config_lib import (BOOL, NON_NEGATIVE, NON_NEGATIVE_INT, POSITIVE, POSITIVE_INT, STRING, InputError,
                               field, in_range, is_int, one_of, require)

LOGICAL_AXIS_RULES = designs.logical_axis_rules()  # sharding's and each registered design's
UNIT_INTERVAL = in_range(0, 1, closed=(True, False))
MESH_AXIS = (lambda v: is_int(v) and (v >= 1 or v == -1), 'must be a positive integer or -1')
PROFILE_STEPS = (lambda v: v == () or (isinstance(v, tuple) and len(v) == 2 and all(map(is_int, v))
                           and 1 <= v[0] < v[1]), 'must be () or (start, stop) with 1 <= start < stop')


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  """`config.optimizer`: AdamW with linear warmup and cosine decay, global-norm clipping."""
  learning_rate: float = field(3e-3, POSITIVE)
  warmup_steps: int = field(100, NON_NEGATIVE_INT)
  min_lr_ratio: float = field(0.1, in_range(0, 1))  # cosine decays to learning_rate * min_lr_ratio
  b1: float = field(0.9, UNIT_INTERVAL)
  b2: float = field(0.95, UNIT_INTERVAL)
  eps: float = field(1e-8, POSITIVE)
  weight_decay: float = field(0.1, NON_NEGATIVE)
  grad_clip: float = field(1.0, POSITIVE)
  grad_accum_steps: int = field(1, POSITIVE_INT, resumable=True)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """`config.mesh`: the (data, fsdp, tensor) device mesh; -1 takes the devices the other axes leave."""
  data: int = field(-1, MESH_AXIS)
  fsdp: int = field(1, MESH_AXIS)
  tensor: int = field(1, MESH_AXIS)

  def check(self, prefix):
    sizes = dataclasses.asdict(self)
    require(list(sizes.values()).count(-1) <= 1, prefix, sizes, 'at most one axis may be -1')


@dataclasses.dataclass(frozen=True)
class WandbConfig:
  """`config.wandb`: a Weights & Biases run beside TensorBoard (the extra [wandb]); '' project = none. What it
  sends follows WANDB_MODE (offline: nothing); a resumed run continues the run whose id WORKDIR/wandb_run_id holds."""
  project: str = field('', STRING)
  entity: str = field('', STRING)  # '' = W&B's default for the logged-in user
  name: str = field('', STRING)  # '' = W&B's generated name


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """The top level of a config: the train loop's fields; `model` and `data` are the task's sections."""
  task: str = field('lm', one_of(*tasks.TASKS))
  row: str = ''  # the row of the config file this is (tables and scripts group runs by it)
  preset: str = ''
  baseline_row: str = ''  # the row this one is compared with
  seed: int = field(0, (is_int, 'must be an integer'))
  steps: int = field(1000, (lambda v: is_int(v) and 1 <= v < 2**31,  # TrainState.step is an int32
                             'must be a positive integer below 2**31'), resumable=True)
  batch_size: int = field(16, POSITIVE_INT)  # global, in sequences (LM) or images
  log_every: int = field(50, POSITIVE_INT, resumable=True)
  eval_every: int = field(500, POSITIVE_INT, resumable=True)
  eval_steps: int = field(10, POSITIVE_INT, resumable=True)
  checkpoint_every: int = field(500, POSITIVE_INT, resumable=True)
  keep_checkpoints: int = field(3, POSITIVE_INT, resumable=True)
  tensorboard: bool = field(True, BOOL, resumable=True)
  profile_steps: tuple = field((), PROFILE_STEPS, resumable=True)
  # Independent input streams, split over the processes in order; 0 = gcd(batch_size, 64), and raised to a multiple
  # of the process count (num_data_shards). The global batch sequence depends on this number only, never on the
  # host count, so a run whose streams divide over its processes resumes on any slice.
  data_shards: int = field(0, NON_NEGATIVE_INT)
  # A process whose loop makes no progress (a step, an eval batch, a checkpoint save) for watchdog_factor × the
  # median step time (at least watchdog_min_s), or for watchdog_s in any case, exits with WATCHDOG_EXIT; 0 = off.
  watchdog_factor: float = field(20.0, NON_NEGATIVE, resumable=True)
  watchdog_min_s: float = field(300.0, NON_NEGATIVE, resumable=True)
  watchdog_s: float = field(3600.0, NON_NEGATIVE, resumable=True)
  optimizer: OptimizerConfig = OptimizerConfig()
  mesh: MeshConfig = field(MeshConfig(), resumable=True)
  wandb: WandbConfig = field(WandbConfig(), resumable=True)
  logical_axis_rules: tuple = field(LOGICAL_AXIS_RULES, resumable=True)
  model: Any = None  # the task's typed section (LMConfig, ResNetConfig)
  data: Any = None  # the task's typed section (LMDataConfig, ImageDataConfig)


def base_config(**overrides) -> ml_collections.ConfigDict:
  """The trainer's ConfigDict, every field at its default; configs fill in `model` and `data`."""
  return config_lib.config_dict(TrainConfig, **overrides)


def num_data_shards(config, process_count: int | None = None) -> int:
  """data_shards (0 = gcd(batch_size, 64)), raised to a multiple of the process count where it is not one: a tiny
  preset's one stream is two on two processes, each reading its own."""
  shards = config.data_shards or math.gcd(config.batch_size, 64)
  return math.lcm(shards, jax.process_count() if process_count is None else process_count)


def build_config(config) -> TrainConfig:
  """The typed config of a ConfigDict (a TrainConfig as it is), each field checked: the one conversion, at the edge."""
  if isinstance(config, TrainConfig):
    return config
  train_cfg, task = config_lib.build(TrainConfig, config, '', skip=('model', 'data')), tasks.get_task(config)
  return dataclasses.replace(train_cfg, model=task.model_cfg, data=task.data_cfg,  # a design imported later too
                             logical_axis_rules=designs.logical_axis_rules(train_cfg.logical_axis_rules))


def validate_config(config, num_devices: int | None = None, process_count: int | None = None) -> tasks.Task:
  """Every check that needs no tracing, as one-line errors naming field and value; the task of the typed config."""
  task = tasks.get_task(train_cfg := build_config(config))
  task.validate()
  num_devices = jax.device_count() if num_devices is None else num_devices
  mesh_sizes = dict(zip(sharding.MESH_AXES, sharding.mesh_shape(train_cfg.mesh, num_devices)))
  data, fsdp = mesh_sizes['data'], mesh_sizes['fsdp']
  rules = {}
  for logical, mesh_axes in train_cfg.logical_axis_rules:  # flax takes the first rule of a name
    rules.setdefault(logical, (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes or ()))
  for logical, (field_name, size) in task.sharded_sizes().items():  # jax shards only whole blocks
    axes = rules.get(logical, ())
    parts = math.prod(mesh_sizes[a] for a in axes)
    require(size % parts == 0, field_name, size, f"is sharded over mesh axes {'×'.join(axes)} ({parts} devices, "
            f"logical axis {logical!r}): it must divide by {parts}")
  warmup, steps = train_cfg.optimizer.warmup_steps, train_cfg.steps
  require(warmup < steps, 'optimizer.warmup_steps', warmup,
          f'{"longer than" if warmup > steps else "as long as"} the run (steps={steps}): the learning rate would '
          f'never leave its warmup; set --config.optimizer.warmup_steps={steps // 10} (a tenth of the run) or any '
          f'value below {steps}')
  batch, accum = train_cfg.batch_size, train_cfg.optimizer.grad_accum_steps
  require(batch % accum == 0, 'batch_size', batch, f'must be divisible by optimizer.grad_accum_steps={accum}')
  require((batch // accum) % (data * fsdp) == 0, 'batch_size', batch,
          f'each micro-batch ({batch // accum}) must divide over the data-parallel size data*fsdp={data * fsdp}')
  shards = num_data_shards(train_cfg, process_count)
  require(batch % shards == 0, 'batch_size', batch, f'must divide over data_shards={shards}')
  return task


# The resumable rule: a checkpoint records every field of its config but those declared `resumable`, and a resume
# may change only those (laurel.run.checkpoint checks it).
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
  defaults = _flat(TrainConfig(model=model(stream=type(config.model.stream)()), data=data()))
  return defaults, _resumable(TrainConfig) + _resumable(model, 'model.') + _resumable(data, 'data.')


def _is_resumable(key: str, resumable) -> bool:
  return any(key == f or key.startswith(f + '.') for f in resumable)


def config_changes(saved: dict, config) -> tuple[dict, list[str]]:
  """({field: (saved, now)} where a saved config (upgraded: `upgrade`) and the typed `config` differ, those a resume
  may not change). A field the saved config lacks counts at its default: the run was saved before it existed."""
  defaults, resumable = _schema(config)
  saved, now = _flat(upgrade(saved)), _flat(config)
  if 'seed' not in saved:  # a checkpoint of older code recorded the task and model only
    now = {k: v for k, v in now.items() if k == 'task' or k.startswith('model.')}
  saved = {**{k: defaults[k] for k in now if k in defaults}, **saved}
  changes = {k: (saved.get(k), now.get(k)) for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k)}
  return changes, [k for k in changes if not _is_resumable(k, resumable)]


DECISIVE = ('task', 'model.stream.design')  # a change of these makes every other difference follow


def listed(changes: dict, keys) -> str:
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


def signature(config_dict: dict, config) -> dict:
  """What a checkpoint records of its config (to_dict's `config_dict` of the typed `config`): every field but those a
  resume may change."""
  resumable = _schema(config)[1]
  return flax.traverse_util.unflatten_dict({k: v for k, v in _flat(config_dict).items()
                                            if not _is_resumable(k, resumable)}, sep='.')


# A run's saved config, WORKDIR/config.json: written from the typed config (`as_json`), read back typed as the run was
# trained, whatever code saved it (`upgrade`); `--config=WORKDIR` (or WORKDIR/config.json) is its ConfigDict
# (`get_config`), so that a run resumes as it was trained in one command. A run directory is data, not code: the file
# of a design from outside the package that config.json names is imported only with the user's word
# (`--trust_design_file`, or the module importable from the user's own Python path, not from the run's folder), and
# only while its hash is the one the run recorded (`import_outside_design`).

# config.json records the file of a design from outside the package and its hash (not config fields), so that later
# commands (--config=WORKDIR, sampling, evaluating) import it without PYTHONPATH where the user trusts it.
DESIGN_FILE = 'design_file'
DESIGN_SHA256 = 'design_sha256'
TRUST_FLAG = '--trust_design_file'
TRUST_HELP = ("Import the design file a run's config.json names (a design from outside the package), after you have "
              'read it: it runs as code. Without it only a module on your own Python path is imported.')
# What a command may import of what a run names: the design's file with the user's word (`trust`); nothing at all
# (`imports` False: --print_config shows the saved config as it is).
_POLICY = {'trust': False, 'imports': True}


@contextlib.contextmanager
def design_policy(trust: bool = False, imports: bool = True):
  """Within it, a run's design file is imported only if `trust`, and no design a run names at all unless
  `imports`; laurel.main sets it for the whole command from its flags (command_line.set_design_policy)."""
  before = dict(_POLICY)
  set_design_policy(trust, imports)
  try:
    yield
  finally:
    _POLICY.update(before)


def set_design_policy(trust: bool, imports: bool = True) -> None:
  _POLICY.update(trust=trust, imports=imports)


def _outside_design(saved: dict) -> str:
  """The design of a saved config named 'module:name', else ''."""
  name = ((saved.get('model') or {}).get('stream') or {}).get('design', '')
  return name if isinstance(name, str) and ':' in name else ''


def _outside_module(saved: dict) -> str:
  """The module of the design of a saved config named 'module:name', else ''."""
  return _outside_design(saved).rpartition(':')[0]


def file_sha256(path) -> str:
  return hashlib.sha256(epath.Path(path).read_bytes()).hexdigest()


def as_json(config) -> str:
  """config.json's text of a typed config: config_lib.to_dict's, and the file of a design from outside the package
  with its hash."""
  saved = config_lib.to_dict(config)
  if (file := getattr(sys.modules.get(_outside_module(saved)), '__file__', None)) is not None:
    saved[DESIGN_FILE], saved[DESIGN_SHA256] = os.path.abspath(file), file_sha256(file)
  return json.dumps(saved, indent=2)


def read_json(text: str, import_design: bool = True, run: str | None = None) -> dict:
  """config.json's config, upgraded; with `import_design` its design's module imported as import_outside_design
  allows (`run`: the run's directory, whose own files are never imported without the user's word)."""
  saved = json.loads(text)
  recorded_file, recorded_hash = saved.pop(DESIGN_FILE, None), saved.pop(DESIGN_SHA256, None)
  if (name := _outside_design(saved)) and import_design:
    import_outside_design(name, recorded_file, recorded_hash, run)
  return upgrade(saved)


def _on_users_path(module: str, run: str | None) -> bool:
  """Whether `module` is found on the Python path outside the run's directory (its top-level package is looked up,
  nothing is executed): the user's own module, not one that came with the run (a `python -m` in the run's folder
  has it on the path)."""
  top = module.partition('.')[0]
  if top in sys.modules:
    return True
  try:
    spec = importlib.util.find_spec(top)
  except (ImportError, ValueError):
    return False
  if spec is None:
    return False
  places = list(spec.submodule_search_locations or []) or [spec.origin or '']
  inside = lambda place: run is not None and '://' not in run and os.path.realpath(place).startswith(
      os.path.realpath(run) + os.sep)
  return not any(inside(place) for place in places)


def import_outside_design(name: str, recorded_file: str | None, recorded_hash: str | None,
                          run: str | None = None) -> None:
  """Imports the module of design `name` ('module:name') that a run's config.json names: from the user's own Python
  path where it is there; else from `recorded_file`, the file the run recorded, only with the user's word
  (design_policy's `trust`) and only while its hash is `recorded_hash`; else a one-line InputError saying how to
  trust it. Under design_policy(imports=False) nothing is imported."""
  module, field_name = name.rpartition(':')[0], 'model.stream.design'
  if not _POLICY['imports'] or module in sys.modules:
    return
  if _on_users_path(module, run):
    config_lib.import_module_of(module, field_name, name)
    return
  if not recorded_file or not os.path.isfile(recorded_file):  # never imported from the run's folder either
    recorded = f', nor is the file the run recorded, {recorded_file}' if recorded_file else ''
    raise InputError(f"{field_name}={name!r}: {module} is not on your Python path (outside the run's folder)"
                     f'{recorded}: put the folder holding {module.replace(".", "/")}.py on PYTHONPATH')
  where = f'{field_name}={name!r}: {module} is not on your Python path, and the run names its file {recorded_file}'
  if not _POLICY['trust']:
    raise InputError(f'{where}, which would run as code: read it, then pass {TRUST_FLAG} or put its folder on '
                     'PYTHONPATH')
  if recorded_hash is not None and (found := file_sha256(recorded_file)) != recorded_hash:
    raise InputError(f'{where}, changed since the run recorded it (sha256 {found[:12]}..., recorded '
                     f'{recorded_hash[:12]}...): not imported; read it, and if it is the design you mean, put its '
                     'folder on PYTHONPATH')
  spec = importlib.util.spec_from_file_location(module, recorded_file)
  sys.modules[module] = loaded = importlib.util.module_from_spec(spec)
  try:
    spec.loader.exec_module(loaded)
  except ImportError as e:
    del sys.modules[module]
    raise InputError(f'{field_name}={name!r}: cannot import {module} from {recorded_file} ({e})') from None
  print(f'notice: {field_name}={name!r}: imported {module} from {recorded_file}, the file the run recorded '
        f'({TRUST_FLAG})', file=sys.stderr, flush=True)


def unimported_design(config) -> str | None:
  """The design a config (a ConfigDict) names from outside the package that no module registered: a run's config read
  under design_policy(imports=False), as saved and unchecked."""
  name = config.model.stream.design if 'model' in config and 'stream' in config.model else None
  if isinstance(name, str) and ':' in name and name.rpartition(':')[2] not in designs.REGISTRY:
    return name
  return None


def upgrade(saved: dict) -> dict:
  """A saved config (config.json's, a checkpoint's signature) in today's shape: the chosen design's section alone.
  Runs saved before held every design's section; LAuReL was design 'residual' (its variant 'none' the plain
  residual); before that every design's fields were in `model.stream`."""
  model = saved.get('model')
  stream = dict(model.get('stream') or {}) if isinstance(model, dict) else {}
  name = stream.pop('design', None)
  if name == 'residual' and 'laurel' in model:
    name = 'residual' if model['laurel'].get('variant', 'none') == 'none' else 'laurel'
  design = designs.REGISTRY.get(name.rpartition(':')[2]) if isinstance(name, str) else None
  if design is None:  # no design a build would take: left for it to name
    return saved
  others = {d.section for d in designs.REGISTRY.values()} - {design.section}
  model = {k: v for k, v in model.items() if k not in others}
  if stream:
    own = {f.name for f in dataclasses.fields(design.config)}
    model.setdefault(design.section, {k: v for k, v in stream.items() if k in own})
  return {**saved, 'model': {**model, 'stream': {'design': name}}}


def read_config(workdir, trust: bool | None = None) -> TrainConfig | dict:
  """The typed config a run saved in WORKDIR/config.json (or that file); `trust`: whether the design file it names
  may be imported (None: as design_policy says). Under design_policy(imports=False), where that leaves a design from
  outside the package unimported, the saved config as it is (a dict, unchecked)."""
  path = epath.Path(workdir)
  path = path if path.name.endswith('.json') else path / 'config.json'
  if not path.exists():
    raise InputError(f'--workdir={str(workdir)!r}: no config.json; is it a laurel run?')
  try:
    with design_policy(trust, _POLICY['imports']) if trust is not None else contextlib.nullcontext():
      saved = read_json(path.read_text(), run=os.fspath(path.parent))
  except json.JSONDecodeError as e:
    raise InputError(f'--workdir={str(workdir)!r}: {path.name} is not JSON ({e})') from None
  if (name := _outside_design(saved)) and name.rpartition(':')[2] not in designs.REGISTRY:  # imports=False
    return saved
  saved['logical_axis_rules'] = tuple((name, tuple(axes) if isinstance(axes, list) else axes)
                                      for name, axes in saved['logical_axis_rules'])
  saved['profile_steps'] = tuple(saved['profile_steps'])
  return build_config(ml_collections.ConfigDict(saved))


def get_config(run: str):
  """The ConfigDict of the run's config, every design's section in it: `--config.<field>` overrides it as a file's.
  Under design_policy(imports=False) a design from outside the package stays unimported: the config as saved."""
  config = read_config(run)
  return (ml_collections.ConfigDict(config) if isinstance(config, dict) else config_lib.config_dict(config)).lock()


def run_of(spec: str) -> str | None:
  """`spec` where a --config value names a run (its directory, holding config.json, or that file; local or gs://),
  else None: a config file's argument follows a ':' (not a URL's)."""
  if '://' not in spec and ':' in spec:
    return None
  try:
    path = epath.Path(spec)
    saved = path.is_file() if path.name.endswith('.json') else (path / 'config.json').is_file()
  except Exception as e:  # pylint: disable=broad-except  # whatever the filesystem raises, as one line
    raise InputError(f'--config={spec!r}: {config_lib.io_error_reason(e)}') from None
  return spec if saved else None


def named_paths(config, overridden=()) -> dict[str, str]:
  """{field: value} of the data and vocabulary paths a typed config names (its data source reads them), but the
  `overridden` fields (the user's own flags)."""
  unused = tasks.get_task(config).unused_fields()
  return {f'data.{name}': value for name in ('path', 'vocab_path', 'tfds_data_dir')
          if (value := getattr(config.data, name, '')) and f'data.{name}' not in unused
          and f'data.{name}' not in overridden}


def show_named_paths(config, run, overridden=()) -> None:
  """Before a command reads them: one line naming the data and vocabulary paths the run's config.json names."""
  if paths := named_paths(config, overridden):
    print(f'reading what {os.fspath(epath.Path(run) / "config.json")} names: '
          f'{", ".join(f"{k}={v!r}" for k, v in paths.items())}', file=sys.stderr, flush=True)
