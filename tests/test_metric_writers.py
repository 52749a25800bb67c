"""laurel.run.metric_writers: TensorBoard without TensorFlow (event files read back by tensorboard's own reader), the
profiler, steps_per_sec, W&B offline (its run file read back), and the one-line errors of missing extras."""

import glob
import json
import pathlib
import struct
import subprocess
import sys

import jax
import pytest
from tensorboard.backend.event_processing import event_accumulator
from tensorboard.plugins.hparams import metadata as hparams_metadata
from tensorboard.plugins.hparams import plugin_data_pb2
from tensorboard.util import tensor_util

from helpers import ROOT, TINY_LM, cli_args, cli_env, fake_gcs_env, load_config, metrics, typed_config
from laurel import config_lib, train
from laurel.plan import preflight
from laurel.run import metric_writers, metrics_log
from laurel.serve import evaluate

SPEC = 'configs/c4_ablation.py:rw_lr,preset=tiny'


def _tensorboard_scalars(logdir) -> dict:
  """{tag: {step: value}} of every scalar in the event files under `logdir`."""
  events = event_accumulator.EventAccumulator(str(logdir), size_guidance={event_accumulator.TENSORS: 0})
  events.Reload()
  return {tag: {e.step: float(tensor_util.make_ndarray(e.tensor_proto)) for e in events.Tensors(tag)}
          for tag in events.Tags()['tensors'] if tag != hparams_metadata.SESSION_START_INFO_TAG}


def _tensorboard_hparams(logdir) -> dict:
  events = event_accumulator.EventAccumulator(str(logdir))
  events.Reload()
  content = events.PluginTagToContent(hparams_metadata.PLUGIN_NAME)[hparams_metadata.SESSION_START_INFO_TAG]
  info = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info
  return {k: getattr(v, v.WhichOneof('kind')) for k, v in info.hparams.items()}


@pytest.mark.slow
def test_a_run_writes_the_logged_scalars_and_hparams_to_tensorboard(tmp_path):
  config = load_config(SPEC, {**TINY_LM, 'steps': 4, 'log_every': 2, 'eval_every': 4, 'tensorboard': True})
  train.train(config, str(tmp_path), devices=jax.devices()[:1])
  logged = {}
  for row in metrics(tmp_path):
    for k, v in row.items():
      if isinstance(v, (int, float)) and k not in ('step', 'time'):
        logged.setdefault(k, {})[row['step']] = v
  scalars = _tensorboard_scalars(tmp_path / 'tensorboard')
  assert {'loss', 'eval_loss', 'tokens_per_s', 'steps_per_sec', 'uptime'} <= set(scalars)
  # RW's α and β of its 3 sites (laurel.designs, Design.diagnostics): at the logging steps, training metrics only
  reported = {f'laurel/{name}_{s:02d}' for name in ('alpha', 'beta') for s in range(3)}
  assert {tag for tag in scalars if '/' in tag} == reported and all(sorted(scalars[t]) == [2, 4] for t in reported)
  assert not any('laurel' in key for key in json.loads((tmp_path / 'final.json').read_text()))
  for name, by_step in logged.items():  # float32 in the event files
    assert scalars[name] == pytest.approx(by_step, rel=1e-6), name
  assert sorted(scalars['steps_per_sec']) == [2, 4]  # every log_every steps, the first step only starts the clock
  hparams = _tensorboard_hparams(tmp_path / 'tensorboard')
  assert hparams['model.d_model'] == 32 and hparams['row'] == 'rw_lr' and hparams['tensorboard'] is True


class _Recorder:
  def __init__(self):
    self.calls = []

  def write_scalars(self, step, scalars):
    self.calls.append((step, sorted(scalars)))


def test_progress_reports_steps_per_sec_every_interval_and_at_the_last_step():
  recorder = _Recorder()
  progress = train.Progress(recorder, every=3, total=7)
  for done in range(3, 8):  # a run resumed at step 2
    progress.after_step(None, done, None)
  assert recorder.calls == [(6, ['steps_per_sec', 'uptime']), (7, ['steps_per_sec', 'uptime'])]


def test_profiler_traces_the_configured_steps_only(monkeypatch):
  calls = []
  monkeypatch.setattr(jax.profiler, 'start_trace', lambda logdir: calls.append(('start', logdir)))
  monkeypatch.setattr(jax.profiler, 'stop_trace', lambda: calls.append('stop'))
  profiler = train.Profiler('/profile', (2, 4))
  for done in range(1, 7):
    profiler.after_step(None, done, None)
    calls.append(done)
  assert calls == [1, ('start', '/profile'), 2, 3, 'stop', 4, 5, 6]
  train.Profiler("/profile", ()).after_step(None, 2, None)
  assert len(calls) == 8


@pytest.mark.slow
def test_a_run_writes_its_profile_and_tensorboard_without_tensorflow(tmp_path):
  """profile_steps write a trace; laurel.train and every default writer load no TensorFlow, and W&B not unless asked.
  In a process of its own: another test may load them, and a jax.profiler session in a test worker that has run
  others can take the worker down."""
  overrides = {**TINY_LM, 'steps': 4, 'profile_steps': '(1,3)', 'tensorboard': True}
  code = ('import sys\nfrom laurel import main\n'
          f'status = main.main({["laurel-train", *cli_args(SPEC, tmp_path, overrides)[3:]]!r})\n'
          'print(status, sorted(m for m in sys.modules if m.split(".")[0] in ("tensorflow", "clu", "wandb")))\n')
  result = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, env=cli_env(), cwd=ROOT,
                          check=False)
  assert result.returncode == 0, result.stderr[-2000:]
  assert result.stdout.splitlines()[-1] == '0 []'
  assert glob.glob(str(tmp_path / 'profile' / '**' / '*.xplane.pb'), recursive=True)
  assert _tensorboard_scalars(tmp_path / 'tensorboard')['loss'] == pytest.approx(
      {r['step']: r['loss'] for r in metrics(tmp_path) if 'loss' in r}, rel=1e-6)


def _open_wandb_run(tmp_path):
  metrics_log.MetricsLog(tmp_path, typed_config(SPEC, {**TINY_LM, 'wandb.project': 'laurel'}), 0, {})


def _check_imagenet(tmp_path):
  preflight.check_image_data({'name': 'imagenet', 'tfds_data_dir': str(tmp_path)})


@pytest.mark.parametrize('module, run, message', [
    ('wandb', _open_wandb_run, "wandb.project='laurel': needs the optional extra [wandb]: pip install -e '.[wandb]'"),
    ('tensorflow_datasets', lambda p: preflight.check_lm_data({'name': 'c4', 'tfds_data_dir': str(p)}),
     "data.tfds_data_dir='/': needs the optional extra [tfds]: pip install -e '.[tfds]'"),
    ('tensorflow_datasets', _check_imagenet,
     "data.tfds_data_dir='/': needs the optional extra [tfds]: pip install -e '.[tfds]'"),
    ('tensorflow_datasets', lambda p: evaluate.tfds_items('piqa', str(p), 4),
     "--task=piqa: needs the optional extra [tfds]: pip install -e '.[tfds]'"),
], ids=['wandb', 'c4_from_tfds', 'imagenet', 'evaluate_tfds_task'])
def test_a_missing_extra_is_one_line_naming_it(tmp_path, monkeypatch, module, run, message):
  # Its import raises ImportError, as where it is not installed; so do its submodules that an earlier test imported.
  for name in [m for m in sys.modules if m == module or m.startswith(module + '.')] or [module]:
    monkeypatch.setitem(sys.modules, name, None)
  with pytest.raises(config_lib.InputError) as error:
    run(tmp_path)
  assert str(error.value).replace(str(tmp_path), '/').startswith(message)
  assert '\n' not in str(error.value)


def test_a_run_asking_for_wandb_without_it_stops_before_compiling(tmp_path, monkeypatch, capsys):
  monkeypatch.setitem(sys.modules, 'wandb', None)
  with pytest.raises(config_lib.InputError, match=r"^wandb.project='laurel': needs the optional extra \[wandb\]"):
    train.train(load_config(SPEC, {**TINY_LM, 'wandb.project': 'laurel'}), str(tmp_path), devices=jax.devices()[:1])
  assert 'compiling' not in capsys.readouterr().out and not (tmp_path / 'metrics.jsonl').exists()


# W&B: a real offline run, read back from its run file (LevelDB-log records of wandb's protobuf Records).

def _wandb_records(path) -> list:
  from wandb.proto import wandb_internal_pb2  # pylint: disable=import-outside-toplevel
  data, pos, block, records, part = pathlib.Path(path).read_bytes(), 7, 32768, [], b''
  assert data[:4] == b':W&B'
  while pos + 7 <= len(data):
    left = block - pos % block
    if left < 7:  # a block's tail too short for a header is padding
      pos += left
      continue
    _, length, kind = struct.unpack('<IHB', data[pos:pos + 7])
    if kind == 0:
      pos += left
      continue
    part, pos = part + data[pos + 7:pos + 7 + length], pos + 7 + length
    if kind in (1, 4):  # a full record, or the last piece of one
      records.append(wandb_internal_pb2.Record.FromString(part))
      part = b''
  return records


def _items(items) -> dict:
  return {i.key or '.'.join(i.nested_key): json.loads(i.value_json) for i in items}


def _wandb_run(run_file) -> dict:
  """The run id, config, history ({step: {key: value}}) and summary a W&B run file holds."""
  out = {'config': {}, 'history': {}, 'summary': {}}
  for record in _wandb_records(run_file):
    kind = record.WhichOneof('record_type')
    if kind == 'run':
      out['id'] = record.run.run_id
      out['config'].update(_items(record.run.config.update))
    elif kind == 'history':
      row = _items(record.history.item)
      out['history'][row['_step']] = row
    elif kind == 'summary':
      out['summary'].update(_items(record.summary.update))
  return out


@pytest.mark.slow
def test_wandb_offline_gets_the_metrics_config_and_summary_and_a_resume_continues_the_run(tmp_path, monkeypatch):
  pytest.importorskip('wandb', reason="W&B is the optional extra [wandb] (in the test extra)")
  monkeypatch.setenv('WANDB_MODE', 'offline')
  monkeypatch.setenv('WANDB_SILENT', 'true')
  for name in ('WANDB_API_KEY', 'WANDB_RUN_ID', 'WANDB_RESUME', 'WANDB_DIR'):
    monkeypatch.delenv(name, raising=False)
  overrides = {**TINY_LM, 'log_every': 2, 'eval_every': 4, 'checkpoint_every': 4, 'wandb.project': 'laurel-test',
               'wandb.name': 'tiny'}
  final = train.train(load_config(SPEC, {**overrides, 'steps': 4}), str(tmp_path), devices=jax.devices()[:1])
  run_id = (tmp_path / 'wandb_run_id').read_text().strip()
  train.train(load_config(SPEC, {**overrides, 'steps': 6}), str(tmp_path), devices=jax.devices()[:1])
  assert (tmp_path / 'wandb_run_id').read_text().strip() == run_id
  first, resumed = [_wandb_run(f) for f in sorted(glob.glob(str(tmp_path / 'wandb' / 'offline-run-*' / '*.wandb')))]
  assert first['id'] == resumed['id'] == run_id
  assert first['config']['model.d_model'] == 32 and first['config']['wandb.name'] == 'tiny'
  logged = metrics(tmp_path)
  history = {**first['history'], **resumed['history']}
  for row in logged:
    for k, v in row.items():
      if isinstance(v, float) and k != 'time':
        assert history[row['step']][k] == pytest.approx(v), (row['step'], k)
  assert sorted(first['history']) == [2, 4] and sorted(resumed['history']) == [6]
  assert first['summary']['eval_loss'] == pytest.approx(final['eval_loss'])
  assert first['summary']['params'] == final['params']
  assert resumed['summary']['step'] == 6


@pytest.mark.slow
def test_tensorboard_on_gcs_uploads_whole_event_files(tmp_path):
  """GCS has no appends (tests/fake_gcs refuses them): the event files are written locally and uploaded whole."""
  code = ('from laurel.run import metric_writers\n'
          'w = metric_writers.TensorBoardWriter("gs://bucket/run/tensorboard")\n'
          'w.write_hparams({"lr": 0.1})\nw.write_scalars(1, {"loss": 2.0})\nw.write_scalars(2, {"loss": 1.5})\n'
          'w.close()\n')
  (tmp_path / 'gcs' / 'bucket').mkdir(parents=True)
  result = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, cwd=ROOT, check=False,
                          env=fake_gcs_env(tmp_path / 'gcs'))
  assert result.returncode == 0, result.stderr[-2000:]
  logdir = tmp_path / 'gcs' / 'bucket' / 'run' / 'tensorboard'
  assert _tensorboard_scalars(logdir) == {'loss': {1: 2.0, 2: 1.5}} and _tensorboard_hparams(logdir) == {'lr': 0.1}
