"""laurel.plan.aot: the train step compiled by the TPU compiler for a slice this machine does not have (libtpu)."""
import dataclasses
import re
import subprocess
import sys

import flax.linen as nn
import jax
import pytest

from helpers import ROOT, TINY_LM, call_main, cli_env, load_config, needs_libtpu
from laurel import attention, main, sharding, step, train_config
from laurel.cli import compile_cache
from laurel.plan import aot, hardware

# Table 5's model shrunk to compile in seconds; 4 scanned layers so the loop accounting has iterations to count.
SMALL = {**TINY_LM, 'model.num_layers': 4, 'model.dtype': 'bfloat16', 'model.remat': 'dots_no_batch',
         'data.seq_len': 128, 'batch_size': 8}
CACHE_SETTINGS = ('jax_enable_compilation_cache', 'jax_compilation_cache_dir',
                  'jax_persistent_cache_min_compile_time_secs')


def small(row='rw_lr_pa', **overrides):
  return load_config(f'configs/c4_ablation.py:{row},preset=tiny', {**SMALL, **overrides})


@pytest.mark.parametrize('topology, size', [('v6e:4x4', (16, 4)), ('v6e:2x4', (8, 1)), ('v5e:16x16', (256, 64)),
                                            ('v4:2x2x1', (4, 1)), ('v5p:2x2x4', (16, 4)), ('v6e-16', (16, 4)),
                                            ('v5litepod-8', (8, 1)), ('v5p-32', (16, 4)), ('v4-8', (4, 1))])
def test_slice_sizes_are_cloud_tpus(topology, size):
  """(chips, hosts) as Cloud TPU documents them, in either spelling of a slice: the TPU compiler's topology or the
  accelerator type (v5p and v4 count cores)."""
  accel = hardware.parse_accelerator(topology, flag='topology')
  assert (accel['chips'], accel['hosts']) == size


@needs_libtpu
@pytest.mark.parametrize('generation, topology', [('v4', 'v4:2x2x1'), ('v5e', 'v5e:2x2'), ('v5p', 'v5p:2x2x1'),
                                                  ('v6e', 'v6e:2x4')])
def test_the_chip_table_names_the_chips_libtpu_compiles_for(generation, topology):
  """laurel.plan.hardware's row of a generation is the chip libtpu compiles for (its peak FLOP/s and HBM are looked up
  by this name), with as many chips and processes as the slice has."""
  devices = aot.slice_devices(topology)
  assert {d.device_kind for d in devices} == {hardware.TPUS[generation].device_kind}
  accel = hardware.parse_accelerator(topology)
  assert (len(devices), len({d.process_index for d in devices})) == (accel['chips'], accel['hosts'])


@pytest.mark.parametrize('topology, message', [
    ('v7x:2x2', "topology='v7x:2x2': unknown TPU accelerator type or topology: must be an accelerator "
                'type (e.g. v6e-16) or a topology'),
    ('v6e:4', "topology='v6e:4': a v6e slice is 2-D, e.g. v6e:2x2"),
    ('v4:2x2', "topology='v4:2x2': a v4 slice is 3-D, e.g. v4:2x2x2"),
    ('v6e:0x4', "topology='v6e:0x4': unknown TPU accelerator type or topology"),
    ('v6e:2x8', "topology='v6e:2x8': Cloud TPU has no such v6e slice; 16 chips are v6e:4x4"),
    ('tpu-v6e-16', "topology='tpu-v6e-16': unknown TPU accelerator type or topology"),
    ('v6e-12', "topology='v6e-12': no such v6e slice (sizes: 1, 4, 8, 16,"),
])
def test_bad_topology_is_one_line(topology, message):
  with pytest.raises(ValueError, match='^' + message.replace('(', r'\(').replace(')', r'\)')):
    hardware.parse_accelerator(topology, flag='topology')


def test_without_libtpu_a_slice_is_one_line_naming_the_extra(monkeypatch):
  monkeypatch.setitem(sys.modules, 'libtpu', None)  # what find_spec sees where the extra is not installed
  with pytest.raises(ValueError, match=r"^topology='v6e:2x2': compiling for a TPU needs libtpu: pip install -e "
                                       r"'\.\[tpu\]'$"):
    aot.slice_devices('v6e:2x2')


@needs_libtpu
def test_slice_devices_are_the_chips_of_the_slice():
  devices = aot.slice_devices('v5p:2x2x2')
  assert len(devices) == 8 and {d.device_kind for d in devices} == {'TPU v5'}
  assert len({d.process_index for d in devices}) == 2 and jax.default_backend() == 'cpu'


@pytest.mark.slow
@needs_libtpu
def test_costs_count_every_scanned_layer():
  """XLA counts a loop body once; the scan_unroll=2 difference adds the other iterations. The scanned step's FLOPs
  must then match the same step with its layers unrolled (which has no loop), and every figure be per chip."""
  scanned = aot.compile_for_slice(small(), 'v6e:2x2')
  unrolled = aot.compile_for_slice(small(**{'model.scan_layers': False}), 'v6e:2x2')
  assert scanned['params'] == unrolled['params']
  # Counted once, the 4-layer loop would come to about half the unrolled count.
  assert scanned['flops_per_step'] == pytest.approx(unrolled['flops_per_step'], rel=0.02)
  assert 0 < scanned['argument_bytes'] < scanned['peak_memory_bytes'] < hardware.TPUS['v6e'].hbm_bytes
  assert scanned['roofline_step_time_s'] == max(scanned['compute_s'], scanned['memory_s']) > 0


@pytest.mark.slow
@needs_libtpu
@pytest.mark.parametrize('impl', ['flash', 'splash'])
def test_blocked_attention_compiles_per_device_for_a_sharded_slice(impl):
  """On a (data 2, tensor 2) mesh the kernels run under shard_map: Mosaic custom calls on local shapes. 'auto' is
  laurel's flash kernel on the slice, the xla reference off it or where the length is no whole number of tiles."""
  config = small('rw_lr', **{'model.attention': impl, 'mesh.data': 2, 'mesh.tensor': 2})
  devices = aot.slice_devices('v6e:2x2')
  task = train_config.validate_config(config, 4, 1)
  auto = dataclasses.replace(task.model_cfg, attention='auto')
  mesh = sharding.make_mesh(config.mesh, devices)
  with jax.set_mesh(mesh), nn.logical_axis_rules(config.logical_axis_rules):
    hlo = step.compile_step(task, mesh)[0].as_text()
    assert attention.attention_impl(auto, 128) == 'flash' and attention.attention_impl(auto, 100) == 'xla'
  assert 'tpu_custom_call' in hlo
  assert attention.attention_impl(auto, 128) == 'xla'  # off the slice's mesh: this CPU


@pytest.mark.parametrize('impl', ['flash', 'splash'])
def test_blocked_attention_needs_a_length_of_whole_tiles(impl):
  with pytest.raises(ValueError, match=rf"^model.attention='{impl}': needs data.seq_len to be a multiple of 128, "
                                       r'not 100$'):
    train_config.validate_config(small(**{'model.attention': impl, 'data.seq_len': 100}), 1, 1)


def compile_only(*args, overrides=SMALL):
  return subprocess.run([sys.executable, '-m', 'laurel.main', '--config=configs/c4_ablation.py:rw_lr,preset=tiny',
                         '--compile_only', *args, *[f'--config.{k}={v}' for k, v in overrides.items()]],
                        cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=300)


@pytest.mark.slow
@needs_libtpu
def test_compile_only_reports_what_fits():
  r = compile_only('--topology=v5e-4')  # the launcher's spelling of v5e:2x2
  assert r.returncode == 0, r.stderr[-2000:]
  fits, cost, groups = r.stdout.strip().splitlines()
  assert re.fullmatch(r"preflight v5e-4: fits: the step needs ([\d.]+) GB of HBM per chip of 16\.0 GB \(the "
                      r"compiler's peak heap: ([\d.]+) GB of state and batch plus the temporaries alive at that "
                      r'point; ([\d.]+) GB of temporaries in all, never alive at once\)', fits), fits
  # 8 sequences of 128 tokens; the step time is the compiler's schedule unless --mfu says otherwise.
  assert re.fullmatch(r"preflight v5e-4: cost: 1,024 tokens per step; [\d.e+-]+ s per step \([\d,.e+-]+ tokens/s\), "
                      r"6 steps in [\d.]+ s on 4 chips: [\d.e+-]+ chip-hours \(estimated from the TPU compiler's "
                      r'schedule, [\d,.]+M cycles per chip at 1\.50 GHz: an MFU of [\d.e+-]+%; --mfu=F assumes a '
                      r'measured one; training steps only: .+\)', cost), cost
  assert re.fullmatch(r'preflight v5e-4: the step as the compiler schedules it: (\w[\w ]* \d+%, )+\w[\w ]* \d+% '
                      r'\(not in the estimate: [\d,]+ MB of collectives per chip and step, host work\)', groups), groups
  # Only progress on stderr: libtpu's start-up is told the slice, so it logs nothing.
  progress = r.stderr.splitlines()
  assert progress[0] == 'compiling the train step for v5e-4 with the TPU compiler...', r.stderr
  assert re.fullmatch(r'compiling the train step for v5e-4 with the TPU compiler: done in .+', progress[-1])


# A vocabulary of 2^22 × 1024 in float32 is 17 GB of parameters, more than a v5e chip's 16 GB before Adam's moments.
TOO_BIG = {**SMALL, 'model.vocab_size': 2**22, 'model.d_model': 1024, 'model.num_heads': 8, 'model.num_layers': 2}


@pytest.mark.slow
@needs_libtpu
def test_compile_only_refuses_a_step_that_does_not_fit():
  r = compile_only('--topology=v5e:1x1', overrides=TOO_BIG)
  assert r.returncode == 2 and r.stdout == ''
  progress, line = r.stderr.strip().splitlines()  # nothing from libtpu's start-up either
  assert progress == 'compiling the train step for v5e:1x1 with the TPU compiler...', r.stderr
  assert line.startswith("error: topology='v5e:1x1': does not fit: the step needs ") and 'per chip' in line, r.stderr
  assert 'TPU v5 lite chip has' in line


@pytest.fixture
def in_process():
  """laurel-train's main(argv) in this process: what its compile-only start sets (JAX's persistent cache, the
  compilation cache's directory) is put back after, for the other tests."""
  saved = {name: getattr(jax.config, name) for name in CACHE_SETTINGS}
  state = dict(compile_cache._state)  # pylint: disable=protected-access
  yield lambda *args: call_main(main.main, '--config=configs/c4_ablation.py:rw_lr,preset=tiny', *args,
                                *[f'--config.{k}={v}' for k, v in SMALL.items()])
  for name, value in saved.items():
    jax.config.update(name, value)
  compile_cache._state.update(state)  # pylint: disable=protected-access


@pytest.mark.slow
@needs_libtpu
def test_compile_only_with_an_mfu_estimates_from_it_and_refuses_one_out_of_range(in_process):
  r = compile_only('--topology=v5e:2x2', '--mfu=0.5')
  assert r.returncode == 0, r.stderr[-2000:]
  assert r.stdout.splitlines()[1].startswith('preflight v5e:2x2: cost: 1,024 tokens per step; ')
  assert '(estimated from an MFU of 50% (--mfu); ' in r.stdout
  # Refused before anything compiles: the command line's contract, in this process.
  status, _, err = in_process('--compile_only', '--topology=v5e:2x2', '--mfu=1.5')
  assert status == 2 and err == "error: mfu=1.5: must be a fraction in (0, 1], e.g. 0.4 for 40% of the chips' peak " \
                                'FLOP/s\n'


def test_compile_only_needs_a_topology_and_a_topology_needs_compile_only(in_process):
  status, _, err = in_process('--compile_only')
  assert status == 2 and err.strip().endswith('compiling for a slice needs one, e.g. --topology=v6e:4x4')
  status, _, err = in_process('--workdir=unused', '--topology=v6e:4x4')
  assert status == 2 and err == 'error: --topology=v6e:4x4: only with --compile_only (a run uses the devices it ' \
                                'finds)\n'


def test_scan_unroll_must_divide_the_layers():
  with pytest.raises(ValueError, match=r'^model.scan_unroll=3: must divide num_layers=4$'):
    train_config.validate_config(small(**{'model.scan_unroll': 3}), 1, 1)
