"""Shared test helpers: tiny configs for the train loop, run in-process or through the CLI."""
import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

from conftest import TEST_XLA_FLAGS
from laurel import config_lib

ROOT = pathlib.Path(__file__).resolve().parents[1]

# The TPU compiler is an optional extra (Linux only): without it, the tests that compile for a slice skip.
needs_libtpu = pytest.mark.skipif(importlib.util.find_spec('libtpu') is None,
                                  reason="compiling for a TPU slice needs libtpu: pip install -e '.[tpu]'")

# A model and batch small enough that a step takes milliseconds on one CPU core.
TINY_LM = {
    'model.d_model': 32, 'model.num_heads': 4, 'model.d_ff': 64, 'model.num_layers': 3,
    'data.name': 'synthetic', 'data.seq_len': 32,
    'batch_size': 8, 'steps': 6, 'log_every': 1, 'eval_every': 1000, 'eval_steps': 2,
    'checkpoint_every': 1000, 'tensorboard': False, 'optimizer.warmup_steps': 2, 'data.prefetch': 0,
}


def load_config(spec: str, overrides: dict | None = None):
  """`spec` is 'configs/<file>.py:<arg>'; overrides are dotted field names set as Python values (types the
  command line could not write included)."""
  config = config_lib.load(spec)
  for dotted, value in (overrides or {}).items():
    *parents, leaf = dotted.split('.')
    node = config
    for p in parents:
      node = node[p]
    node[leaf] = value
  return config


def cli_args(spec: str, workdir, overrides: dict) -> list[str]:
  args = [sys.executable, '-m', 'laurel.main', f'--config={ROOT / spec.split(":")[0]}:{spec.split(":")[1]}',
          f'--workdir={workdir}']
  return args + [f'--config.{k}={v}' for k, v in overrides.items()]


def cli_env(num_devices: int = 1) -> dict:
  env = dict(os.environ)
  env['XLA_FLAGS'] = f'--xla_force_host_platform_device_count={num_devices} {TEST_XLA_FLAGS}'
  env['JAX_PLATFORMS'] = 'cpu'
  env['PYTHONPATH'] = str(ROOT)
  return env


def without_this_python(path: str) -> str:
  """PATH without the folder of this interpreter: a shell in which its venv is not activated."""
  here = os.path.dirname(sys.executable)
  return os.pathsep.join(p for p in path.split(os.pathsep) if not (os.path.isdir(p) and os.path.samefile(p, here)))


def fake_gcs_env(root, num_devices: int = 1) -> dict:
  """cli_env in which gs://BUCKET/PATH is the local file ROOT/BUCKET/PATH (tests/fake_gcs), for etils.epath."""
  env = cli_env(num_devices)
  env.update(FAKE_GCS_ROOT=str(root), EPATH_USE_TF='0',
             PYTHONPATH=os.pathsep.join([str(ROOT / 'tests' / 'fake_gcs'), env['PYTHONPATH']]))
  return env


def run_cli(spec, workdir, overrides, num_devices=1, timeout=300, extra=()):
  return subprocess.run(cli_args(spec, workdir, overrides) + list(extra), env=cli_env(num_devices), cwd=ROOT,
                        capture_output=True, text=True, timeout=timeout)


def losses(workdir) -> dict[int, float]:
  rows = [json.loads(l) for l in (pathlib.Path(workdir) / 'metrics.jsonl').read_text().splitlines() if l]
  return {r['step']: r['loss'] for r in rows if 'loss' in r}
