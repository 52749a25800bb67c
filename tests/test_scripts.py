"""scripts/: launch_tpu's exact gcloud commands, sweep (print, and a tiny local sweep end to end), the ablation on a
fake TPU slice (end to end here: tests/test_gpu_preset.py), benchmark, parameter counts (params.py), and what is live
at a compiled step's peak (peak_buffers.py)."""
import csv
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tempfile

import numpy as np
import pytest

from helpers import ROOT, cli_env, fake_gcs_env, needs_libtpu, run_script
from laurel.plan.hardware import parse_accelerator

sys.path.insert(0, str(ROOT / 'scripts'))

# TINY_LM as --set overrides, smaller still: the sweep runs laurel.main once per point.
TINY_SETS = {'model.d_model': 32, 'model.num_heads': 4, 'model.d_ff': 64, 'model.num_layers': 2,
             'data.name': 'synthetic', 'data.seq_len': 32, 'data.prefetch': 0, 'batch_size': 8, 'steps': 2,
             'log_every': 1, 'eval_every': 1000, 'eval_steps': 1, 'checkpoint_every': 1000, 'tensorboard': False,
             'optimizer.warmup_steps': 1}


def fast_env() -> dict:
  """One CPU device and XLA's quickest CPU codegen: these tests check plumbing, not speed."""
  env = cli_env()
  env['XLA_FLAGS'] += ' --xla_llvm_disable_expensive_passes=true'
  return env


def script(name, *args, env=None, timeout=300):
  """scripts/<name> in a process of its own, for the tests whose subject is that process (libtpu, the fake gs://, a
  fresh process's stderr, timings); the others run it in theirs (helpers.run_script)."""
  return subprocess.run([sys.executable, str(ROOT / 'scripts' / name), *map(str, args)], cwd=ROOT, text=True,
                        capture_output=True, env=env or fast_env(), timeout=timeout)


def sets(overrides):
  return [f'--set={k}={v}' for k, v in overrides.items()]


def test_launch_tpu_dry_run_prints_the_exact_gcloud_commands(tmp_path, monkeypatch):
  monkeypatch.setattr(tempfile, 'tempdir', str(tmp_path))  # TMPDIR
  r = run_script('launch_tpu.py', '--dry-run', '--nopreflight', '--create', '--tpu=my-v6e-16', '--zone=us-east5-b',
                 '--accelerator=v6e-16', '--config=configs/c4_ablation.py:rw_lr', '--workdir=gs://bucket/runs/rw_lr',
                 '--config.model.laurel.rank=16', '--config.data.tfds_data_dir=gs://bucket/tfds')
  assert r.returncode == 0, r.stderr
  tarball = tmp_path / 'laurel-src-my-v6e-16.tar.gz'
  jax_version = importlib.metadata.version('jax')
  assert r.stdout.splitlines() == [
      'gcloud compute tpus tpu-vm create my-v6e-16 --zone=us-east5-b --accelerator-type=v6e-16 '
      '--version=v2-alpha-tpuv6e',
      f'# pack the working tree (git ls-files -co --exclude-standard) into {tarball}',
      f'gcloud compute tpus tpu-vm scp {tarball} my-v6e-16:laurel-src.tar.gz --zone=us-east5-b --worker=all',
      "gcloud compute tpus tpu-vm ssh my-v6e-16 --zone=us-east5-b --worker=all --command='set -e; mkdir -p laurel && "
      'tar xzf laurel-src.tar.gz -C laurel && rm laurel-src.tar.gz && cd laurel && python3 -m pip install -q --user '
      'uv && python3 -m uv venv -q --allow-existing --python 3.11 .venv && python3 -m uv pip install -q --python '
      f""".venv/bin/python "jax[tpu]=={jax_version}" -e ".[gcs]"'""",
      "gcloud compute tpus tpu-vm ssh my-v6e-16 --zone=us-east5-b --worker=all --command='cd laurel && nohup "
      '.venv/bin/python -m laurel.main --config=configs/c4_ablation.py:rw_lr --workdir=gs://bucket/runs/rw_lr '
      "--config.model.laurel.rank=16 --config.data.tfds_data_dir=gs://bucket/tfds > train.log 2>&1 < /dev/null & "
      "echo $! > train.pid'",
  ]
  assert not tarball.exists()  # a dry run packs nothing


def test_launch_tpu_queued_resources_and_the_operations_on_a_run():
  slice_flags = ['--tpu=q', '--zone=z', '--project=p']
  r = run_script('launch_tpu.py', '--dry-run', '--nopreflight', '--create', '--queued', '--spot',
                 '--accelerator=v5e-16', '--nosetup', '--nodetach', '--config=c4_ablation:rw', '--workdir=gs://b/rw',
                 *slice_flags)
  assert r.returncode == 0, r.stderr
  assert r.stdout.splitlines() == [
      'gcloud compute tpus queued-resources create q --zone=z --project=p --node-id=q --accelerator-type=v5litepod-16 '
      '--runtime-version=v2-alpha-tpuv5-lite --spot',
      "# until ACTIVE (polled): gcloud compute tpus queued-resources describe q --zone=z --project=p "
      "--format='value(state.state)'",
      "gcloud compute tpus tpu-vm ssh q --zone=z --project=p --worker=all --command='cd laurel && .venv/bin/python -m "
      "laurel.main --config=configs/c4_ablation.py:rw --workdir=gs://b/rw'"]
  ssh = "gcloud compute tpus tpu-vm ssh q --zone=z --project=p --worker="
  expected = {
      'logs': [f"{ssh}0 --command='tail -n 200 -F laurel/train.log'"],
      'status': ["gcloud compute tpus tpu-vm describe q --zone=z --project=p --format='value(state)'",
                 f"{ssh}all --command='if [ -f laurel/train.pid ] && kill -0 \"$(cat laurel/train.pid)\" 2>/dev/null; "
                 'then echo "$(hostname): training (pid $(cat laurel/train.pid))"; else echo "$(hostname): not '
                 "training\"; fi; tail -n 1 laurel/train.log 2>/dev/null || true'"],
      'stop': [f"{ssh}all --command='if [ -f laurel/train.pid ]; then kill -TERM \"$(cat laurel/train.pid)\" && echo "
               "\"$(hostname): stopping (checkpoint, then exit)\"; fi'"]}
  for action, lines in expected.items():
    r = run_script('launch_tpu.py', '--dry-run', f'--action={action}', *slice_flags)
    assert r.returncode == 0 and r.stdout.splitlines() == lines, r.stdout + r.stderr


@pytest.fixture
def cloud(tmp_path):
  """gcloud replaced by tests/fake_gcloud.py and gs:// by tests/fake_gcs (FAKE_GCS_ROOT = tmp_path/'gcs')."""
  (tmp_path / 'bin').mkdir()
  fake = ROOT / 'tests' / 'fake_gcloud.py'
  (tmp_path / 'bin' / 'gcloud').write_text(f'#!/bin/sh\nexec {sys.executable} {fake} "$@"\n')
  (tmp_path / 'bin' / 'gcloud').chmod(0o755)
  env = fake_gcs_env(tmp_path / 'gcs')
  env['XLA_FLAGS'] += ' --xla_llvm_disable_expensive_passes=true'
  env.update(PATH=f'{tmp_path / "bin"}{os.pathsep}{env["PATH"]}', FAKE_GCLOUD_LOG=str(tmp_path / 'gcloud.log'),
             TMPDIR=str(tmp_path))
  calls = lambda: [json.loads(l) for l in (tmp_path / 'gcloud.log').read_text().splitlines()]
  return env, tmp_path / 'gcs', calls


def test_launch_tpu_watch_reruns_the_training_after_a_preemption(cloud):
  env, _, calls = cloud
  env['FAKE_GCLOUD_SCRIPT'] = json.dumps({'final.json': [[1, ''], [0, '']], 'laurel.main': [[255, ''], [0, '']],
                                          'describe': [[0, 'PREEMPTED\n']]})
  r = run_script('launch_tpu.py', '--watch', '--watch_interval=0', '--nosetup', '--nopreflight', '--tpu=t',
                 '--zone=z', '--accelerator=v6e-8', '--config=c4_ablation:rw', '--workdir=gs://b/rw', env=env)
  assert r.returncode == 0, r.stdout + r.stderr
  steps = [(c[2], c[3]) if c[3] != 'ssh' else ('ssh', 'final.json' if 'final.json' in c[-1] else
                                               'train' if 'laurel.main' in c[-1] else 'setup') for c in calls()]
  assert steps == [('ssh', 'train'), ('ssh', 'final.json'), ('tpu-vm', 'describe'), ('tpu-vm', 'delete'),
                   ('tpu-vm', 'create'), ('tpu-vm', 'scp'), ('ssh', 'setup'), ('ssh', 'train'), ('ssh', 'final.json')]
  assert 'the TPU is PREEMPTED' in r.stdout and 'finished: gs://b/rw/final.json' in r.stdout


@pytest.mark.parametrize('accelerator, message', [
    ('v6e-12', "error: --accelerator='v6e-12': no such v6e slice"),
    ('v7x-8', "error: --accelerator='v7x-8': unknown TPU accelerator type"),
])
def test_launch_tpu_bad_accelerator_is_one_line(accelerator, message):
  r = run_script('launch_tpu.py', '--dry-run', '--tpu=t', '--zone=z', f'--accelerator={accelerator}',
                 '--config=configs/c4_ablation.py:rw_lr', '--workdir=gs://b/r')
  assert r.returncode == 2 and r.stdout == ''
  assert r.stderr.startswith(message) and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_launch_tpu_checks_the_config_for_the_slice():
  r = run_script('launch_tpu.py', '--dry-run', '--tpu=t', '--zone=z', '--accelerator=v6e-16',
                 '--config=configs/c4_ablation.py:rw_lr', '--workdir=gs://b/r', '--config.batch_size=24')
  assert r.returncode == 2 and r.stdout == ''
  assert r.stderr.strip() == ('error: batch_size=24: each micro-batch (24) must divide over the data-parallel '
                              'size data*fsdp=16')


# Table 5's tiny LM at the slice's batch: its step compiles for a v5e-4 in seconds.
PREFLIGHT = [f'--config.{k}={v}' for k, v in {**TINY_SETS, 'batch_size': 4}.items()]


@pytest.mark.slow
@needs_libtpu
def test_launch_tpu_preflight_compiles_for_the_slice_before_any_gcloud_command():
  """A subprocess: libtpu compiles for the slice in a process of its own."""
  args = ['--dry-run', '--tpu=t', '--zone=z', '--accelerator=v5e-4',
          '--config=configs/c4_ablation.py:rw_lr,preset=tiny', '--workdir=gs://b/r', *PREFLIGHT]
  r = script('launch_tpu.py', *args)
  assert r.returncode == 0, r.stderr
  preflight = {line.split(': ')[1]: line for line in r.stderr.splitlines() if line.startswith('preflight v5e:2x2: ')}
  assert ' of 16.0 GB (' in preflight['fits'] and 'the step needs ' in preflight['fits'], r.stderr
  assert ' tokens per step; ' in preflight['cost'] and ' chip-hours (' in preflight['cost'], r.stderr
  assert '%' in preflight['the step as the compiler schedules it'], r.stderr
  assert r.stdout.splitlines()[0].startswith('# pack the working tree')
  # 2^22 × 1024 float32 embeddings (17 GB) do not fit a v5e chip's 16 GB: refused, nothing printed to run.
  r = script('launch_tpu.py', *args, '--config.model.vocab_size=4194304', '--config.model.d_model=1024',
             '--config.model.num_heads=8')
  assert r.returncode == 2 and r.stdout == ''
  progress, error = r.stderr.strip().splitlines()
  assert progress.startswith('compiling the train step for v5e:2x2')
  assert error.startswith("error: topology='v5e:2x2': does not fit: the step needs ")


def test_accelerator_names():
  assert {k: parse_accelerator('v6e-16')[k] for k in ('chips', 'hosts', 'topology')} == {
      'chips': 16, 'hosts': 4, 'topology': '4x4'}
  assert parse_accelerator('v5e-8')['create_flags'] == ['--accelerator-type=v5litepod-8']
  assert parse_accelerator('v5litepod-8')['hosts'] == 1
  assert {k: parse_accelerator('v4-32')[k] for k in ('chips', 'hosts', 'topology')} == {
      'chips': 16, 'hosts': 4, 'topology': '2x2x4'}
  assert parse_accelerator('v4-16', '1x2x4')['create_flags'] == ['--type=v4', '--topology=1x2x4']
  for bad in (('v4-12',), ('v6e-16', '2x8'), ('v4-16', '2x2x4'), ('tpu-v6e-16',), ('v6e:2x8',), ('v6e:3x3',)):
    with pytest.raises(ValueError):
      parse_accelerator(*bad)


@pytest.mark.parametrize('topology, accelerator', [('v6e:4x4', ('v6e-16',)), ('v5e:2x4', ('v5litepod-8',)),
                                                   ('v4:2x2x4', ('v4-32',)), ('v4:1x2x4', ('v4-16', '1x2x4')),
                                                   ('v5p:2x2x2', ('v5p-16',))])
def test_one_spelling_of_a_slice_everywhere(topology, accelerator):
  """The launcher takes the TPU compiler's spelling too; pre-flight and the benchmark take Cloud TPU's (one parser)."""
  assert parse_accelerator(topology) == parse_accelerator(*accelerator)
  with pytest.raises(ValueError, match=r"^--accelerator='v6e:2x8': Cloud TPU has no such v6e slice; 16 chips are "
                                       r'v6e:4x4$'):
    parse_accelerator('v6e:2x8')


def test_launch_tpu_without_libtpu_says_that_nopreflight_skips_its_check(monkeypatch):
  """--dry-run too: its pre-flight compiles the step for the slice, with libtpu."""
  monkeypatch.setitem(sys.modules, 'libtpu', None)  # not installed
  args = ['--dry-run', '--tpu=t', '--zone=z', '--accelerator=v6e-8', '--config=configs/c4_ablation.py:rw_lr',
          '--workdir=gs://b/r']
  r = run_script('launch_tpu.py', *args)
  assert (r.returncode, r.stdout) == (2, '') and r.stderr == (
      "error: --preflight: compiling the step for v6e-8 here needs libtpu (pip install -e '.[tpu]'); --nopreflight "
      'launches (or with --dry-run prints) without this check\n')
  r = run_script('launch_tpu.py', *args, '--nopreflight')
  assert r.returncode == 0 and 'gcloud compute tpus tpu-vm ssh t ' in r.stdout, r.stderr


def test_launch_tpu_refuses_a_local_workdir_for_several_hosts():
  args = ['--dry-run', '--nopreflight', '--tpu=t', '--zone=z', '--config=configs/c4_ablation.py:rw_lr']
  r = run_script('launch_tpu.py', *args, '--accelerator=v6e:4x4', '--workdir=runs/rw_lr')
  assert r.returncode == 2 and r.stdout == ''
  assert r.stderr == ("error: --workdir='runs/rw_lr': a local directory, but the 4 hosts of v6e-16 must share the "
                      'workdir: use gs://BUCKET/...\n')
  r = run_script('launch_tpu.py', *args, '--accelerator=v6e-8', '--workdir=runs/rw_lr', '--config.batch_size=64')
  assert r.returncode == 0, r.stderr  # one host: its own disk will do
  assert 'gcloud compute tpus tpu-vm ssh t ' in r.stdout


@pytest.mark.parametrize('spec, fields, extra, points', [
    ('configs/c4_ablation.py:rw_lr', ['--field=model.laurel.rank', '--values=4,8,16,32,64'], [],
     ['rank=4', 'rank=8', 'rank=16', 'rank=32', 'rank=64']),
    ('configs/imagenet_resnet50.py:rw_lr', ['--field=model.laurel.rank', '--values=8,16'], ['--seeds=0,1'],
     ['rank=8,seed=0', 'rank=8,seed=1', 'rank=16,seed=0', 'rank=16,seed=1']),
    ('configs/c4_ablation.py:rw_lr_pa', ['--field=model.laurel.rank', '--values=8,16', '--field=model.laurel.k',
                                         '--values=2,3'], [],
     ['rank=8,k=2', 'rank=8,k=3', 'rank=16,k=2', 'rank=16,k=3']),
])
def test_sweep_print_gives_the_slice_setup_and_one_launch_per_point(spec, fields, extra, points):
  r = run_script('sweep.py', f'--config={spec}', *fields, '--launch=print', '--workdir=gs://b/sweep', '--tpu=my-tpu',
                 '--zone=z', '--accelerator=v6e-16', '--set=steps=20000', *extra)  # more than any warmup
  assert r.returncode == 0, r.stderr
  launch = 'python scripts/launch_tpu.py --tpu=my-tpu --zone=z --accelerator=v6e-16'
  lines = r.stdout.splitlines()
  assert lines[0] == f'{launch} --notrain' and len(lines) == len(points) + 1
  for line, point in zip(lines[1:], points):
    overrides = [f'--config.{f}={v}' for f, v in zip(('model.laurel.rank', 'model.laurel.k'),
                                                      re.findall(r'(?:rank|k)=(\d+)', point))]
    seed = re.findall(r'seed=(\d+)', point)
    assert line == ' '.join([f'{launch} --nosetup --nodetach --config={spec} --workdir=gs://b/sweep/{point} '
                             '--config.steps=20000', *overrides, *[f'--config.seed={s}' for s in seed]])


def cpu_without_platforms_env() -> dict:
  """fast_env as a user's shell has it: JAX picks its platform (libtpu's, where the test extra installed it)."""
  return {k: v for k, v in fast_env().items() if k != 'JAX_PLATFORMS'}


@pytest.mark.slow
def test_sweep_print_without_a_slice_is_a_local_dry_run(tmp_path):
  """A subprocess: what a fresh process prints on stderr as JAX picks its platform (not libtpu's noise)."""
  r = script('sweep.py', '--config=configs/c4_ablation.py:rw_lr_pa,preset=tiny', '--field=model.laurel.rank',
             '--values=4,8', '--field=model.laurel.k', '--values=2,3', '--launch=print', f'--workdir={tmp_path}',
             '--set=steps=100', env=cpu_without_platforms_env())
  assert r.returncode == 0 and r.stderr == '', r.stderr  # not libtpu's `E0000 ... INVALID_ARGUMENT` lines
  expected = [f'python -m laurel.main --config=configs/c4_ablation.py:rw_lr_pa,preset=tiny --workdir={tmp_path}/'
              f'rank={rank},k={k} --config.steps=100 --config.model.laurel.rank={rank} --config.model.laurel.k={k}'
              for rank in (4, 8) for k in (2, 3)]
  assert r.stdout.splitlines() == expected
  assert list(tmp_path.iterdir()) == []  # a dry run writes nothing


def _contrast(a, b) -> float:
  """WCAG 2 contrast ratio of two sRGB colours: 1 (none) to 21 (black on white)."""
  luminance = lambda rgba: np.dot([0.2126, 0.7152, 0.0722], [
      c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in rgba[:3]])
  hi, lo = sorted((luminance(a), luminance(b)), reverse=True)
  return (hi + 0.05) / (lo + 0.05)


def test_sweep_heatmap_numbers_are_legible_on_every_cell():
  import matplotlib.colors  # pylint: disable=import-outside-toplevel
  import sweep  # pylint: disable=import-outside-toplevel  # scripts/sweep.py
  ranks, ks = ['4', '8', '16', '32'], ['1', '2', '3']
  summary = [{'model.laurel.rank': r, 'model.laurel.k': k, 'eval_loss': 3.0 + 0.1 * i + 0.03 * j,
              'eval_loss_diff_low': -0.005, 'eval_loss_diff_high': 0.005}  # seeds paired: the colours rank the cells
             for i, r in enumerate(ranks) for j, k in enumerate(ks) if (r, k) != ('32', '3')]  # one cell empty
  result = {'fields': ['model.laurel.rank', 'model.laurel.k'], 'grid': {'model.laurel.rank': ranks,
                                                                       'model.laurel.k': ks},
            'metric': 'eval_loss', 'reduce': 'final', 'config': 'configs/c4_ablation.py:rw_lr', 'summary': summary}
  figure = sweep.plot(result)
  ax = figure.axes[0]
  image = ax.images[0]
  cells = image.get_array()
  texts = ax.texts
  assert len(texts) == len(ranks) * len(ks)
  for text in texts:
    j, i = (int(round(v)) for v in text.get_position())
    value = cells[i, j]
    background = (1, 1, 1, 1) if np.ma.is_masked(value) or np.isnan(value) else image.cmap(image.norm(value))
    assert _contrast(matplotlib.colors.to_rgba(text.get_color()), background) >= 4.5, (text.get_text(), i, j)


@pytest.mark.slow
def test_sweep_grid_on_a_tpu_slice_with_a_gs_workdir_goes_on_past_a_failed_point(cloud):
  """A subprocess: the fake gs:// (tests/fake_gcs) is a process's. A 1 x 2 grid of two fields: its first point
  fails, the second still trains."""
  env, gcs, calls = cloud
  args = ['--config=configs/c4_ablation.py:rw_lr_pa', '--field=model.laurel.rank', '--values=8',
          '--field=model.laurel.k', '--values=2,3', '--workdir=gs://bucket/sweep', '--launch=tpu',
          '--nopreflight', '--tpu=t', '--zone=z', '--accelerator=v6e-16']
  r = script('sweep.py', *args, env={**env, 'FAKE_GCLOUD_FAIL': 'rank=8,k=2'})
  assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
  assert r.stderr.strip().splitlines()[-1] == 'error: 1 point(s) failed: rank=8,k=2'
  verbs = [c[3] for c in calls()]
  assert verbs == ['scp', 'ssh'] + ['ssh'] * 2  # the slice's setup, then one training per point
  rows = list(csv.DictReader((gcs / 'bucket' / 'sweep' / 'sweep.csv').open()))
  assert [(r['model.laurel.rank'], r['model.laurel.k'], r['status']) for r in rows] == [
      ('8', '2', 'failed'), ('8', '3', 'done')]
  assert (gcs / 'bucket' / 'sweep' / 'sweep.png').read_bytes()[:4] == b'\x89PNG'
  assert json.loads((gcs / 'bucket' / 'sweep' / 'rank=8,k=2' / 'failed.json').read_text())['exit'] == 1
  assert not list(gcs.glob('gs:*')) and not (ROOT / 'gs:').exists()  # never a local folder named gs:

  r = script('sweep.py', *args, '--nosetup', env=env)  # the rerun trains only the failed point
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  assert r.stdout.count('finished, skipped') == 1 and len(calls()) == 5
  summary = json.loads((gcs / 'bucket' / 'sweep' / 'sweep.json').read_text())['summary']
  assert [s['runs'] for s in summary] == [1, 1]
  assert '| 8 | 2 | 1 |' in (gcs / 'bucket' / 'sweep' / 'sweep.md').read_text()


@pytest.mark.slow
def test_reproduce_on_a_tpu_slice_with_gs_workdirs_records_a_failed_row(cloud):
  """A subprocess: the fake gs:// (tests/fake_gcs) is a process's."""
  env, gcs, calls = cloud
  args = ['--preset=paper', '--rows=baseline_24,rw', '--seeds=1', '--workdir=gs://bucket/abl', '--out=gs://bucket/res',
          '--tpu=t', '--zone=z', '--accelerator=v6e-16', '--nosetup', '--data_path=gs://bucket/c4']
  r = run_script('reproduce_c4_ablation.py', *args, '--launch=print', env=env)
  assert r.returncode == 0 and len(r.stdout.splitlines()) == 2, r.stdout + r.stderr
  assert r.stdout.splitlines()[0] == (
      'python scripts/launch_tpu.py --tpu=t --zone=z --accelerator=v6e-16 --nosetup --nodetach '
      '--config=configs/c4_ablation.py:baseline_24,preset=paper --workdir=gs://bucket/abl/baseline_24/seed0 '
      '--config.seed=0 --config.data.path=gs://bucket/c4')
  r = script('reproduce_c4_ablation.py', *args, '--launch=tpu', '--nopreflight',
             env={**env, 'FAKE_GCLOUD_FAIL': '^bucket/abl/rw/'})
  assert r.returncode == 1 and r.stderr.strip().splitlines()[-1] == 'error: 1 run(s) failed: rw/seed0'
  assert len(calls()) == 2
  result = json.loads((gcs / 'bucket' / 'res' / 'c4_ablation_paper.json').read_text())
  rows = {row['name']: row for row in result['rows']}
  assert rows['baseline_24']['seeds'] == 1 and rows['baseline_24']['test_loss'] > 2
  assert rows['rw']['seeds'] == 0 and rows['rw']['failed'] == ['seed0'] and rows['rw']['test_loss'] is None
  assert '| rw | 0 (failed: seed0) |' in (gcs / 'bucket' / 'res' / 'c4_ablation_paper.md').read_text()


def test_sweep_checks_every_point_before_running_anything(tmp_path):
  r = run_script('sweep.py', '--config=configs/c4_ablation.py:rw_lr,preset=tiny', '--field=model.laurel.rnak',
                 '--values=4,8', f'--workdir={tmp_path}')
  assert r.returncode == 2 and r.stderr == ('error: --field=model.laurel.rnak: unknown config field; did you mean '
                                            'model.laurel.rank?\n'), r.stderr
  r = run_script('sweep.py', '--config=configs/c4_ablation.py:rw_lr_pa,preset=tiny', '--field=model.laurel.rank',
                 '--values=4,8', '--field=model.laurel.k', '--values=2,99', f'--workdir={tmp_path}')
  assert r.returncode == 2 and r.stderr.strip().startswith('error: model.laurel.k=99:'), r.stderr
  assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_local_sweep_end_to_end_and_resumable(tmp_path):
  args = ['--config=configs/c4_ablation.py:rw_lr,preset=tiny', '--field=model.laurel.rank', '--values=2,4',
          f'--workdir={tmp_path}', *sets(TINY_SETS)]
  r = run_script('sweep.py', *args, env=fast_env())  # the points train in processes of their own
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  for name in ('sweep.csv', 'sweep.json', 'sweep.md', 'sweep.png'):
    assert (tmp_path / name).exists(), name
  assert (tmp_path / 'sweep.png').read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
  rows = list(csv.DictReader((tmp_path / 'sweep.csv').open()))
  assert [(r['model.laurel.rank'], r['status'], r['step']) for r in rows] == [('2', 'done', '2'), ('4', 'done', '2')]
  losses = [float(r['eval_loss']) for r in rows]
  assert int(rows[1]['params']) - int(rows[0]['params']) == 2 * 2 * (4 - 2) * 32  # 2 sites x 2rD
  result = json.loads((tmp_path / 'sweep.json').read_text())
  assert [s['eval_loss'] for s in result['summary']] == pytest.approx(losses)
  assert '| 4 | 1 |' in (tmp_path / 'sweep.md').read_text()

  # Rerun: finished points are skipped. A point without final.json (killed at the very end) resumes from its
  # last checkpoint and evaluates there, so its metric is the same.
  (tmp_path / 'rank=4' / 'final.json').unlink()
  r = run_script('sweep.py', *args, env=fast_env())
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  assert '[1/2 rank=2] finished, skipped' in r.stdout
  assert '[2/2 rank=4] resumed from checkpoint 2' in r.stdout
  rows = list(csv.DictReader((tmp_path / 'sweep.csv').open()))
  assert [float(r['eval_loss']) for r in rows] == pytest.approx(losses)
  r = run_script('sweep.py', *args, env=fast_env())
  assert r.stdout.count('finished, skipped') == 2 and 'laurel.main' not in r.stdout


def test_reproduce_writes_its_tables_beside_the_runs_unless_asked(tmp_path):
  """Not into the committed results/ (relative to where it runs) unless --out says so."""
  run = tmp_path / 'runs' / 'baseline_24' / 'seed0'
  run.mkdir(parents=True)
  (run / 'final.json').write_text(json.dumps({'eval_loss': 3.0, 'params': 1_000_000, 'peak_memory_bytes': 10**8,
                                              'median_step_time_s': 0.5}))
  r = run_script('reproduce_c4_ablation.py', '--rows=baseline_24', '--collect_only', f'--workdir={tmp_path / "runs"}',
                 cwd=tmp_path)
  assert r.returncode == 0, r.stderr[-2000:]
  assert not (tmp_path / 'results').exists()
  assert json.loads((tmp_path / 'runs' / 'c4_ablation_tiny.json').read_text())['rows'][0]['test_loss'] == 3.0


@pytest.mark.slow
@needs_libtpu
def test_benchmark_topology_compiles_every_row_for_the_slice(tmp_path):
  """A subprocess: libtpu compiles for the slice in a process of its own."""
  out = tmp_path / 'tpu.json'
  tiny = {k: v for k, v in TINY_SETS.items() if k.startswith('model.')}
  r = script('benchmark.py', '--topology=v6e-4', '--preset=tiny', '--rows=rw_lr', '--batch_size=8',
             '--seq_len=64', f'--out={out}', *sets(tiny))
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  result = json.loads(out.read_text())
  assert result['device']['topology'] == 'v6e:2x2' and result['device']['chips'] == 4
  assert result['device']['peak_flops_per_chip'] == 918e12 and result['device']['hbm_bytes_per_s'] == 1638e9
  assert 'cloud.google.com/tpu/docs' in result['device']['chip_figures']
  rows = {row['name']: row for row in result['rows']}
  assert list(rows) == ['baseline_24', 'rw_lr']
  for key in ('peak_memory_ratio', 'argument_ratio', 'flops_ratio', 'bytes_accessed_ratio', 'roofline_ratio'):
    assert rows['baseline_24'][key] == 1.0, key
  lr = rows['rw_lr']
  assert lr['params'] > rows['baseline_24']['params'] and lr['flops_ratio'] > 1.0 and lr['argument_ratio'] > 1.0
  assert lr['roofline_step_time_s'] == max(lr['flops_per_step'] / 918e12, lr['bytes_accessed_per_step'] / 1638e9)
  assert lr['paper_peak_memory_gb'] == 12.57 and 'v6e:2x2 (4 x TPU v6 lite)' in r.stdout


@pytest.mark.slow
@needs_libtpu
def test_benchmark_vary_compiles_baseline_per_value_and_goes_on_past_a_row_that_does_not_fit(tmp_path):
  """--vary compiles Baseline-24 once per value, its ratios to the first value's; a value whose step does not fit is
  recorded as such, with what it needs, and the next still compiles. (That the loss chunk changes the peak and never
  the counted FLOPs: test_lean_step.py's test_compiler_costs_count_every_loss_chunk and
  test_chunked_cross_entropy_keeps_one_chunk_of_logits_live.) A subprocess: libtpu compiles for the slice in a process
  of its own."""
  tiny = {k: v for k, v in TINY_SETS.items() if k.startswith('model.')}
  bad = script('benchmark.py', '--topology=v5e:1x1', '--preset=tiny', '--vary=model.vocab_size', *sets(tiny))
  assert bad.returncode != 0 and "--vary: 'model.vocab_size' is not <field>=<v1>,<v2>,..." in bad.stderr
  # 2^27 × 32 float32 embedding: 17 GB of parameters, more than a v5e chip's 16 GB; the tiny d_model keeps the
  # fitting row's compiles short.
  out = tmp_path / 'vary.json'
  r = script('benchmark.py', '--topology=v5e:1x1', '--preset=tiny', '--batch_size=8', '--seq_len=64',
             '--vary=model.vocab_size=134217728,512', f'--out={out}', *sets(tiny))
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  rows = json.loads(out.read_text())['rows']
  assert [row['name'] for row in rows] == ['baseline_24 vocab_size=134217728', 'baseline_24 vocab_size=512']
  big, small = rows
  assert big['fits'] is False and "does not fit: the step needs " in big['error'] and big['peak_memory_bytes'] > 16e9
  assert 'flops_per_step' not in big and big['flops_ratio'] is None and big['peak_memory_ratio'] == 1.0
  assert 'fits' not in small and small['peak_memory_bytes'] < 16e9 and small['peak_memory_ratio'] < 1
  assert small['flops_per_step'] > 0
  assert '(does not fit)' in r.stdout


@pytest.mark.slow
def test_benchmark_keeps_slice_rows_across_commits_that_leave_laurel_and_configs_alone(tmp_path):
  """The key of a kept TPU row: the committed trees of laurel/ and configs/, not the commit. A subprocess imports
  benchmark.py: its flags, defined on import, would stay in this one."""
  git = lambda *args: subprocess.run(['git', '-C', str(tmp_path), *args], check=True, capture_output=True)
  # One process (importing benchmark costs seconds) prints benchmark.code_trees for each line read.
  code = ('import sys; sys.path.insert(0, sys.argv[1]); import benchmark\n'
          'for _ in sys.stdin: print(benchmark.code_trees(sys.argv[2]), flush=True)')
  reader = subprocess.Popen([sys.executable, '-c', code, str(ROOT / 'scripts'), str(tmp_path)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=cli_env())

  def trees() -> str:
    reader.stdin.write('\n')
    reader.stdin.flush()
    return reader.stdout.readline().strip()

  git('init', '-q')
  for path in ('laurel/step.py', 'configs/c.py', 'results/README.md'):
    (tmp_path / path).parent.mkdir(exist_ok=True)
    (tmp_path / path).write_text('1\n')
  git('add', '.')
  git('-c', 'user.name=t', '-c', 'user.email=t@t', 'commit', '-qm', 'one')
  first = trees()
  assert len(first.split()) == 2
  (tmp_path / 'results/README.md').write_text('2\n')
  git('-c', 'user.name=t', '-c', 'user.email=t@t', 'commit', '-qam', 'results')
  assert trees() == first
  (tmp_path / 'laurel/step.py').write_text('2\n')
  assert trees() == 'None'  # uncommitted code: nothing is kept
  git('-c', 'user.name=t', '-c', 'user.email=t@t', 'commit', '-qam', 'code')
  assert trees() not in (first, 'None', '')
  reader.communicate(timeout=60)
  assert reader.returncode == 0


@pytest.mark.slow
def test_benchmark_decode_counts_every_layer_and_writes_every_key(tmp_path):
  """In this process (helpers.run_script): its jitted steps take one device, and no timing is checked, only that
  each is there. One row beside Baseline-24: the script treats every row alike (a LAuReL row's decoding against
  recomputation: test_generate.py's test_every_registered_design_is_decoded_with_the_cache)."""
  out = tmp_path / 'decode.json'
  r = run_script('benchmark_decode.py', '--preset=tiny', '--rows=baseline_28', '--prompt_len=8', '--batch=2',
                 '--new_tokens=2', '--rounds=1', f'--out={out}')
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  result = json.loads(out.read_text())
  rows = {row['name']: row for row in result['rows']}
  assert list(rows) == ['baseline_24', 'baseline_28'] and result['command'].startswith('python scripts/')
  for key in ('prefill_s', 'decode_b1_s', 'decode_b2_s', 'kv_cache_bytes_b1', 'decode_flops_b1',
              'decode_bytes_accessed_b2'):
    assert rows['baseline_24'][f'{key}_ratio'] == 1.0 and rows['baseline_28'][key] > 0, key
  # 7 layers against 6: a scanned body counted once would give 1.0
  assert rows['baseline_28']['decode_flops_b1_ratio'] > 1.1
  assert rows['baseline_28']['kv_cache_bytes_b1_ratio'] == pytest.approx(7 / 6, abs=1e-4)


@pytest.mark.slow
@needs_libtpu
def test_peak_buffers_lists_the_saved_stacks_of_a_dumped_tpu_step(tmp_path):
  """A step compiled for a slice with an XLA dump (a subprocess: libtpu's); the script finds its buffers, the q, k, v
  stacks that remat=save_qkv keeps for every layer among them, and no more live bytes than the packed temporaries."""
  env = fast_env()
  env['XLA_FLAGS'] += f' --xla_dump_to={tmp_path} --xla_dump_hlo_as_text --xla_dump_hlo_module_re=jit_train_step'
  overrides = {**{k: v for k, v in TINY_SETS.items() if k.startswith(('model.', 'data.'))}, 'model.remat': 'save_qkv',
               'model.dtype': 'bfloat16', 'data.seq_len': 128, 'batch_size': 16, 'model.num_layers': 3}
  r = subprocess.run([sys.executable, '-m', 'laurel.main', '--config=configs/c4_ablation.py:baseline_24,preset=tiny',
                      '--compile_only', '--topology=v6e:2x2', '--mfu=0.4',
                      *[f'--config.{k}={v}' for k, v in overrides.items()]],
                     cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
  r = run_script('peak_buffers.py', f'--dump={tmp_path}', '--top=50')
  assert r.returncode == 0, r.stderr[-3000:]
  packed, live = map(float, re.search(r'temporaries ([\d.]+) GB as packed, of which at most ([\d.]+) GB', r.stdout)
                     .groups())
  assert 0 < live <= packed
  # q, k and v of the 3 layers, their heads apart or together (and the layers' inputs, the scan's own)
  stacks = re.findall(r'\n\s+[\d.]+ GB\s+(\d+) x bf16\[3,4,128,(?:4,8|32)\] ', r.stdout)
  assert sum(map(int, stacks)) >= 3, r.stdout
  bad = run_script('peak_buffers.py', f'--dump={tmp_path / "none"}')
  assert bad.returncode != 0 and '--dump=' in bad.stderr


# A loop of 3 trips: each reads a 1-row slice of a 4 x 8 f32 stack and writes a row of an 8 x 8 bf16 buffer in place.
TINY_HLO = """\
%slice_rows (param_0: f32[4,8], param_1: s32[]) -> f32[1,8] {
  %param_0 = f32[4,8]{1,0} parameter(0)
  %param_1 = s32[] parameter(1)
  %c = s32[] constant(0)
  ROOT %ds = f32[1,8]{1,0} dynamic-slice(%param_0, %param_1, %c), dynamic_slice_sizes={1,8}
}

%write_row (param_0: bf16[8,8], param_1: f32[1,8], param_2: s32[]) -> bf16[8,8] {
  %param_0 = bf16[8,8]{1,0} parameter(0)
  %param_1 = f32[1,8]{1,0} parameter(1)
  %param_2 = s32[] parameter(2)
  %cv = bf16[1,8]{1,0} convert(%param_1)
  %c = s32[] constant(0)
  ROOT %dus = bf16[8,8]{1,0} dynamic-update-slice(%param_0, %cv, %param_2, %c)
}

%body (p: (s32[], f32[4,8], bf16[8,8])) -> (s32[], f32[4,8], bf16[8,8]) {
  %p = (s32[], f32[4,8]{1,0}, bf16[8,8]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %stack = f32[4,8]{1,0} get-tuple-element(%p), index=1
  %buffer = bf16[8,8]{1,0} get-tuple-element(%p), index=2
  %row = f32[1,8]{1,0} fusion(%stack, %i), kind=kLoop, calls=%slice_rows, metadata={op_name="jvp(LM)/while/read"}
  %new = bf16[8,8]{1,0} fusion(%buffer, %row, %i), calls=%write_row, metadata={op_name="transpose(jvp(LM))/write"}
  ROOT %t = (s32[], f32[4,8]{1,0}, bf16[8,8]{1,0}) tuple(%i, %stack, %new)
}

%cond (p: (s32[], f32[4,8], bf16[8,8])) -> pred[] {
  %p = (s32[], f32[4,8]{1,0}, bf16[8,8]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (a: f32[4,8], b: bf16[8,8]) -> bf16[8,8] {
  %a = f32[4,8]{1,0} parameter(0)
  %b = bf16[8,8]{1,0} parameter(1)
  %zero = s32[] constant(0)
  %init = (s32[], f32[4,8]{1,0}, bf16[8,8]{1,0}) tuple(%zero, %a, %b)
  %loop = (s32[], f32[4,8]{1,0}, bf16[8,8]{1,0}) while(%init), condition=%cond, body=%body
  %out = bf16[8,8]{1,0} get-tuple-element(%loop), index=2
  ROOT %twice = bf16[8,8]{1,0} add(%out, %out), metadata={op_name="jit(train_step)/jvp(LM)/double"}
}
"""


def test_peak_buffers_bytes_count_slices_in_place_updates_and_trips(tmp_path):
  """Per trip: the read fusion takes its 32-byte slice and writes it, and reads the 4-byte index (68 B); the in-place
  write reads the 32-byte row and the index and writes its 16-byte bf16 update (52 B); the loop's test, 9 B. Times 3
  trips, plus the add's 3 x 128 B."""
  (tmp_path / 'module_0001.jit_train_step.after_optimizations.txt').write_text(TINY_HLO)
  r = run_script('peak_buffers.py', f'--dump={tmp_path}', '--bytes')
  assert r.returncode == 0, r.stderr[-3000:]
  assert r.stdout.startswith('7.71e-07 GB accessed'), r.stdout
  rows = {tuple(line.split()[3:]): float(line.split()[0]) for line in r.stdout.splitlines()[1:]}
  assert rows == {('forward', 'read'): 204e-9, ('backward', 'write'): 156e-9, ('forward', 'double'): 384e-9,
                  ('forward', 'compare'): 27e-9}, rows
  (tmp_path / 'base').mkdir()  # the same program with a loop of 2 trips: each group adds one trip's bytes
  (tmp_path / 'base' / 'module_0001.jit_train_step.after_optimizations.txt').write_text(
      TINY_HLO.replace('constant(3)', 'constant(2)'))
  r = run_script('peak_buffers.py', f'--dump={tmp_path}', '--bytes', f'--base={tmp_path / "base"}')
  assert r.returncode == 0, r.stderr[-3000:]
  added = {tuple(line.split()[3:]): float(line.split()[2]) for line in r.stdout.splitlines()[2:]}
  assert added == {('forward', 'read'): 68e-9, ('backward', 'write'): 52e-9, ('forward', 'compare'): 9e-9,
                   ('forward', 'double'): 0.0}, r.stdout


def test_maxtext_compare_restates_its_table_from_the_committed_jsons():
  r = run_script('maxtext_compare.py', '--table_only')
  assert r.returncode == 0, r.stderr[-2000:]
  names = [line[:58].strip() for line in r.stdout.splitlines()[1:]]
  assert 'MaxText minimal_dot_product' in names and 'laurel baseline_24 (save_qkv, xla)' in names, r.stdout


@pytest.mark.slow
def test_make_params_prints_the_results_table():
  result = run_script('params.py', '--table=c4_ablation')
  assert result.returncode == 0, result.stderr[-2000:]
  table = result.stdout.strip().splitlines()
  assert table[0].startswith('| row | params | paper |') and len(table) == 2 + 7
  results = (ROOT / 'results' / 'README.md').read_text()
  assert '\n'.join(table) in results  # results/README.md's table is exactly what `make params` prints
  as_json = run_script('params.py', '--table=c4_ablation', '--json')
  rows = [json.loads(l) for l in as_json.stdout.splitlines()]
  assert [r['row'] for r in rows] == ['baseline_24', 'baseline_28', 'rw', 'lr', 'pa', 'rw_lr', 'rw_lr_pa']
  assert f"| rw_lr | {rows[5]['total_params']:,} (" in result.stdout
  assert rows[5]['paper_params_m'] == 158.40 and rows[5]['laurel_params'] == rows[5]['closed_form_laurel_params']


@pytest.mark.parametrize('args, message', [
    ((), 'error: give --config=configs/<file>.py:<row> or --table=<name> (one of them)'),
    (('--table=c4_ablation', '--config=c4_ablation:rw'), 'error: give --config=configs/<file>.py:<row> or'),
    (('--config=c4_ablation:nope',), 'error: '),
])
def test_params_bad_input_is_one_line(args, message):
  r = run_script('params.py', *args)
  assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr[-2000:]
  assert r.stderr.startswith(message)
