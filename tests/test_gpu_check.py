"""make gpu-check's parts that run without a GPU: scripts/benchmark.py's variants, arguments, JSON layout and MFU
arithmetic (on CPU at a tiny shape), the peak FLOP/s table, and scripts/gpu_check.sh's arguments."""

import gzip
import json
import subprocess
import sys

import pytest

from helpers import ROOT, cli_env
from laurel import hardware

sys.path.insert(0, str(ROOT / 'scripts'))
import step_profile  # noqa: E402  (scripts/step_profile.py)

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
@pytest.mark.slow
def test_bad_benchmark_arguments_are_one_line_before_compiling(args, message):
  result = _benchmark(*TINY, '--steps=1', *args, timeout=120)
  assert result.returncode != 0 and 'compiled' not in result.stdout
  assert message in result.stderr, result.stderr[-2000:]


def test_gpu_check_takes_only_its_parts():
  result = subprocess.run(['bash', str(ROOT / 'scripts' / 'gpu_check.sh'), 'everything'], capture_output=True,
                          text=True, check=False)
  assert result.returncode == 2 and result.stderr == 'error: part=everything: must be tests, bench or all\n'


@pytest.mark.parametrize('op_name, line, group', [
    ('jit(train_step)/jvp(LM)/while/body/closed_call/layers/laurel/attn/bqhk,bshk->bhqs/dot_general', '', 'attention'),
    ('jit(train_step)/transpose(jvp(LM))/while/body/closed_call/layers/laurel/attn/query/dot_general', '', 'other'),
    ('', '%custom-call.3 = (bf16[8,1024,12,64]) custom-call(...), custom_call_target="__cudnn$fmhaSoftmax"',
     'attention'),
    ('jit(train_step)/jvp()/while/body/closed_call/_scan_chunks.<locals>.body/reduce', '', 'loss'),
    ('jit(train_step)/jvp(LM)/while/body/closed_call/layers/laurel/laurel.residual/laurel._combine/mul', '',
     'residual'),
    ('jit(train_step)/jvp(LM)/laurel_rw/div', '', 'residual'),
    ('jit(train_step)/sqrt', '', 'optimizer'),
    ('jit(train_step)/jvp(LM)/while/body/closed_call/layers/laurel/mlp/up/dot_general', '', 'other'),
])
def test_profile_groups_ops_by_their_name_stack(op_name, line, group):
  assert step_profile.category(op_name, line) == group


def test_profile_reads_each_instructions_opcode_and_name_stack():
  text = ('HloModule jit_train_step, entry_computation_layout={()}\n'
          '  %fusion.2 = f32[8,32]{1,0} fusion(f32[8,32]{1,0} %p0), kind=kLoop, calls=%fused, '
          'metadata={op_name="jit(train_step)/sqrt" source_file="x.py"}\n'
          '  ROOT %while.1 = (s32[], f32[8]{0}) while((s32[], f32[8]{0}) %t), condition=%c, body=%b\n')
  assert step_profile.hlo_instructions(text) == {
      'fusion.2': ('fusion', 'jit(train_step)/sqrt', text.splitlines()[1]),
      'while.1': ('while', '', text.splitlines()[2])}


HLO = ('HloModule jit_train_step, entry_computation_layout={()}\n'
       '  %fusion.1 = f32[8]{0} fusion(f32[8]{0} %p), kind=kLoop, calls=%f, metadata={op_name="jit(train_step)/sqrt"}\n'
       '  %custom-call.2 = (bf16[2,8,4,64]{3,2,1,0}) custom-call(%q), custom_call_target="__cudnn$fmhaSoftmax"\n'
       '  %while.3 = (s32[]) while((s32[]) %t), condition=%c, body=%b\n')


def _trace(path, events):
  meta = [{'ph': 'M', 'pid': 1, 'name': 'process_name', 'args': {'name': '/device:GPU:0'}},
          {'ph': 'M', 'pid': 2, 'name': 'process_name', 'args': {'name': '/host:CPU'}}]
  with gzip.open(path, 'wt') as f:
    json.dump({'traceEvents': meta + events}, f)
  return str(path)


def test_profile_sums_the_devices_ops_per_step_and_groups_them(tmp_path):
  op = lambda pid, name, dur: {'ph': 'X', 'pid': pid, 'name': name, 'dur': dur,
                               'args': {'hlo_module': 'jit_train_step(7)', 'hlo_op': name}}
  trace = _trace(tmp_path / 'trace.json.gz', [op(1, 'fusion.1', 3000), op(1, 'fusion.1', 3000),
                                               op(1, 'custom-call.2', 1000), op(2, 'while.3', 9000),
                                               op(2, 'fusion.1', 5000)])
  profile = step_profile.op_times(trace, HLO, 'jit_train_step', steps=2)
  assert profile['source'] == 'device'  # the host's events (its while loop, its launch) are not the GPU's time
  assert [(r['hlo_op'], r['category'], r['ms']) for r in profile['ops']] == [
      ('fusion.1', 'optimizer', 3.0), ('custom-call.2', 'attention', 0.5)]
  assert profile['categories']['attention'] == {'ms': 0.5, 'share': 0.5 / 3.5, 'ops': 1}
  host_only = step_profile.op_times(_trace(tmp_path / 'host.json.gz', [op(2, 'while.3', 9000), op(2, 'fusion.1', 40)]),
                                    HLO, 'jit_train_step', steps=1)
  assert host_only['source'] == 'host' and [r['hlo_op'] for r in host_only['ops']] == ['fusion.1']  # no container
  kernels = [{'ph': 'X', 'pid': 1, 'name': 'cudnn_generated_fort_native_sdpa_sm90_flash_fprop_fmha', 'dur': 800},
             {'ph': 'X', 'pid': 1, 'name': 'nvjet_hsh_256x128', 'dur': 200}]
  unnamed = step_profile.op_times(_trace(tmp_path / 'graph.json.gz', kernels), HLO, 'jit_train_step', steps=1)
  assert unnamed['source'] == 'device kernels without hlo_op'
  assert unnamed['categories']['attention']['share'] == pytest.approx(0.8)


@pytest.mark.slow
def test_benchmark_variants_write_the_gpu_check_layout_with_mfu_from_the_given_peak(tmp_path):
  """The JSON make gpu-check writes, measured on CPU: the rows, a Baseline-24 variant timed with them, ratios to
  Baseline-24, versions, the device's peak memory, MFU/HFU from --peak_flops, and --profile's ops by time."""
  result = _benchmark(*TINY, '--rows=rw_lr', '--steps=2', '--variants=model.loss_chunk=0', '--peak_flops=1e12',
                      f'--profile={tmp_path}/profile', f'--out={tmp_path}/benchmark_{{device}}.json')
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
  profiles = out['profile']
  assert list(profiles) == ['baseline_24', 'rw_lr'] and 'profile of rw_lr: ' in result.stdout
  for name, profile in profiles.items():
    groups = profile['categories']
    assert set(groups) == set(step_profile.CATEGORIES) and profile['source'] == 'host'  # CPU thunks
    assert sum(g['share'] for g in groups.values()) == pytest.approx(1.0)
    assert groups['loss']['share'] > 0 and groups['attention']['share'] > 0 and groups['optimizer']['share'] > 0
    times = [op['ms'] for op in profile['ops']]
    assert times == sorted(times, reverse=True) and all(op['opcode'] != 'while' for op in profile['ops'])
  # RW+LR's residual adds the weights and the low-rank term's matmuls to the baseline's add.
  assert profiles['rw_lr']['categories']['residual']['ops'] > profiles['baseline_24']['categories']['residual']['ops']
