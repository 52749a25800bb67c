"""The config a run saved, WORKDIR/config.json: written from the typed config (`as_json`), read back typed as the run
was trained, whatever code saved it (`upgrade`). `--config=WORKDIR` (or WORKDIR/config.json) resolves to this file
with the run as its argument (config_lib.resolve_spec), so that a run resumes as it was trained in one command."""
import dataclasses
import json
import os
import sys

import ml_collections
from etils import epath

from laurel import config_lib, designs, step
from laurel.config_lib import InputError

# config.json records the file of a design from outside the package (not a config field), so that later commands
# (--config=WORKDIR, sampling, evaluating) import it without PYTHONPATH.
DESIGN_FILE = 'design_file'


def _outside_module(saved: dict) -> str:
  """The module of the design of a saved config named 'module:name', else ''."""
  name = ((saved.get('model') or {}).get('stream') or {}).get('design', '')
  return name.rpartition(':')[0] if isinstance(name, str) else ''


def as_json(config) -> str:
  """config.json's text of a typed config: config_lib.to_dict's, and the file of a design from outside the package."""
  saved = config_lib.to_dict(config)
  if (file := getattr(sys.modules.get(_outside_module(saved)), '__file__', None)) is not None:
    saved[DESIGN_FILE] = os.path.abspath(file)
  return json.dumps(saved, indent=2)


def read_json(text: str, import_design: bool = True) -> dict:
  """config.json's config, upgraded; with `import_design` its design's module imported (from the recorded file if
  need be)."""
  saved = json.loads(text)
  recorded_file = saved.pop(DESIGN_FILE, None)
  if (module := _outside_module(saved)) and import_design:
    config_lib.import_module_of(module, 'model.stream.design', saved['model']['stream']['design'], recorded_file)
  return upgrade(saved)


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


def read_config(workdir) -> step.TrainConfig:
  """The typed config a run saved in WORKDIR/config.json (or that file)."""
  path = epath.Path(workdir)
  path = path if path.name.endswith('.json') else path / 'config.json'
  if not path.exists():
    raise InputError(f'--workdir={str(workdir)!r}: no config.json; is it a laurel run?')
  try:
    saved = read_json(path.read_text())
  except json.JSONDecodeError as e:
    raise InputError(f'--workdir={str(workdir)!r}: {path.name} is not JSON ({e})') from None
  saved['logical_axis_rules'] = tuple((name, tuple(axes) if isinstance(axes, list) else axes)
                                      for name, axes in saved['logical_axis_rules'])
  saved['profile_steps'] = tuple(saved['profile_steps'])
  return step.build_config(ml_collections.ConfigDict(saved))


def get_config(run: str):
  """The ConfigDict of the run's config, every design's section in it: `--config.<field>` overrides it as a file's."""
  return config_lib.config_dict(read_config(run)).lock()
