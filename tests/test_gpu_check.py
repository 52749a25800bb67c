"""make gpu-check's parts that run without a GPU: scripts/benchmark.py's variants, arguments, JSON layout and MFU
arithmetic (on CPU at a tiny shape), the peak FLOP/s table, scripts/gpu_check.sh's arguments and its end without a
GPU, and the flags a known-slow jaxlib gets on a GPU (laurel.cli.gpu_workarounds)."""

import gzip
import json
import os
import shutil
import subprocess
import sys

import pytest

from helpers import ROOT, cli_env, gpu_present, run_script
from laurel.cli import console, gpu_workarounds
from laurel.plan import hardware

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
  # No known peak on a CPU: scripts/benchmark.py's and gpu_profile.py's MFU, (peak or 0) x devices, is None there.
  assert 'cpu' not in hardware.PEAK_FLOPS and hardware.utilisation(flops, 0.078, 0) is None


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
  result = run_script('benchmark.py', *TINY, '--steps=1', *args)
  assert result.returncode != 0 and 'compiled' not in result.stdout
  assert message in result.stderr, result.stderr[-2000:]


def test_gpu_check_takes_only_its_parts():
  result = subprocess.run(['bash', str(ROOT / 'scripts' / 'gpu_check.sh'), 'everything'], capture_output=True,
                          text=True, check=False)
  assert result.returncode == 2 and result.stderr == 'error: part=everything: must be tests, bench, profile or all\n'


@pytest.mark.slow
@pytest.mark.skipif(gpu_present(), reason='a GPU is here: make gpu-check would run')
def test_gpu_check_without_a_gpu_is_one_line_and_writes_nothing(tmp_path):
  """A copy of the script in an empty tree, so that whatever it writes (results/versions.log) shows."""
  (tmp_path / 'scripts').mkdir()
  shutil.copy(ROOT / 'scripts' / 'gpu_check.sh', tmp_path / 'scripts')
  result = subprocess.run(['bash', str(tmp_path / 'scripts' / 'gpu_check.sh'), 'tests'], capture_output=True,
                          text=True, check=False, timeout=120, env=dict(cli_env(), PYTHON=sys.executable))
  assert result.returncode == 1 and result.stdout == '', result.stdout + result.stderr
  assert result.stderr.startswith('error: no NVIDIA GPU: JAX found no CUDA device') and result.stderr.count('\n') == 1
  assert "pip install -e '.[cuda,test]'" in result.stderr
  assert sorted(p.name for p in tmp_path.rglob('*')) == ['gpu_check.sh', 'scripts']


@pytest.mark.parametrize('version, slow', [('0.10.1', False), ('0.10.2', True), ('0.10.2rc1', True), ('0.11.0', True),
                                           ('0.11.0.dev20260101', True), ('0.11.1', False), ('0.11.2', False),
                                           ('0.9.2', False), ('1.0.0', False), ('unknown', False)])
def test_the_jaxlibs_with_slow_gpu_scatters_are_0_10_2_to_0_11_0(version, slow):
  assert gpu_workarounds.slow_gpu_scatter(version) is slow


@pytest.fixture
def nvidia_gpu_with(monkeypatch):
  """A GPU and the jaxlib version given; XLA_FLAGS and the variables quiet_start sets restored after the test."""
  def set_up(jaxlib):
    monkeypatch.setattr(gpu_workarounds, 'on_nvidia_gpu', lambda: True)
    monkeypatch.setattr(gpu_workarounds.importlib.metadata, 'version', lambda name: {'jaxlib': jaxlib}[name])
    for name in ('XLA_FLAGS', 'JAX_PLATFORMS', 'TF_CPP_MIN_LOG_LEVEL', 'TF_ENABLE_ONEDNN_OPTS'):
      monkeypatch.setenv(name, os.environ.get(name, ''))
    monkeypatch.setenv('XLA_FLAGS', '--xla_gpu_autotune_level=4')
    monkeypatch.setenv('JAX_PLATFORMS', 'cuda')
  return set_up


def test_an_affected_jaxlib_on_a_gpu_gets_the_atomics_flag_and_says_so(nvidia_gpu_with, capsys):
  nvidia_gpu_with('0.10.2')
  console.quiet_start()
  assert os.environ['XLA_FLAGS'] == '--xla_gpu_autotune_level=4 --xla_backend_extra_options=-nvptx-allow-ftz-atomics'
  assert capsys.readouterr().err == ('note: jaxlib 0.10.2 adds float32 scatters slowly on GPUs (openxla/xla#46225, '
                                     'fixed in 0.11.1): XLA_FLAGS gets '
                                     '--xla_backend_extra_options=-nvptx-allow-ftz-atomics\n')
  gpu_workarounds.apply()  # once: a child process inherits the flag
  assert os.environ['XLA_FLAGS'].count(gpu_workarounds.FTZ_ATOMICS) == 1 and capsys.readouterr().err == ''


@pytest.mark.parametrize('jaxlib, gpu', [('0.11.2', True), ('0.10.2', False)])
def test_a_fixed_jaxlib_or_no_gpu_gets_no_flag(nvidia_gpu_with, monkeypatch, jaxlib, gpu):
  nvidia_gpu_with(jaxlib)
  monkeypatch.setattr(gpu_workarounds, 'on_nvidia_gpu', lambda: gpu)
  gpu_workarounds.apply()
  assert os.environ['XLA_FLAGS'] == '--xla_gpu_autotune_level=4'


def test_jax_platforms_without_cuda_is_no_gpu(monkeypatch):
  monkeypatch.setenv('JAX_PLATFORMS', 'cpu')
  assert not gpu_workarounds.on_nvidia_gpu()


@pytest.mark.parametrize('op_name, line, group', [
    ('jit(train_step)/jvp(LM)/while/body/closed_call/layers/laurel/attn/bqhk,bshk->bhqs/dot_general', '', 'attention'),
    ('jit(train_step)/transpose(jvp(LM))/while/body/closed_call/layers/laurel/attn/query/dot_general', '', 'matmul'),
    ('', '%custom-call.3 = (bf16[8,1024,12,64]) custom-call(...), custom_call_target="__cudnn$fmhaSoftmax"',
     'attention'),
    ('jit(train_step)/jvp()/while/body/closed_call/_scan_chunks.<locals>.body/reduce', '', 'loss'),
    ('jit(train_step)/jvp(LM)/while/body/closed_call/layers/laurel/laurel.residual/laurel._combine/mul', '',
     'residual'),
    ('jit(train_step)/jvp(LM)/laurel_rw/div', '', 'residual'),
    ('jit(train_step)/sqrt', '', 'optimizer'),
    ('jit(train_step)/jvp(LM)/while/body/closed_call/layers/laurel/mlp/up/dot_general', '', 'matmul'),
    ('jit(train_step)/jvp(LM)/while/body/closed_call/layers/laurel/mlp/gelu', '', 'other'),
    ('jit(train_step)/jvp(LM)/while/body/closed_call/layers/laurel/mlp/up/dot_general',
     '%dot.4 = bf16[8,1024,1536]{2,1,0} dot(bf16[8,1024,512]{2,1,0} %x, bf16[512,1536]{1,0} %w)', 'matmul'),
    ('jit(train_step)/transpose(jvp(LM))/while/body/closed_call/layers/laurel/attn/out/dot_general',
     '%custom-call.7 = (bf16[8192,512]{1,0}, s8[4194304]{0}) custom-call(...), custom_call_target="__cublas$gemm"',
     'matmul'),
    ('', 'nvjet_hsh_256x128_64x4_2x1_v_bz_coopA_NTN', 'matmul'),  # a GEMM kernel's name (no HLO line)
    ('jit(train_step)/transpose(jvp(LM))/lookup/jit(_take)/scatter-add', '%wrapped_scatter = f32[264,512] fusion()',
     'embedding'),
    ('jit(train_step)/jvp(LM)/lookup/convert_element_type', '', 'embedding'),
    ('jit(train_step)/jvp(LM)/while/body/gather', '%gather.3 = f32[8,4]{1,0} gather(f32[32,4] %t, s32[8] %i)',
     'embedding'),
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
  """The JSON make gpu-check writes, measured on CPU: every key, the rows (Baseline-24 first, whatever --rows says), a
  Baseline-24 variant timed with them, ratios to Baseline-24, versions, the device's peak memory, MFU/HFU from
  --peak_flops, --profile's ops by time, and each row's full-shape memory. A subprocess: it times steps and their CPU
  time on the one device of a process of its own."""
  args = [arg for arg in TINY if arg != '--nofull_shape_memory']
  result = _benchmark(*args, '--rows=rw_lr,baseline_24', '--steps=2', '--variants=model.loss_chunk=0',
                      '--peak_flops=1e12', '--full_shape_batch_per_device=4', '--full_shape_seq_len=64',
                      f'--profile={tmp_path}/profile', f'--out={tmp_path}/benchmark_{{device}}.json')
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  out = json.loads((tmp_path / 'benchmark_cpu.json').read_text())
  assert set(out) >= {'device', 'shape', 'rows', 'full_shape', 'full_shape_memory', 'command', 'profile'}
  assert 'scripts/benchmark.py --preset=tiny --batch_size=2' in out['command'] and '--rows=rw_lr,baseline_24' in (
      out['command'])
  assert out['shape']['batch_size'] == 2 and out['shape']['seq_len'] == 32
  assert out['shape']['d_model'] == 32 and out['shape']['dtype'] == 'float32'
  device = out['device']
  assert device['peak_flops_per_device'] == 1e12 and device['jax_version'] and device['jaxlib_version']
  assert 'device_peak_bytes' in device and 'cudnn_version' not in device  # CUDA's versions on a GPU only
  rows = {r['name']: r for r in out['rows']}
  assert list(rows) == ['baseline_24', 'rw_lr', 'baseline_24 loss_chunk=0']  # the baseline first, always
  assert out['shape']['num_layers']['baseline_24 loss_chunk=0'] == 3
  for r in rows.values():
    assert set(r) >= {'name', 'step_time_s', 'step_time_ratio', 'peak_memory_bytes', 'peak_memory_ratio',
                      'tokens_per_s', 'mfu', 'flops_per_step', 'params'}
    assert r['mfu'] == pytest.approx(r['model_flops_per_step'] / r['step_time_s'] / 1e12)
    assert r['hfu'] == pytest.approx(r['flops_per_step'] / r['step_time_s'] / 1e12)
    assert r['tokens_per_s'] == pytest.approx(64 / r['step_time_s'])
    assert r['step_time_ratio'] == pytest.approx(r['step_time_s'] / rows['baseline_24']['step_time_s'], abs=1e-4)
    assert r['peak_memory_bytes'] > 0 and len(r['step_times_s']) == 2
  base, lr = rows['baseline_24'], rows['rw_lr']
  for key in ('step_time_ratio', 'step_time_ratio_paired', 'step_time_min_ratio', 'cpu_time_ratio',
              'peak_memory_ratio', 'flops_ratio'):
    assert base[key] == 1.0, key
  assert lr['params'] > base['params'] and lr['flops_per_step'] > base['flops_per_step']
  variant = rows['baseline_24 loss_chunk=0']
  assert variant['params'] == rows['baseline_24']['params'] and variant['params_ratio'] == 1.0
  assert 'baseline_24 loss_chunk=0' in result.stdout and 'rw_lr' in result.stdout  # the table
  full = {row['name']: row for row in out['full_shape_memory']}
  assert list(full) == ['baseline_24', 'rw_lr']  # the rows', not the variants'
  assert full['baseline_24']['peak_memory_ratio'] == 1.0 and full['rw_lr']['peak_memory_bytes'] > 0
  assert out['full_shape']['batch_size'] == 4 and out['full_shape']['seq_len'] == 64
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


def _gpu_profile(tmp_path, *args):
  """scripts/gpu_profile.py --smoke in this process (helpers.run_script): its jobs are the processes."""
  return run_script('gpu_profile.py', '--smoke', f'--cache={tmp_path}/cache',
                    f'--out={tmp_path}/gpu_profile_{{device}}.json', *args, env=cli_env())


@pytest.mark.slow
def test_gpu_profile_writes_each_jobs_times_profile_and_the_ab_ratios(tmp_path):
  """scripts/gpu_profile.py --smoke on the CPU: the base job and an A/B job, each in its own process; the CPU's trace
  of the base grouped. (A LAuReL row's residual ops beside the baseline's, grouped alike by step_profile:
  test_benchmark_variants_write_the_gpu_check_layout_with_mfu_from_the_given_peak.)"""
  result = _gpu_profile(tmp_path, '--jobs=gpu,one_hot', '--budget_s=800')
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  out = json.loads((tmp_path / 'gpu_profile_cpu.json').read_text())
  assert out['device']['device_kind'] == 'cpu' and out['device']['jax_version'] and out['smoke']
  jobs = {j['name']: j for j in out['jobs']}
  assert list(jobs) == ['gpu', 'one_hot'] and {j['status'] for j in jobs.values()} == {'ok'}
  assert 'model.embed_lookup=one_hot' in jobs['one_hot']['job']['overrides']
  for j in jobs.values():
    assert len(j['step_times_s']) == 2 and j['compile_s'] > 0 and j['params'] > 0 and j['mfu'] is None  # no CPU peak
    assert j['tokens_per_s'] == pytest.approx(64 / j['step_time_s'])
  assert out['ab'] == [{'name': 'one_hot', 'step_time_s': jobs['one_hot']['step_time_s'], 'mfu': None,
                        'step_time_ratio': round(jobs['one_hot']['step_time_s'] / jobs['gpu']['step_time_s'], 4)}]
  assert 'profile' not in jobs['one_hot'] and 'profile of gpu: ' in result.stdout
  groups = jobs['gpu']['profile']['categories']
  assert list(groups) == list(step_profile.CATEGORIES) and jobs['gpu']['profile']['source'] == 'host'  # CPU thunks
  assert sum(g['share'] for g in groups.values()) == pytest.approx(1.0)
  for name in ('embedding', 'attention', 'matmul', 'loss', 'optimizer'):
    assert groups[name]['ops'] > 0, name


@pytest.mark.slow
def test_gpu_profile_records_a_job_out_of_time_and_overwrites_nothing(tmp_path):
  (tmp_path / 'gpu_profile_cpu.json').write_text('{"a good": "file"}')
  result = _gpu_profile(tmp_path, '--jobs=gpu', '--budget_s=1')
  assert result.returncode == 1 and 'gpu: timed out after 1 s' in result.stdout, result.stdout + result.stderr
  assert result.stderr.endswith("error: no job ran to the end (their output above); nothing written\n")
  assert (tmp_path / 'gpu_profile_cpu.json').read_text() == '{"a good": "file"}'
  bad = _gpu_profile(tmp_path, '--jobs=gpu,nope')
  assert bad.returncode == 2 and bad.stderr.endswith("error: --jobs: unknown job 'nope' (known: gpu, paper, one_hot, "
                                                     "unrolled, xla_attention, no_command_buffers, jax_toolbox, "
                                                     "gpu_rw_lr_pa)\n")
