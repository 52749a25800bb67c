"""The config a run saved, WORKDIR/config.json: written from the typed config (`as_json`), read back typed as the run
was trained, whatever code saved it (`upgrade`). `--config=WORKDIR` (or WORKDIR/config.json) resolves to this file
with the run as its argument (config_lib.resolve_spec), so that a run resumes as it was trained in one command.

A run directory is data, not code: the file of a design from outside the package that config.json names is imported
only with the user's word (`--trust_design_file`, or the module importable from the user's own Python path, not from
the run's folder), and only while its hash is the one the run recorded (`import_outside_design`)."""
import contextlib
import dataclasses
import hashlib
import importlib.util
import json
import os
import sys

import ml_collections
from etils import epath

from laurel import config_lib, designs, step, tasks
from laurel.config_lib import InputError

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
  `imports`; laurel.main sets it for the whole command from its flags (set_design_policy)."""
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


def read_config(workdir, trust: bool | None = None) -> step.TrainConfig | dict:
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
  return step.build_config(ml_collections.ConfigDict(saved))


def get_config(run: str):
  """The ConfigDict of the run's config, every design's section in it: `--config.<field>` overrides it as a file's.
  Under design_policy(imports=False) a design from outside the package stays unimported: the config as saved."""
  # ml_collections runs this file afresh as the config file: the package's module holds the one design_policy.
  from laurel.run import saved_config  # pylint: disable=import-outside-toplevel,import-self
  config = saved_config.read_config(run)
  return (ml_collections.ConfigDict(config) if isinstance(config, dict) else config_lib.config_dict(config)).lock()


def run_of(config_file: str) -> str | None:
  """The run whose saved config a resolved `--config` file names (config_lib.resolve_spec), else None."""
  path, _, arg = config_file.partition(':')
  return arg if os.path.realpath(path) == os.path.realpath(__file__) else None


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
