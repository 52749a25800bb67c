"""make gpu-check's parts that run without a GPU: scripts/benchmark.py's variants, arguments, JSON layout and MFU
arithmetic (on CPU at a tiny shape), the peak FLOP/s table, and scripts/gpu_check.sh's arguments."""

import json
import subprocess
import sys

import pytest

from helpers import ROOT, cli_env
from laurel import hardware

TINY = ['--preset=tiny', '--batch_size=2', '--seq_len=32', '--warmup=1', '--nofull_shape_memory',
        '--set=model.d_model=32', '--set=model.num_heads=4', '--set=model.d_ff=64', '--set=model.num_layers=3']


def _benchmark(*args, timeout=600):
  return subprocess.run([sys.executable, str(ROOT / 'scripts' / 'benchmark.py'), *args], cwd=ROOT, text=True,
                        capture_output=True, env=cli_env(), timeout=timeout, check=False)


def test_mfu_is_the_flops_per_step_over_the_step_time_and_the_summed_peak():
  h100 = hardware.PEAK_FLOPS['NVIDIA H100 80GB HBM3']
  assert h100 == hardware.PEAK_FLOPS['NVIDIA H200'] == 989e12  # dense bf16 (1,979 is the sparsity figure)
  # Baseline-24 at 32 x 1024 tokens: 6 * 157.3M params * 32768 tokens = 3.093e16 FLOPs (attention aside).
  flops = 6 * 157_324_032 * 32 * 1024
  assert hardware.utilisation(flops, 0.078, h100) == pytest.approx(0.400964, abs=1e-6)
  assert hardware.utilisation(flops, 0.078, 8 * h100) == pytest.approx(0.400964 / 8, abs=1e-7)
  assert hardware.utilisation(flops, 0.078, None) is None and hardware.utilisation(0.0, 0.078, h100) is None


def test_a_device_kind_names_its_result_file():
  assert hardware.device_slug('NVIDIA H100 80GB HBM3') == 'nvidia_h100_80gb_hbm3'
  assert hardware.device_slug('NVIDIA H200') == 'nvidia_h200' and hardware.device_slug('cpu') == 'cpu'


@pytest.mark.parametrize('args, message', [
    (['--variants=model.loss_chunk'], "error: --variants: 'model.loss_chunk' is not <field>=<value>"),
    (['--variants=model.no_such_field=1'], 'error: config.model.no_such_field: unknown config field'),
    (['--variants=model.loss_chunk=0', '--topology=v6e-4'],
     'error: --variants: not with --topology (--vary compiles Baseline-24 per value there)'),
    (['--peak_flops=0'], 'flag --peak_flops=0'),
], ids=['no_value', 'unknown_field', 'with_topology', 'peak_not_positive'])
def test_bad_benchmark_arguments_are_one_line_before_compiling(args, message):
  result = _benchmark(*TINY, '--steps=1', *args, timeout=120)
  assert result.returncode != 0 and 'compiled' not in result.stdout
  assert message in result.stderr, result.stderr[-2000:]


def test_gpu_check_takes_only_its_parts():
  result = subprocess.run(['bash', str(ROOT / 'scripts' / 'gpu_check.sh'), 'everything'], capture_output=True,
                          text=True, check=False)
  assert result.returncode == 2 and result.stderr == 'error: part=everything: must be tests, bench or all\n'


@pytest.mark.slow
def test_benchmark_variants_write_the_gpu_check_layout_with_mfu_from_the_given_peak(tmp_path):
  """The JSON make gpu-check writes, measured on CPU: the rows, a Baseline-24 variant timed with them, ratios to
  Baseline-24, versions, the device's peak memory, and MFU/HFU from --peak_flops."""
  result = _benchmark(*TINY, '--rows=rw_lr', '--steps=2', '--variants=model.loss_chunk=0', '--peak_flops=1e12',
                      f'--out={tmp_path}/benchmark_{{device}}.json')
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  out = json.loads((tmp_path / 'benchmark_cpu.json').read_text())
  device = out['device']
  assert device['peak_flops_per_device'] == 1e12 and device['jax_version'] and device['jaxlib_version']
  assert 'device_peak_bytes' in device and 'cudnn_version' not in device  # CUDA's versions on a GPU only
  rows = {r['name']: r for r in out['rows']}
  assert list(rows) == ['baseline_24', 'rw_lr', 'baseline_24 loss_chunk=0']
  assert out['shape']['num_layers']['baseline_24 loss_chunk=0'] == 3
  for r in rows.values():
    assert r['mfu'] == pytest.approx(r['model_flops_per_step'] / r['step_time_s'] / 1e12)
    assert r['hfu'] == pytest.approx(r['flops_per_step'] / r['step_time_s'] / 1e12)
    assert r['tokens_per_s'] == pytest.approx(64 / r['step_time_s'])
    assert r['step_time_ratio'] == pytest.approx(r['step_time_s'] / rows['baseline_24']['step_time_s'], abs=1e-4)
    assert r['peak_memory_bytes'] > 0 and len(r['step_times_s']) == 2
  variant = rows['baseline_24 loss_chunk=0']
  assert variant['params'] == rows['baseline_24']['params'] and variant['params_ratio'] == 1.0
  assert 'baseline_24 loss_chunk=0' in result.stdout  # the table
