"""laurel.cli.compile_cache: compiled programs reused across processes (JAX's own cache), and the pre-flight's kept
compiler figures (laurel.plan.aot)."""
import json
import os
import re
import subprocess
import sys

import flax.linen as nn
import jax
import pytest

from helpers import ROOT, TINY_LM, cli_args, cli_env, load_config, needs_libtpu
from laurel import sharding, step, train_config
from laurel.cli import compile_cache
from laurel.plan import aot

SPEC = 'configs/c4_ablation.py:rw_lr,preset=tiny'
JAX_SETTINGS = ('jax_enable_compilation_cache', 'jax_compilation_cache_dir',
                'jax_persistent_cache_min_compile_time_secs')


@pytest.fixture
def restored_jax_settings():
  """setup() changes JAX's process-wide settings: the other tests keep conftest's cache."""
  saved = {name: getattr(jax.config, name) for name in JAX_SETTINGS}
  state = dict(compile_cache._state)  # pylint: disable=protected-access
  yield
  for name, value in saved.items():
    jax.config.update(name, value)
  compile_cache._state.update(state)  # pylint: disable=protected-access


@pytest.mark.parametrize('flag, env, want', [
    (None, {}, '{xdg}/laurel/jax'),  # the default
    (None, {'JAX_COMPILATION_CACHE_DIR': '{tmp}/jax_env'}, '{tmp}/jax_env'),  # JAX's variable
    ('{tmp}/flag', {'JAX_COMPILATION_CACHE_DIR': '{tmp}/jax_env'}, '{tmp}/flag'),  # the flag before it
    ('none', {'JAX_COMPILATION_CACHE_DIR': '{tmp}/jax_env'}, None),  # the flag turns it off
    (None, {'JAX_ENABLE_COMPILATION_CACHE': 'false'}, None),  # so does JAX's other variable
])
def test_the_flag_then_jax_variables_then_the_default_decide_the_directory(
    tmp_path, monkeypatch, restored_jax_settings, flag, env, want):
  fill = lambda s: s.format(tmp=tmp_path, xdg=tmp_path / 'xdg')
  for name in ('JAX_COMPILATION_CACHE_DIR', 'JAX_ENABLE_COMPILATION_CACHE',
               'JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS'):
    monkeypatch.delenv(name, raising=False)
  monkeypatch.setenv('XDG_CACHE_HOME', str(tmp_path / 'xdg'))
  for name, value in env.items():
    monkeypatch.setenv(name, fill(value))
  before = dict(os.environ)
  got = compile_cache.setup(None if flag is None else fill(flag))
  assert got == (None if want is None else fill(want)) == compile_cache.directory()
  assert jax.config.jax_enable_compilation_cache == (want is not None)
  if want is not None:
    assert jax.config.jax_compilation_cache_dir == got
    assert jax.config.jax_persistent_cache_min_compile_time_secs == compile_cache.MIN_COMPILE_S
  assert dict(os.environ) == before  # nothing set for the processes it starts


@pytest.mark.slow
def test_importing_and_setting_up_the_cache_sets_no_jax_variable():
  """The cache is set in JAX's config, not the environment: the processes a command starts choose their own."""
  env = {k: v for k, v in cli_env().items() if not k.startswith(('JAX_COMPILATION', 'JAX_PERSISTENT'))}
  code = ('import json, os; before = dict(os.environ); import laurel.main, laurel.cli.compile_cache; '
          'laurel.cli.compile_cache.setup(); '
          'print(json.dumps(sorted(k for k in os.environ.keys() ^ before.keys() if "JAX" in k or "XLA" in k)))')
  r = subprocess.run([sys.executable, '-c', code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
  assert r.returncode == 0 and json.loads(r.stdout) == [], (r.stdout, r.stderr[-2000:])


@pytest.mark.slow
def test_a_second_run_reads_the_compiled_step_from_the_cache(tmp_path):
  """Two runs of the same config in fresh processes: the first writes the train step to --compilation_cache, the
  second reads it (JAX logs each hit with JAX_LOG_COMPILES) and compiles nothing new of it."""
  env = {**cli_env(), 'JAX_LOG_COMPILES': '1'}
  overrides = {**TINY_LM, 'steps': 2, 'optimizer.warmup_steps': 1}
  cache = tmp_path / 'cache'
  runs = []
  for name in ('first', 'second'):
    runs.append(subprocess.run(cli_args(SPEC, tmp_path / name, overrides) + [f'--compilation_cache={cache}'],
                               env=env, cwd=ROOT, capture_output=True, text=True, timeout=300))
    assert runs[-1].returncode == 0, runs[-1].stderr[-2000:]
    if name == 'first':
      entries = {p.name: p.stat().st_mtime_ns for p in cache.iterdir()}
      assert [n for n in entries if n.startswith('jit_train_step-')], entries
  hit = re.compile(r"Persistent compilation cache hit for 'jit_train_step'")
  assert not hit.search(runs[0].stderr) and hit.search(runs[1].stderr), runs[1].stderr[-3000:]
  assert {p.name: p.stat().st_mtime_ns for p in cache.iterdir() if p.name in entries} == entries  # none rewritten


@pytest.mark.slow
def test_a_resume_reads_the_step_back_unless_steps_changed():
  """What docs/training.md says of a resume: the logging, eval and checkpoint cadence leave the compiled step as it was
  (its cache key, the lowered program, the same); another `steps` changes the schedule compiled into it."""
  def lowered(**overrides):
    task = train_config.validate_config(load_config(SPEC, {**TINY_LM, **overrides}), num_devices=1, process_count=1)
    mesh = sharding.make_mesh(task.config.mesh, jax.devices()[:1])
    with jax.set_mesh(mesh), nn.logical_axis_rules(task.config.logical_axis_rules):
      return step.lower_step(task, mesh)[0].as_text()
  first = lowered(steps=6)
  assert lowered(steps=6, log_every=3, eval_every=5, checkpoint_every=4) == first
  assert lowered(steps=12) != first
  readme = ' '.join((ROOT / 'docs' / 'training.md').read_text().split())
  assert ('a resume with the same config' in readme and 'A resume with another `--config.steps` compiles the step '
          'again, since the learning-rate schedule\'s length is compiled into it') in readme


@pytest.mark.slow
@needs_libtpu
def test_a_second_preflight_of_the_same_step_compiles_nothing(tmp_path, monkeypatch):
  """A compile-only TPU client cannot load an executable back: the compiler's figures are kept instead, keyed by
  the lowered program, and read back by the next compile of the same step: the step, its roofline's unrolled
  variant, the loss's one-chunk program (2 chunks here) and the large matmul that gives the compiler's rate. Another
  step compiles."""
  monkeypatch.setitem(compile_cache._state, 'directory', str(tmp_path))  # pylint: disable=protected-access
  small = {**TINY_LM, 'model.num_layers': 2, 'model.dtype': 'bfloat16', 'data.seq_len': 128, 'batch_size': 8,
           'model.loss_chunk': 64}
  config = load_config(SPEC, small)
  first = aot.compile_for_slice(config, 'v6e:2x2')
  assert len(list((tmp_path / 'preflight').iterdir())) == 4
  with monkeypatch.context() as no_compiling:
    no_compiling.setattr(jax.stages.Lowered, 'compile', lambda *_, **__: pytest.fail('compiled'))
    assert aot.compile_for_slice(config, 'v6e:2x2') == first
  aot.compile_for_slice(load_config(SPEC, {**small, 'batch_size': 16}), 'v6e:2x2', costs=False)
  assert len(list((tmp_path / 'preflight').iterdir())) == 5
