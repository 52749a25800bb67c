"""A run is never silently split, restarted or truncated (issue 22): a TPU VM's start that fails loudly, checkpoints
moved aside only for damage, bad input told apart from bugs, a resume past a torn log and on a filesystem without
appends, no-op fields refused, resuming from the saved config, inference that reads only the sharded parameters, and
a watchdog for hung steps."""
import dataclasses
import json
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import PartitionSpec as P

from helpers import (ROOT, SPEC, TINY_LM, TRAINED, cli_env, fake_gcs_env, load_config, losses, run_cli, run_python,
                     tree_snapshot, typed_config)
from laurel import config_lib, data, designs, step, train
from laurel.designs import StreamSpec
from laurel.run import checkpoint, checksums, metrics_log, preflight, process, saved_config
from laurel.serve import loader
from laurel.serve import evaluate, generate


@pytest.fixture
def run_with_three_checkpoints(trained_run):  # conftest's, trained once per test process
  return trained_run


# 1. A TPU VM trains alone only where its slice provably has one host.

TPU_START = ('import jax, sys\n'
             'from laurel import main, train\nfrom laurel.run import cluster\n'
             'def refuse(*a, **k): raise RuntimeError("no coordinator answered")\n'
             'jax.distributed.initialize = refuse\n'
             'cluster.on_tpu_vm = lambda: True\n'
             'train.train = lambda *a, **k: print("TRAINED ALONE") or {}\n'
             f'sys.argv = ["laurel", "--config={ROOT}/configs/c4_ablation.py:rw,preset=tiny", "--workdir=unused"]\n'
             'main.run()\n')


@pytest.mark.slow
@pytest.mark.parametrize('hosts, trains', [({'TPU_WORKER_HOSTNAMES': 'w0,w1,w2,w3'}, False),
                                           ({'GCE_METADATA_IP': '127.0.0.1:9'}, False),  # the host count is unknown
                                           ({'TPU_WORKER_HOSTNAMES': 'w0'}, True)])
def test_a_failed_start_on_a_tpu_vm_trains_alone_only_on_one_host(hosts, trains):
  env = {k: v for k, v in cli_env().items() if not k.startswith(('TPU_', 'GCE_', 'MEGASCALE'))}
  result = run_python(TPU_START, {**env, **hosts})
  if trains:
    assert result.returncode == 0 and 'TRAINED ALONE' in result.stdout, result.stderr[-2000:]
    assert 'running as one process' in result.stderr
  else:
    assert result.returncode == 4 and 'TRAINED ALONE' not in result.stdout, result.stderr[-2000:]
    lines = [l for l in result.stderr.splitlines() if l.startswith('error:')]
    assert len(lines) == 1 and 'jax.distributed.initialize() failed' in lines[0] and 'no coordinator' in lines[0]


# 2. Only a checkpoint whose own data is missing or corrupt is moved aside; the log keeps every line.

@pytest.mark.slow
def test_damaged_checkpoints_are_moved_aside_and_the_log_is_kept(run_with_three_checkpoints, tmp_path):
  workdir = tmp_path / 'run'
  shutil.copytree(run_with_three_checkpoints, workdir)
  logged = (workdir / 'metrics.jsonl').read_text()
  data_file = max((workdir / 'checkpoints' / '9' / 'state').rglob('d/*'), key=lambda p: p.stat().st_size)
  data_file.write_bytes(data_file.read_bytes()[:data_file.stat().st_size // 2])  # a truncated array file
  (workdir / 'checkpoints' / '6' / 'state' / '_METADATA').unlink()  # a deleted metadata file
  result = run_cli(SPEC, workdir, TRAINED)  # the run's own step: read from the compilation cache
  assert result.returncode == 0, result.stderr[-3000:]
  assert 'checkpoint 9 is unreadable' in result.stderr and 'checkpoint 6 is unreadable' in result.stderr
  assert 'resumed from checkpoint 3' in result.stdout
  assert sorted(p.name.split('.')[0] for p in (workdir / 'unreadable_checkpoints').iterdir()) == ['6', '9']
  text = (workdir / 'metrics.jsonl').read_text()
  assert text.startswith(logged)  # nothing cut: steps 4-9 stay, and come again after a line that says why
  again = [json.loads(l) for l in text[len(logged):].splitlines()]
  assert again[0]['step'] == 4 and again[0]['moved_aside'] == [9, 6] and again[-1]['step'] == 9


def _restore_args(workdir):
  config = load_config(SPEC, {**TINY_LM, 'steps': 9, 'checkpoint_every': 3})
  task = step.validate_config(config, num_devices=1)
  _, init_state, _ = step.make_train_fns(task)
  abstract = jax.eval_shape(init_state, jax.random.key(0))
  mngr = ocp.CheckpointManager(workdir / 'checkpoints')
  return mngr, checkpoint.run_dir(workdir), task.config, abstract, iter(train.local_dataset(task, train=True))


def _renamed(abstract):
  params = dict(abstract.params)
  params['embedding_table'] = params.pop('embed')
  return abstract.replace(params=params)


def _reshaped(abstract):
  norm = abstract.params['final_norm']['scale']
  params = {**abstract.params, 'final_norm': {'scale': jax.ShapeDtypeStruct((norm.shape[0] * 2,), norm.dtype)}}
  return abstract.replace(params=params)


@pytest.mark.slow
@pytest.mark.parametrize('change, message', [
    (_renamed, 'params.embedding_table.embedding is in the model, not in the checkpoint'),
    (_reshaped, 'params.final_norm.scale has shape (32,) in the checkpoint, (64,) in the model')])
def test_a_checkpoint_of_another_parameter_tree_is_an_error_naming_the_path(run_with_three_checkpoints, tmp_path,
                                                                           change, message):
  workdir = tmp_path / 'run'
  shutil.copytree(run_with_three_checkpoints, workdir)
  before = tree_snapshot(workdir)
  mngr, *args = _restore_args(workdir)
  args[2] = change(args[2])
  with pytest.raises(config_lib.InputError, match=re.escape(f'checkpoint 9 does not match the model: {message}')):
    checkpoint.restore_latest(mngr, *args)  # pylint: disable=protected-access
  mngr.close()
  assert tree_snapshot(workdir) == before


@pytest.mark.slow
def test_an_environment_failure_moves_nothing(run_with_three_checkpoints, tmp_path, monkeypatch):
  workdir = tmp_path / 'run'
  shutil.copytree(run_with_three_checkpoints, workdir)
  before = tree_snapshot(workdir)
  denied = ValueError('PERMISSION_DENIED: Error reading "params.embed.embedding/0.0" in OCDBT database: 403')
  restore = ocp.CheckpointManager.restore
  monkeypatch.setattr(ocp.CheckpointManager, 'restore', lambda self, step, args: (
      restore(self, step, args=args) if 'config' in args else (_ for _ in ()).throw(denied)))
  mngr, *args = _restore_args(workdir)
  with pytest.raises(ValueError, match='PERMISSION_DENIED'):
    checkpoint.restore_latest(mngr, *args)  # pylint: disable=protected-access
  mngr.close()
  assert tree_snapshot(workdir) == before


# 3. Only bad input is a one-line error (exit 2); any other exception keeps its traceback (exit 1).

ENTRY_POINTS = {  # module: (what to make raise, argv)
    'laurel.main': ('laurel.train.train', f'"--config={ROOT}/configs/c4_ablation.py:rw,preset=tiny", "--workdir=w"'),
    'laurel.serve.generate': ('laurel.serve.loader.lm_run_on_mesh', '"--workdir=w", "--prompt=x"'),
    'laurel.serve.evaluate': ('laurel.serve.loader.lm_run_on_mesh', '"--workdir=w", "--task=hellaswag"'),
}


@pytest.mark.slow
@pytest.mark.parametrize('module, error, bad_input', [
    *[(module, 'ValueError', False) for module in ENTRY_POINTS],
    ('laurel.main', 'config_lib.InputError', True)])
def test_only_bad_input_is_a_one_line_error(module, error, bad_input):
  patch, argv = ENTRY_POINTS[module]
  owner, _, name = patch.rpartition('.')
  code = (f'import importlib, sys\nfrom absl import app\nfrom laurel import config_lib\n'
          f'm, owner = importlib.import_module({module!r}), importlib.import_module({owner!r})\n'
          f'def fail(*a, **k): raise {error}("a message from a library")\n'
          f'owner.{name} = fail\nsys.argv = ["x", {argv}]\n'
          f'm.run() if hasattr(m, "run") else app.run(m.main, flags_parser=config_lib.parse_flags)\n')
  result = run_python(code)
  if bad_input:
    assert result.returncode == 2 and result.stderr.strip().splitlines() == ['error: a message from a library']
  else:
    assert result.returncode == 1 and 'Traceback' in result.stderr and 'ValueError: a message from a library' in \
        result.stderr and 'error: a message' not in result.stderr, result.stderr[-2000:]


def test_scripts_turn_only_bad_input_into_one_line():
  sys.path.insert(0, str(ROOT / 'scripts'))
  import cli  # pylint: disable=import-outside-toplevel
  def raise_(error):
    raise error
  with pytest.raises(SystemExit) as exit_info:
    cli.main(lambda: raise_(config_lib.InputError('--x=1: bad')))(['script'])
  assert exit_info.value.code == 2
  with pytest.raises(ValueError, match='a library bug'):
    cli.main(lambda: raise_(ValueError('a library bug')))(['script'])
  with pytest.raises(config_lib.InputError):  # every validator raises the dedicated type
    step.validate_config(load_config(SPEC, {**TINY_LM, 'steps': 0}), num_devices=1)


# 4. Resume survives a torn log, and the log never appends where the filesystem cannot.

def test_resume_drops_a_torn_last_log_line(tmp_path, capsys):
  rows = [{'step': s, 'loss': 1.0 / s} for s in (1, 2, 3)]
  text = ''.join(json.dumps(r) + '\n' for r in rows)
  (tmp_path / 'metrics.jsonl').write_text(text + text.splitlines()[-1][:9])  # killed mid-write of a 4th line
  log = metrics_log.MetricsLog(tmp_path, typed_config(SPEC, TINY_LM), resume_step=2, info={})  # a resume from 2
  log.write(3, {'loss': 0.25})
  log.writer.close()
  assert 'metrics.jsonl: dropped line 4, not a JSON object with a step' in capsys.readouterr().err
  assert losses(tmp_path) == {1: 1.0, 2: 0.5, 3: 0.25}


@pytest.mark.slow
def test_the_metrics_log_never_appends_on_gcs(tmp_path):
  code = ('import json\nfrom etils import epath\nfrom laurel import step\nfrom laurel.run import metrics_log\n'
          'config = step.TrainConfig(tensorboard=False)\n'
          'for resume, steps in ((0, (1, 2)), (2, (3,))):\n'
          '  log = metrics_log.MetricsLog(epath.Path("gs://bucket/run"), config, resume, {})\n'
          '  for s in steps: log.write(s, {"loss": 1.0 / s})\n'
          '  log.writer.close()\n')
  (tmp_path / 'gcs' / 'bucket' / 'run').mkdir(parents=True)
  result = run_python(code, fake_gcs_env(tmp_path / 'gcs'))
  assert result.returncode == 0, result.stderr[-2000:]
  assert losses(tmp_path / 'gcs' / 'bucket' / 'run') == {1: 1.0, 2: 0.5, 3: 1 / 3}


# 5. Fields that change nothing are refused; sharded sizes and a gs:// vocabulary are checked.

@pytest.mark.parametrize('spec, field, value, why', [
    ('c4_ablation:rw_lr,preset=tiny', 'model.laurel.k', 5, "model.laurel.variant='rw+lr' has no pa"),
    ('c4_ablation:pa,preset=tiny', 'model.laurel.rank', 16, "model.laurel.variant='pa' has no low-rank part"),
    ('c4_ablation:rw,preset=tiny', 'model.laurel.rw_per_dim', True, None),
    ('c4_ablation:lr,preset=tiny', 'model.laurel.rw_scale', 1.0, "model.laurel.variant='lr' has no rw"),
    ('residual_designs:baseline_24,preset=tiny', 'model.hc.expansion', 2,
     "only design 'hc' reads it, not model.stream.design='residual'"),
    ('residual_designs:hc,preset=tiny', 'model.mhc.mhc_readout', 'v4',
     "only design 'mhc' reads it, not model.stream.design='hc'"),
    ('residual_designs:mhc,preset=tiny', 'model.frac.fractions', 4,
     "only design 'frac' reads it, not model.stream.design='mhc'"),
    ('residual_designs:mhc_lite,preset=tiny', 'model.mhc.sinkhorn_iters', 5,
     "only design 'mhc' reads it, not model.stream.design='mhc_lite'"),
    ('residual_designs:hc,preset=tiny', 'model.laurel.variant', 'rw',
     "only design 'laurel' reads it, not model.stream.design='hc'"),
    ('c4_ablation:baseline_24,preset=tiny', 'model.laurel.rank', 16,
     "only design 'laurel' reads it, not model.stream.design='residual'"),
    ('c4_ablation:rw_lr,preset=tiny', 'model.laurel.rank', 16, None),
    ('residual_designs:mhc,preset=tiny', 'model.mhc.sinkhorn_iters', 5, None),
    ('residual_designs:baseline_24,preset=tiny', 'model.share.rank', 2, 'model.share.group_size=1 shares nothing'),
    ('c4_ablation:rw,preset=tiny', 'data.vocab_path', '/sp.model', "data.name='text' is byte-level"),
])
def test_overrides_that_change_nothing_are_refused(spec, field, value, why):
  config = step.build_config(config_lib.load(spec, [f'{field}={value}']))
  if why is None:  # a field this row uses
    assert step.check_overrides(config, config_lib.resolve_spec(spec), {field: value}) == []
    return
  with pytest.raises(config_lib.InputError, match=re.escape(f'{field}={value!r}: changes nothing: {why}')):
    step.check_overrides(config, config_lib.resolve_spec(spec), {field: value})


@pytest.mark.slow
def test_a_no_op_override_is_refused_by_main_and_sweep_and_an_echo_warned(tmp_path):
  main = [sys.executable, '-m', 'laurel.main', '--config=c4_ablation:rw_lr,preset=tiny', '--print_config']
  refused = subprocess.run(main + ['--config.model.laurel.k=5'], env=cli_env(), cwd=tmp_path, capture_output=True,
                           text=True, timeout=300)
  assert refused.returncode == 2 and refused.stderr.strip().splitlines() == [
      "error: model.laurel.k=5: changes nothing: model.laurel.variant='rw+lr' has no pa"]
  echoed = subprocess.run(main + ['--config.model.laurel.k=3'], env=cli_env(), cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
  assert echoed.returncode == 0 and json.loads(echoed.stdout)['model']['laurel']['k'] == 3
  assert "warning: model.laurel.k=3 changes nothing (model.laurel.variant='rw+lr' has no pa)" in echoed.stderr
  sweep = subprocess.run([sys.executable, str(ROOT / 'scripts' / 'sweep.py'), '--config=c4_ablation:rw_lr,preset=tiny',
                          '--field=model.laurel.k', '--values=2,4', f'--workdir={tmp_path / "sweep"}'],
                         env=cli_env(), cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert sweep.returncode == 2 and sweep.stderr.strip().splitlines()[-1].startswith(
      'error: model.laurel.k=2: changes nothing'), sweep.stderr[-2000:]
  assert not (tmp_path / 'sweep').exists()


@pytest.mark.parametrize('mesh, message', [
    ({'mesh.tensor': 8}, 'model.num_heads=4: is sharded over mesh axes tensor (8 devices'),
    ({'mesh.tensor': 2, 'model.d_ff': 63}, 'model.d_ff=63: is sharded over mesh axes tensor'),
    ({'mesh.tensor': 2, 'model.vocab_size': 265}, 'model.vocab_size=265: is sharded'),
    ({'mesh.fsdp': 8, 'model.d_model': 36, 'model.num_heads': 2}, 'model.d_model=36: is sharded'),
])
def test_sharded_dimensions_must_divide_the_mesh(mesh, message):
  with pytest.raises(config_lib.InputError, match=re.escape(message)):
    step.validate_config(load_config(SPEC, {**TINY_LM, **mesh}), num_devices=8)


def test_vocab_size_is_checked_against_a_gs_tokenizer(sp_model, monkeypatch):
  gs_vocab = 'gs://bucket/sp.model'  # validate() leaves it alone: only the training hosts may reach GCS
  monkeypatch.setattr(data, '_read_vocab', lambda path: pathlib.Path(sp_model).read_bytes())
  monkeypatch.setattr(data, 'c4_shards', lambda path, split, name='c4': [f'{path}/{name}-{split}.00000-of-00001.array_record'])
  monkeypatch.setattr(data, 'num_records', lambda shards: 1)  # the shards' footers would be read from GCS
  config = load_config(SPEC, {**TINY_LM, 'data.name': 'c4', 'data.path': 'gs://bucket/c4', 'data.vocab_path': gs_vocab,
                              'model.vocab_size': 32})
  task = step.validate_config(config, num_devices=1)
  with pytest.raises(config_lib.InputError, match=re.escape(
      f"model.vocab_size=32: smaller than the tokenizer's 40 (data.vocab_path='{gs_vocab}')")):
    preflight.check_lm_data(task.data_cfg, task.model_cfg.vocab_size)


# 6. --config=WORKDIR resumes with the config the run saved; a changed `steps` is printed.

@pytest.mark.slow
def test_resume_from_the_saved_config_in_one_command(run_with_three_checkpoints, tmp_path):
  workdir = tmp_path / 'run'
  shutil.copytree(run_with_three_checkpoints, workdir)
  result = subprocess.run([sys.executable, '-m', 'laurel.main', f'--config={workdir}', f'--workdir={workdir}',
                           '--config.steps=10'], env=cli_env(), cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
  assert result.returncode == 0, result.stderr[-2000:]
  assert 'resuming checkpoint 9 with a changed config: steps=9 (now 10)' in result.stdout
  assert 'resumed from checkpoint 9' in result.stdout and max(losses(workdir)) == 10
  saved = json.loads((workdir / 'config.json').read_text())
  assert config_lib.to_dict(step.build_config(config_lib.load(str(workdir / 'config.json')))) == saved


def _in_the_old_shape(saved: dict) -> dict:
  """A saved config (config.json's, a checkpoint's signature) as code before issue 52 wrote it: every design's section
  at its defaults, and LAuReL as design 'residual' with `laurel.variant` ('none' for the plain residual)."""
  model = saved['model']
  every = {d.section: config_lib.to_dict(d.config()) for d in designs.REGISTRY.values()
           if dataclasses.fields(d.config)}
  laurel = model.get('laurel', {**every['laurel'], 'variant': 'none'})
  return {**saved, 'model': {**model, **every, 'stream': {'design': 'residual'}, 'laurel': laurel}}


@pytest.mark.parametrize('row', ['baseline_24', 'rw_lr_pa'])
def test_a_signature_in_the_old_shape_is_no_change_of_config(row):
  config = typed_config(f'configs/c4_ablation.py:{row},preset=tiny', TINY_LM)
  old = _in_the_old_shape(config_lib.to_dict(config))
  assert {'laurel', 'hc', 'mhc', 'denseformer', 'dca_k'} <= set(old['model'])  # every design's section
  assert checkpoint.config_changes(old, config) == ({}, [])
  assert saved_config.upgrade(old) == config_lib.to_dict(config)


@pytest.mark.slow
def test_a_run_saved_in_the_old_shape_loads_for_sampling_and_resumes(run_with_three_checkpoints, tmp_path):
  """A run saved before LAuReL was a design of its own name (issue 52): config.json and every checkpoint's config
  signature hold every design's section and design 'residual' with `laurel.variant`. Made here from a run of today's
  code, rewritten so; its parameter names are LAuReL's as ever. It loads for sampling and --config=WORKDIR, and
  resumes in one command with no refusal."""
  workdir = tmp_path / 'run'
  shutil.copytree(run_with_three_checkpoints, workdir)
  path = workdir / 'config.json'
  path.write_text(json.dumps(_in_the_old_shape(json.loads(path.read_text())), indent=2))
  for step_dir in (workdir / 'checkpoints').iterdir():
    signature = step_dir / 'config' / 'metadata'
    signature.write_text(json.dumps(_in_the_old_shape(json.loads(signature.read_text()))))
    checksums.record(step_dir)  # its list vouches for the rewritten signature, as the old run's did
  assert json.loads(path.read_text())['model']['hc'] == {'expansion': 4, 'hc_dynamic': False}

  config = step.build_config(config_lib.load(str(workdir)))  # --config=WORKDIR
  assert config.model.stream == StreamSpec('laurel', variant='rw+lr+pa', rank=8, k=3)
  with loader.lm_run_on_mesh(workdir) as (task, params, number, _):  # what sampling and scoring read
    assert number == 9 and task.config == config and 'laurel_rw' in params
  result = subprocess.run([sys.executable, '-m', 'laurel.main', f'--config={workdir}', f'--workdir={workdir}',
                           '--config.steps=10'], env=cli_env(), cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
  assert result.returncode == 0, result.stderr[-2000:]
  assert 'resuming checkpoint 9 with a changed config: steps=9 (now 10)\n' in result.stdout
  assert 'design laurel rw+lr+pa r=8 k=3' in result.stdout and 'resumed from checkpoint 9' in result.stdout
  saved = json.loads(path.read_text())  # rewritten as the resumed run's: today's shape
  assert saved['model']['stream'] == {'design': 'laurel'} and 'hc' not in saved['model'] and max(losses(workdir)) == 10


# 7. Inference reads the parameters only, into their shardings, and passes them to its programs as arguments.

@pytest.fixture(scope='module')
def run_without_optimizer_state(tmp_path_factory):
  """A run on a (2, 2, 2) mesh whose checkpoint holds no optimizer state at all: only a restore that never reads
  it succeeds."""
  workdir = tmp_path_factory.mktemp('params_only') / 'run'
  config = load_config(SPEC, {**TINY_LM, 'steps': 3, 'checkpoint_every': 3, 'mesh.data': 2, 'mesh.fsdp': 2,
                              'mesh.tensor': 2})
  train.train(config, str(workdir), devices=jax.devices())
  with ocp.CheckpointManager(workdir / 'checkpoints') as mngr:
    state = mngr.restore(3, args=ocp.args.Composite(state=ocp.args.StandardRestore()))['state']
    signature = mngr.restore(3, args=ocp.args.Composite(config=ocp.args.JsonRestore()))['config']
  shutil.rmtree(workdir / 'checkpoints')
  with ocp.CheckpointManager(workdir / 'checkpoints') as mngr:
    params_only = {'step': state['step'], 'params': state['params']}
    mngr.save(3, args=ocp.args.Composite(state=ocp.args.StandardSave(params_only), config=ocp.args.JsonSave(signature)))
  return workdir, state['params']


@pytest.mark.slow
def test_inference_reads_only_the_params_into_their_shardings(run_without_optimizer_state):
  workdir, saved = run_without_optimizer_state
  with loader.lm_run_on_mesh(workdir) as (_, params, step, mesh):
    assert step == 3 and dict(mesh.shape) == {'data': 2, 'fsdp': 2, 'tensor': 2}
    embedding = params['embed']['embedding']
    assert embedding.sharding.spec == P('tensor', 'fsdp') and embedding.sharding.mesh.shape == mesh.shape
    assert len(embedding.addressable_shards) == 8 and embedding.addressable_shards[0].data.shape == (132, 16)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(params), saved)


def _large_constants(dump_dir) -> int:
  """Elements of every constant that is not one repeated value, over the modules jax lowered into `dump_dir`."""
  total = 0
  for path in pathlib.Path(dump_dir).glob('*.mlir'):
    for value, dims in re.findall(r'stablehlo\.constant dense<("[^"]*"|\[[^>]*\])> : tensor<([\dx]*)x?\w+>',
                                  path.read_text()):
      total += int(np.prod([int(d) for d in dims.split('x') if d]))
  return total


@pytest.mark.slow
def test_no_parameter_is_a_constant_of_the_compiled_programs(run_without_optimizer_state, tmp_path):
  workdir, saved = run_without_optimizer_state
  num_params = sum(x.size for x in jax.tree.leaves(saved))
  previous = jax.config.read('jax_dump_ir_to')
  jax.config.update('jax_dump_ir_to', str(tmp_path / 'ir'))
  try:
    with loader.lm_run_on_mesh(workdir) as (task, params, _, mesh):
      for use_cache in (True, False):
        generate.generate(task.model_cfg, params, [[3, 4, 5], [6]], 3, use_cache=use_cache)
      scorer = evaluate.Scorer(task.model, params, task.config.data.seq_len, 4, 0,
                               jax.sharding.NamedSharding(mesh, P(('data', 'fsdp'))))
      scorer([([3, 4, 5, 6], 1)])
  finally:
    jax.config.update('jax_dump_ir_to', previous)
  assert len(list((tmp_path / 'ir').glob('*.mlir'))) >= 3
  assert _large_constants(tmp_path / 'ir') < num_params / 100


# 8. A watchdog ends a process whose step hangs, naming host and step.

@pytest.mark.slow
def test_a_stalled_step_ends_the_process_naming_host_and_step(tmp_path, monkeypatch, capsys):
  exits, released = [], threading.Event()
  monkeypatch.setattr(train.os, '_exit', lambda code: (exits.append(code), released.set()))
  compile_step = train.compile_step

  class Stalling:  # the compiled step, whose 8th call waits until the watchdog has fired
    def __init__(self, compiled):
      self.compiled, self.calls = compiled, 0

    def __getattr__(self, name):
      return getattr(self.compiled, name)

    def __call__(self, *args):
      self.calls += 1
      if self.calls == 8:
        released.wait(120)
      return self.compiled(*args)

  def stalling_compile_step(*args):
    compiled, *rest = compile_step(*args)
    return (Stalling(compiled), *rest)

  monkeypatch.setattr(train, 'compile_step', stalling_compile_step)
  config = load_config(SPEC, {**TINY_LM, 'steps': 10, 'watchdog_factor': 10.0, 'watchdog_min_s': 3.0,
                              'watchdog_s': 0.0})
  train.train(config, str(tmp_path), devices=jax.devices()[:1])
  assert exits == [process.HUNG]
  err = capsys.readouterr().err
  line = next(l for l in err.splitlines() if l.startswith('error: watchdog'))
  assert re.match(r'error: watchdog: no progress for \d+\.\ds after step 7 \(limit 3\.0s\) on process 0 of 1 on '
                  r'host \S+; exiting with status 75', line), line
  assert 'released.wait' in err  # every thread's stack: where it hung


def test_the_watchdog_limit_covers_the_first_step_and_the_median():
  fired = []
  watchdog = process.Watchdog(factor=4.0, min_s=0.0, limit_s=0.3)
  watchdog._fire = lambda stalled, limit: fired.append((watchdog.step, limit))  # pylint: disable=protected-access
  watchdog.start()
  try:
    threading.Event().wait(0.6)  # nothing ran: the absolute limit
    assert fired == [(None, 0.3)]
  finally:
    watchdog.stop()
  watchdog = process.Watchdog(factor=4.0, min_s=0.0, limit_s=0.0)
  for step in range(1, process.Watchdog.WARMUP + 4):
    watchdog.beat(step)
    threading.Event().wait(0.02)
  assert 0.02 * 4 <= watchdog.limit() < 1.0  # 4 x the median step time, the warm-up steps left out


@pytest.mark.slow
def test_the_watchdog_counts_no_stall_while_the_process_was_stopped(monkeypatch):
  """SIGSTOP then SIGCONT (a suspended job) stops the watchdog's thread too: its poll comes back late by the pause,
  which is then no stall; a stall after the resumption still fires."""
  paused = [0.0]
  monkeypatch.setattr(train.time, 'monotonic', lambda real=time.monotonic: real() + paused[0])
  fired = []
  watchdog = process.Watchdog(factor=0.0, min_s=0.0, limit_s=2.0)  # margins for a loaded machine's thread wake-ups
  watchdog._fire = lambda stalled, limit: fired.append(stalled)  # pylint: disable=protected-access
  watchdog.start()
  try:
    threading.Event().wait(0.2)
    paused[0] = 3600.0  # an hour stopped, seen at the next poll
    threading.Event().wait(0.5)
    assert not fired
    for _ in range(60):  # no progress since the resumption: a stall, told within 3 s
      if fired:
        break
      threading.Event().wait(0.05)
    assert len(fired) == 1 and 2.0 < fired[0] < 10
  finally:
    watchdog.stop()


def test_a_run_saved_before_a_field_existed_resumes_at_its_default_and_not_at_another(tmp_path):
  """A field added since a run was saved (absent from its config.json and its checkpoint's signature) trained at
  its default: resuming at the default is no change; at another value it is refused, naming the default."""
  config = typed_config('configs/c4_ablation.py:baseline_24,preset=tiny', TINY_LM)
  saved = config_lib.to_dict(config)
  del saved['model']['attention_scores'], saved['optimizer']['min_lr_ratio']
  (tmp_path / 'checkpoints' / '6').mkdir(parents=True)
  (tmp_path / 'config.json').write_text(json.dumps(saved))
  checkpoint.guard_config(config, tmp_path)
  assert checkpoint.config_changes(saved, config) == ({}, [])

  (tmp_path / 'config.json').write_text(json.dumps(saved))
  config = dataclasses.replace(config, model=dataclasses.replace(config.model, attention_scores='bfloat16'))
  assert checkpoint.config_changes(saved, config)[1] == ['model.attention_scores']
  with pytest.raises(config_lib.InputError, match=r"model\.attention_scores='float32' \(now 'bfloat16'\)"):
    checkpoint.guard_config(config, tmp_path)


# 6. A stop in the final eval is no finished run: its phase line says so, and the rerun logs the eval and its timing.

@pytest.mark.slow
def test_sigterm_in_the_final_eval_is_told_and_the_rerun_logs_its_eval_and_timing(tmp_path, monkeypatch, capsys):
  config = load_config(SPEC, {**TINY_LM, 'eval_steps': 3})  # eval and checkpoint at the last step only
  beat = process.Watchdog.beat

  def terminated_after_an_eval_batch(watchdog, step=None):  # beat() without a step: an eval batch is done
    if step is None:
      signal.raise_signal(signal.SIGTERM)
    beat(watchdog, step)

  monkeypatch.setattr(process.Watchdog, 'beat', terminated_after_an_eval_batch)
  assert train.train(config, str(tmp_path), devices=jax.devices()[:1]) == {'step': 6, 'preempted': True}
  out = capsys.readouterr().out
  assert re.search(r'^evaluating on 3 batches: interrupted \(SIGTERM\) after ', out, re.M), out[-1000:]
  assert 'evaluating on 3 batches: done' not in out and not (tmp_path / 'final.json').exists()
  monkeypatch.undo()
  final = train.train(config, str(tmp_path), devices=jax.devices()[:1])
  assert 'evaluating on 3 batches: done' in capsys.readouterr().out
  rows = [json.loads(l) for l in (tmp_path / 'metrics.jsonl').read_text().splitlines()]
  assert [r['step'] for r in rows if 'eval_loss' in r] == [6] and final['eval_loss'] == rows[-1]['eval_loss']
  assert final['median_step_time_s'] == np.median([r['step_time_s'] for r in rows if 'step_time_s' in r]) > 0
