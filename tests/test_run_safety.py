"""A run is never silently split, restarted or truncated (issue 22): a TPU VM's start that fails loudly, checkpoints
moved aside only for damage, bad input told apart from bugs, a resume past a torn log and on a filesystem without
appends, no-op fields refused, resuming from the saved config, inference that reads only the sharded parameters, and
a watchdog for hung steps."""
import dataclasses
import errno
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import threading
import types

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import PartitionSpec as P

from helpers import (CLUSTER_VARIABLES, ROOT, SPEC, TINY_LM, TRAINED, cli_args, cli_env, fake_gcs_env, load_config,
                     losses, on_devices, run_python, run_script, train_cli,
                     tree_snapshot, typed_config)
from laurel import command_line, config_lib, data, designs, main, step, train, train_config
from laurel.designs import StreamSpec
from laurel.plan import preflight
from laurel.cli import process
from laurel.run import checkpoint, cluster, metrics_log
from laurel.serve import loader
from laurel.serve import evaluate, generate


@pytest.fixture
def run_with_three_checkpoints(trained_run):  # conftest's, trained once per test process
  return trained_run


# 1. A TPU VM trains alone only where its slice provably has one host.

@pytest.mark.parametrize('hosts, trains', [({'TPU_WORKER_HOSTNAMES': 'w0,w1,w2,w3'}, False),
                                           ({'GCE_METADATA_IP': '127.0.0.1:9'}, False),  # the host count is unknown
                                           ({'TPU_WORKER_HOSTNAMES': 'w0'}, True)])
def test_a_failed_start_on_a_tpu_vm_trains_alone_only_on_one_host(monkeypatch, capsys, caplog, hosts, trains):
  for name in [n for n in os.environ if n.startswith(('TPU_', 'GCE_', 'MEGASCALE', *CLUSTER_VARIABLES))]:
    monkeypatch.delenv(name)
  for name, value in hosts.items():
    monkeypatch.setenv(name, value)

  def refuse(**_):
    raise RuntimeError('no coordinator answered')
  monkeypatch.setattr(jax.distributed, 'initialize', refuse)
  monkeypatch.setattr(cluster, 'on_tpu_vm', lambda: True)
  monkeypatch.setattr(train, 'train', lambda *a, **k: print('TRAINED ALONE') or {})
  status = main.main(['laurel-train', f'--config={ROOT}/configs/c4_ablation.py:rw,preset=tiny', '--workdir=unused'])
  out, err = capsys.readouterr()
  if trains:
    assert status == 0 and 'TRAINED ALONE' in out, err[-2000:]
    assert 'running as one process' in caplog.text
  else:
    assert status == process.ERROR and 'TRAINED ALONE' not in out, err[-2000:]
    lines = [l for l in err.splitlines() if l.startswith('error:')]
    assert len(lines) == 1 and 'jax.distributed.initialize() failed' in lines[0] and 'no coordinator' in lines[0]


# 2. Only a checkpoint whose own data is missing or corrupt is moved aside; the log keeps every line.

@pytest.mark.slow
def test_damaged_checkpoints_are_moved_aside_and_no_step_is_logged_twice(run_with_three_checkpoints, tmp_path,
                                                                          capsys):
  workdir = tmp_path / 'run'
  shutil.copytree(run_with_three_checkpoints, workdir)
  logged = [json.loads(l) for l in (workdir / 'metrics.jsonl').read_text().splitlines()]
  data_file = max((workdir / 'checkpoints' / '9' / 'state').rglob('d/*'), key=lambda p: p.stat().st_size)
  data_file.write_bytes(data_file.read_bytes()[:data_file.stat().st_size // 2])  # a truncated array file
  (workdir / 'checkpoints' / '6' / 'state' / '_METADATA').unlink()  # a deleted metadata file
  status, out, err = train_cli(capsys, SPEC, workdir, TRAINED)  # the run's own step: compiled already
  assert status == 0, err[-3000:]
  assert 'checkpoint 9 is damaged (state/' in err and 'checkpoint 6 is damaged (state/_METADATA is missing)' in err
  assert 'resumed from checkpoint 3' in out
  assert sorted(p.name.split('.')[0] for p in (workdir / 'unreadable_checkpoints').iterdir()) == ['6', '9']
  rows = [json.loads(l) for l in (workdir / 'metrics.jsonl').read_text().splitlines()]
  assert rows[:3] == logged[:3]  # up to the checkpoint it resumed; steps 4-9 again, once, after a line that says why
  assert [r['step'] for r in rows if 'loss' in r] == list(range(1, 10)) and rows[3]['moved_aside'] == [9, 6]
  assert losses(workdir) == {r['step']: r['loss'] for r in logged if 'loss' in r}


def _restore_args(workdir):
  config = load_config(SPEC, {**TINY_LM, 'steps': 9, 'checkpoint_every': 3})
  task = train_config.validate_config(config, num_devices=1)
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

def _raise(error):
  def fail(*_, **__):
    raise error
  return fail


@pytest.mark.parametrize('error, status', [
    (ValueError('a message from a library'), None),
    (config_lib.InputError('a message from a library'), process.BAD_INPUT),
    (OSError(errno.EROFS, 'Read-only file system', 'w/metrics.jsonl'), process.ERROR)])
def test_only_what_an_operator_can_act_on_is_one_line(monkeypatch, capsys, error, status):
  """laurel.main: bad input (2) and a write the storage refused (1) are one line; anything else keeps its traceback."""
  monkeypatch.setattr(train, 'train', _raise(error))
  argv = ['laurel-train', f'--config={ROOT}/configs/c4_ablation.py:rw,preset=tiny', '--workdir=w']
  if status is None:
    with pytest.raises(ValueError, match='a message from a library'):
      main.main(argv)
    return
  assert main.main(argv) == status
  assert capsys.readouterr().err.splitlines() == [
      'error: a message from a library' if status == process.BAD_INPUT else
      'error: a write failed: EROFS (Read-only file system): w/metrics.jsonl; rerun the same command to resume once it '
      'is writable']


ENTRY_POINTS = {  # module: (what to make raise, argv)
    'laurel.serve.generate': ('laurel.serve.loader.lm_run_on_mesh', '"--workdir=w", "--prompt=x"'),
    'laurel.serve.evaluate': ('laurel.serve.loader.lm_run_on_mesh', '"--workdir=w", "--task=hellaswag"'),
}


@pytest.mark.slow
@pytest.mark.parametrize('module', ENTRY_POINTS)
def test_only_bad_input_is_a_one_line_error_of_the_serving_commands(module):
  patch, argv = ENTRY_POINTS[module]
  owner, _, name = patch.rpartition('.')
  code = (f'import importlib, sys\nfrom absl import app\nfrom laurel import config_lib\n'
          f'm, owner = importlib.import_module({module!r}), importlib.import_module({owner!r})\n'
          f'def fail(*a, **k): raise ValueError("a message from a library")\n'
          f'owner.{name} = fail\nsys.argv = ["x", {argv}]\n'
          f'm.run() if hasattr(m, "run") else app.run(m.main, flags_parser=command_line.parse_flags)\n')
  result = run_python(code)
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
    train_config.validate_config(load_config(SPEC, {**TINY_LM, 'steps': 0}), num_devices=1)


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
  code = ('import json\nfrom etils import epath\nfrom laurel import train_config\nfrom laurel.run import metrics_log\n'
          'config = train_config.TrainConfig(tensorboard=False)\n'
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
  config = train_config.build_config(command_line.load(spec, [f'{field}={value}']))
  if why is None:  # a field this row uses
    assert command_line.check_overrides(config, command_line.resolve_spec(spec), {field: value}) == []
    return
  with pytest.raises(config_lib.InputError, match=re.escape(f'{field}={value!r}: changes nothing: {why}')):
    command_line.check_overrides(config, command_line.resolve_spec(spec), {field: value})


@pytest.mark.slow
def test_a_no_op_override_is_refused_by_main_and_sweep_and_an_echo_warned(tmp_path, capsys):
  argv = ['laurel-train', '--config=c4_ablation:rw_lr,preset=tiny', '--print_config']
  assert main.main(argv + ['--config.model.laurel.k=5']) == 2
  assert capsys.readouterr().err.splitlines() == [
      "error: model.laurel.k=5: changes nothing: model.laurel.variant='rw+lr' has no pa"]
  assert main.main(argv + ['--config.model.laurel.k=3']) == 0
  out, err = capsys.readouterr()
  assert json.loads(out)['model']['laurel']['k'] == 3
  assert "warning: model.laurel.k=3 changes nothing (model.laurel.variant='rw+lr' has no pa)" in err
  sweep = run_script('sweep.py', '--config=c4_ablation:rw_lr,preset=tiny', '--field=model.laurel.k', '--values=2,4',
                     f'--workdir={tmp_path / "sweep"}')  # refused before any point starts: in this process
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
    train_config.validate_config(load_config(SPEC, {**TINY_LM, **mesh}), num_devices=8)


def test_vocab_size_is_checked_against_a_gs_tokenizer(sp_model, monkeypatch):
  gs_vocab = 'gs://bucket/sp.model'  # validate() leaves it alone: only the training hosts may reach GCS
  monkeypatch.setattr(data, '_read_vocab', lambda path: pathlib.Path(sp_model).read_bytes())
  monkeypatch.setattr(data, 'c4_shards', lambda path, split, name='c4': [f'{path}/{name}-{split}.00000-of-00001.array_record'])
  monkeypatch.setattr(data, 'num_records', lambda shards: 1)  # the shards' footers would be read from GCS
  config = load_config(SPEC, {**TINY_LM, 'data.name': 'c4', 'data.path': 'gs://bucket/c4', 'data.vocab_path': gs_vocab,
                              'model.vocab_size': 32})
  task = train_config.validate_config(config, num_devices=1)
  with pytest.raises(config_lib.InputError, match=re.escape(
      f"model.vocab_size=32: smaller than the tokenizer's 40 (data.vocab_path='{gs_vocab}')")):
    preflight.check_lm_data(task.data_cfg, task.model_cfg.vocab_size)


# 6. --config=WORKDIR resumes with the config the run saved; a changed `steps` is printed.

@pytest.mark.slow
def test_resume_from_the_saved_config_in_one_command(run_with_three_checkpoints, tmp_path, capsys):
  workdir = tmp_path / 'run'
  shutil.copytree(run_with_three_checkpoints, workdir)
  with on_devices():
    assert main.main(['laurel-train', f'--config={workdir}', f'--workdir={workdir}', '--config.steps=10']) == 0
  out = capsys.readouterr().out
  assert 'resuming checkpoint 9 with a changed config: steps=9 (now 10)' in out
  assert 'resumed from checkpoint 9' in out and max(losses(workdir)) == 10
  saved = json.loads((workdir / 'config.json').read_text())
  assert config_lib.to_dict(train_config.build_config(command_line.load(str(workdir / 'config.json')))) == saved


def _vouch_again(step_dir, name: str) -> None:
  """A checkpoint's list with the entry of `name` written anew, as if the file had been saved so."""
  listing = json.loads((step_dir / checkpoint.LIST).read_text())
  listing['files'][name] = [checkpoint.checksum(step_dir / name), (step_dir / name).stat().st_size]
  (step_dir / checkpoint.LIST).write_text(json.dumps(listing))


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
  assert train_config.config_changes(old, config) == ({}, [])
  assert train_config.upgrade(old) == config_lib.to_dict(config)


@pytest.mark.slow
def test_a_run_saved_in_the_old_shape_loads_for_sampling_and_resumes(run_with_three_checkpoints, tmp_path, capsys):
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
    _vouch_again(step_dir, 'config/metadata')  # its list vouches for the rewritten signature, as the old run's did
  assert json.loads(path.read_text())['model']['hc'] == {'expansion': 4, 'hc_dynamic': False}

  config = train_config.build_config(command_line.load(str(workdir)))  # --config=WORKDIR
  assert config.model.stream == StreamSpec('laurel', variant='rw+lr+pa', rank=8, k=3)
  with loader.lm_run_on_mesh(workdir) as (task, params, number, _):  # what sampling and scoring read
    assert number == 9 and task.config == config and 'laurel_rw' in params
  with on_devices():
    assert main.main(['laurel-train', f'--config={workdir}', f'--workdir={workdir}', '--config.steps=10']) == 0
  out = capsys.readouterr().out
  assert 'resuming checkpoint 9 with a changed config: steps=9 (now 10)\n' in out
  assert 'design laurel rw+lr+pa r=8 k=3' in out and 'resumed from checkpoint 9' in out
  saved = json.loads(path.read_text())  # rewritten as the resumed run's: today's shape
  assert saved['model']['stream'] == {'design': 'laurel'} and 'hc' not in saved['model'] and max(losses(workdir)) == 10


# 7. Inference reads the parameters only, into their shardings, and passes them to its programs as arguments.

@pytest.fixture(scope='module')
def run_without_optimizer_state(tmp_path_factory):
  """A run on a (2, 2, 2) mesh whose checkpoint holds no optimizer state at all: only a restore that never reads
  it succeeds."""
  workdir = tmp_path_factory.mktemp('params_only') / 'run'
  # test_train's mesh (2, 2, 2) run: its step compiled once for both
  config = load_config(SPEC, {**TINY_LM, 'mesh.data': 2, 'mesh.fsdp': 2, 'mesh.tensor': 2})
  train.train(config, str(workdir), devices=jax.devices())
  with ocp.CheckpointManager(workdir / 'checkpoints') as mngr:
    state = mngr.restore(6, args=ocp.args.Composite(state=ocp.args.StandardRestore()))['state']
    signature = mngr.restore(6, args=ocp.args.Composite(config=ocp.args.JsonRestore()))['config']
  shutil.rmtree(workdir / 'checkpoints')
  with ocp.CheckpointManager(workdir / 'checkpoints') as mngr:
    params_only = {'step': state['step'], 'params': state['params']}
    mngr.save(6, args=ocp.args.Composite(state=ocp.args.StandardSave(params_only), config=ocp.args.JsonSave(signature)))
  checkpoint.record(workdir / 'checkpoints' / '6', workdir / 'checkpoints' / '6')  # as a run's save lists it
  return workdir, state['params']


@pytest.mark.slow
def test_inference_reads_only_the_params_into_their_shardings(run_without_optimizer_state):
  workdir, saved = run_without_optimizer_state
  with loader.lm_run_on_mesh(workdir) as (_, params, step, mesh):
    assert step == 6 and dict(mesh.shape) == {'data': 2, 'fsdp': 2, 'tensor': 2}
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


# 8. A watchdog (faulthandler's) ends a process whose step hangs, with every thread's stack.

STALLING = ('import sys, time\nfrom laurel import main, train\n'
            'compile_step = train.compile_step\n'
            'class Stalling:  # the compiled step, whose 8th call never returns\n'
            '  def __init__(self, compiled):\n'
            '    self.compiled, self.calls = compiled, 0\n'
            '  def __getattr__(self, name):\n'
            '    return getattr(self.compiled, name)\n'
            '  def __call__(self, *args):\n'
            '    self.calls += 1\n'
            '    if self.calls == 8:\n'
            '      time.sleep(600)  # a collective one host never entered\n'
            '    return self.compiled(*args)\n'
            'train.compile_step = lambda *args: (lambda c, *rest: (Stalling(c), *rest))(*compile_step(*args))\n'
            'sys.argv = ["laurel-train", *sys.argv[1:]]\n'
            'main.run()\n')


@pytest.mark.slow
@pytest.mark.process
def test_a_stalled_step_ends_the_process_with_every_threads_stack(tmp_path):
  # trained_run's 9 steps: its step compiled already
  overrides = {**TINY_LM, 'steps': 9, 'watchdog_factor': 10.0, 'watchdog_min_s': 3.0, 'watchdog_s': 0.0}
  result = subprocess.run([sys.executable, '-c', STALLING, *cli_args(SPEC, tmp_path, overrides)[3:]], env=cli_env(),
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert result.returncode == process.ERROR, result.stderr[-3000:]
  assert re.search(r'^Timeout \(0:00:03\)!$', result.stderr, re.M), result.stderr[-3000:]
  assert 'in __call__' in result.stderr and 'step 7/9' in result.stdout and 'step 8/9' not in result.stdout


def test_the_watchdog_limit_is_the_absolute_one_then_the_median_after_the_first_steps(monkeypatch):
  armed = []
  monkeypatch.setattr(train.faulthandler, 'dump_traceback_later', lambda timeout, **_: armed.append(timeout))
  run = types.SimpleNamespace(config=types.SimpleNamespace(watchdog_factor=4.0, watchdog_min_s=0.0, watchdog_s=0.3),
                              progress=[])
  watchdog = train.Watchdog(run)
  assert armed == [0.3] and run.progress == [watchdog.beat]  # before the first step: the absolute limit
  for step in range(1, train.Watchdog.WARMUP + 4):
    threading.Event().wait(0.02)
    watchdog.after_step(run, step, None)
  assert 0.02 * 4 <= armed[-1] <= 0.3
  run.config.watchdog_s = 0.0
  watchdog.beat()
  assert 0.02 * 4 <= armed[-1] < 1.0  # 4 x the median step time, the warm-up steps left out


def test_a_run_saved_before_a_field_existed_resumes_at_its_default_and_not_at_another(tmp_path):
  """A field added since a run was saved (absent from its config.json and its checkpoint's signature) trained at
  its default: resuming at the default is no change; at another value it is refused, naming the default."""
  config = typed_config('configs/c4_ablation.py:baseline_24,preset=tiny', TINY_LM)
  saved = config_lib.to_dict(config)
  del saved['model']['attention_scores'], saved['optimizer']['min_lr_ratio']
  (tmp_path / 'checkpoints' / '6').mkdir(parents=True)
  (tmp_path / 'config.json').write_text(json.dumps(saved))
  checkpoint.guard_config(config, tmp_path)
  assert train_config.config_changes(saved, config) == ({}, [])

  (tmp_path / 'config.json').write_text(json.dumps(saved))
  config = dataclasses.replace(config, model=dataclasses.replace(config.model, attention_scores='bfloat16'))
  assert train_config.config_changes(saved, config)[1] == ['model.attention_scores']
  with pytest.raises(config_lib.InputError, match=r"model\.attention_scores='float32' \(now 'bfloat16'\)"):
    checkpoint.guard_config(config, tmp_path)


# 6. A stop in the final eval is no finished run: its phase line says so, and the rerun logs the eval and its timing.

@pytest.mark.slow
def test_sigterm_in_the_final_eval_is_told_and_the_rerun_logs_its_eval_and_timing(tmp_path, monkeypatch, capsys):
  config = load_config(SPEC, {**TINY_LM, 'eval_steps': 3})  # eval and checkpoint at the last step only
  beat = train.Watchdog.beat

  def terminated_after_an_eval_batch(watchdog, stepped=False):  # beat() of no step: an eval batch is done
    if not stepped:
      signal.raise_signal(signal.SIGTERM)
    beat(watchdog, stepped)

  monkeypatch.setattr(train.Watchdog, 'beat', terminated_after_an_eval_batch)
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
