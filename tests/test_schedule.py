"""laurel.plan.schedule: the TPU compiler's estimated cycles of a program, a loop's body counted once per trip, kernels
by their cost estimates. First on hand-written compiled text (the answer known by construction), then on what libtpu
compiles for a chip this machine does not have."""

import re

import jax
import jax.numpy as jnp
import pytest

from helpers import TINY_LM, load_config, needs_libtpu
from laurel.plan import aot, hardware, schedule

CONFIG = '{"flag_configs":[],"window_config":{"estimated_cycles":"%d","iteration_bounds":["1"]}}'


def fusion(name, cycles, op_name='jit(f)/dot_general'):
  return (f'  %{name} = f32[8,128]{{1,0}} fusion(%p), kind=kLoop, calls=%fused_{name}, '
          f'metadata={{op_name="{op_name}"}}, backend_config={CONFIG % cycles}')


def loop(name, body, bound, start=0, direction='LT'):
  """A while loop `for i in range(start, bound)` over computation `body`, and its condition."""
  cond = [f'%cond_{name} (p: (s32[], f32[8,128])) -> pred[] {{', '  %p = (s32[], f32[8,128]) parameter(0)',
          '  %i = s32[] get-tuple-element(%p), index=0', f'  %n = s32[] constant({bound})',
          f'  ROOT %lt = pred[] compare(%i, %n), direction={direction}', '}']
  caller = [f'  %start_{name} = s32[] constant({start})', f'  %init_{name} = (s32[], f32[8,128]) tuple(%start_{name}, %x)',
            f'  %{name} = (s32[], f32[8,128]) while(%init_{name}), condition=%cond_{name}, body=%{body}']
  return cond, caller


def program(entry: list[str], *computations: list[str]) -> str:
  lines = []
  for computation in computations:
    lines += computation
  return '\n'.join(['HloModule m', *lines, 'ENTRY %main (x: f32[8,128]) -> f32[8,128] {', *entry,
                    '  ROOT %out = f32[8,128] copy(%x)', '}'])


def test_a_loop_body_counts_once_per_trip_and_nested_loops_multiply():
  inner_cond, inner_call = loop('inner', 'inner_body', 3)
  outer_cond, outer_call = loop('outer', 'outer_body', 7, start=2)  # 5 trips
  inner_body = ['%inner_body (p: (s32[], f32[8,128])) -> (s32[], f32[8,128]) {', fusion('f3', 11),
                '  ROOT %r = (s32[], f32[8,128]) copy(%p)', '}']
  outer_body = ['%outer_body (p: (s32[], f32[8,128])) -> (s32[], f32[8,128]) {', fusion('f2', 7),
                '  %x = f32[8,128] parameter(1)', *inner_call, '  ROOT %r = (s32[], f32[8,128]) copy(%p)', '}']
  text = program([fusion('f1', 100), *outer_call], inner_cond, inner_body, outer_cond, outer_body)
  est = schedule.estimate(text, flops_per_cycle=1.0, bytes_per_cycle=1.0)
  assert est.compiler_cycles == est.cycles == 100 + 5 * 7 + 5 * 3 * 11
  assert est.unknown_loops == ()


def test_a_loop_whose_trip_count_cannot_be_read_counts_once_and_is_named():
  cond, call = loop('w', 'body', 4, direction='GT')  # counting down: no loop of ours does
  body = ['%body (p: (s32[], f32[8,128])) -> (s32[], f32[8,128]) {', fusion('f', 9),
          '  ROOT %r = (s32[], f32[8,128]) copy(%p)', '}']
  est = schedule.estimate(program(call, cond, body), 1.0, 1.0)
  assert (est.cycles, est.unknown_loops) == (9, ('w',))


def kernel(name, estimate=None):
  config = '{"custom_call_config":{"body":"...","cost_estimate":{"flops":"%d","transcendentals":"0","bytes_accessed":' \
           '"%d","remote_bytes_transferred":"0"}}}' % estimate if estimate else '{"custom_call_config":{}}'
  # a kernel's metadata spans lines, as Pallas's xprof_metadata does
  return (f'  %{name} = f32[8,128]{{1,0}} custom-call(%x), custom_call_target="tpu_custom_call", '
          f'metadata={{op_name="jit(f)/attn/flash/pallas_call"}}, backend_config={config}, frontend_attributes={{m="{{\n'
          f'\\"block\\": 512}}"}}')


def test_kernels_count_by_their_cost_estimate_or_by_stated_flops():
  """max(FLOPs / rate, bytes / bandwidth) for a kernel with an estimate; one without is counted only from the FLOPs
  its caller states, else reported as uncounted. The continuation lines of a kernel's metadata are its own."""
  text = program([kernel('k1', (4000, 100)), kernel('k2', (10, 900)), kernel('k3'), fusion('f', 50)])
  est = schedule.estimate(text, flops_per_cycle=10.0, bytes_per_cycle=3.0)
  assert (est.kernel_cycles, est.uncounted_kernels, est.cycles) == (400 + 300, 1, 750)
  stated = schedule.estimate(text, flops_per_cycle=10.0, bytes_per_cycle=3.0, kernel_flops=2000)
  assert (stated.kernel_cycles, stated.uncounted_kernels, stated.cycles) == (900, 0, 950)
  assert stated.groups['attention'] == 900


def test_collectives_are_outside_the_estimate_and_their_bytes_listed():
  """An all-reduce carries no estimate; its results' bytes (all of a tuple's) are listed per step, loops' trips
  included."""
  reduce = ('  %ar = (f32[8,128]{1,0}, bf16[4,128]{1,0}) all-reduce(%x, %x), channel_id=1, to_apply=%add, '
            'metadata={op_name="jit(f)/transpose(jvp(LM))/psum"}')
  est = schedule.estimate(program([reduce, fusion('f', 5)]), 1.0, 1.0)
  assert (est.cycles, est.collective_bytes) == (5, 8 * 128 * 4 + 4 * 128 * 2)


@pytest.mark.parametrize('op_name, group', [
    ('jit(train_step)/jvp(LM)/while/body/closed_call/layers/laurel/attn/query/dot_general', 'matmuls'),
    ('jit(train_step)/transpose(jvp(LM))/while/body/closed_call/checkpoint/layers/residual/mlp/up/dot_general',
     'matmuls'),
    ('jit(train_step)/jvp(LM)/while/body/closed_call/layers/residual/attn/shard_map/pallas_call', 'attention'),
    ('jit(train_step)/jvp(LM)/while/body/closed_call/layers/laurel/laurel.residual/laurel._pa_term/dot_general',
     'residual stream'),
    ('jit(train_step)/jvp(LM)/while/body/closed_call/layers/residual/norm_attn/reduce_sum', 'norms'),
    ('jit(train_step)/jvp()/while/body/closed_call/loss/reduce_sum', 'loss'),
    ('jit(train_step)/transpose(jvp(loss))/while/body/closed_call/dot_general', 'loss'),
    ('jit(train_step)/optimizer/add', 'optimizer'),
    ('jit(train_step)/jvp(LM)/while/body/jit(dynamic_update_index_in_dim)/dynamic_update_slice', 'layer stacks'),
    ('convert.19', 'other')])
def test_an_instruction_is_grouped_by_its_module_path(op_name, group):
  assert schedule.Op('f', 'fusion', 1, 1, op_name).group == group


# ---------------------------------------------------------------------------------------------------
# On the TPU compiler (libtpu, compile-only devices)

@pytest.fixture(scope='module')
def chip():
  """A sharding on one compile-only v6e chip; JAX's persistent cache off meanwhile (a compile-only client cannot
  load an executable back from it)."""
  jax.config.update('jax_enable_compilation_cache', False)
  yield jax.sharding.NamedSharding(jax.sharding.Mesh(aot.slice_devices('v6e:1x1'), ('chip',)), jax.P())
  jax.config.update('jax_enable_compilation_cache', True)


def compiled(f, *shapes, chip) -> str:
  args = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=chip) for s in shapes]
  return jax.jit(f).lower(*args).compile().as_text()


@pytest.mark.slow
@needs_libtpu
def test_a_matmul_in_a_loop_of_n_trips_counts_n_times(chip):
  """A fori_loop of n chained matmuls costs a fixed part plus n times its body: the body's own estimated cycles, read
  from its computation alone."""
  texts = {n: compiled(lambda a, b, n=n: jax.lax.fori_loop(0, n, lambda i, x: (x @ b).astype(x.dtype), a), (512, 512),
                       (512, 512), chip=chip) for n in (3, 6, 9)}
  totals = {n: schedule.estimate(text, 1.0, 1.0).cycles for n, text in texts.items()}
  _, comps = schedule.computations(texts[3])
  body = next(lines for name, lines in comps.items() if any('/while/body/' in line for line in lines)
              and not name.startswith('fused'))
  per_trip = sum(int(c) for line in body for c in re.findall(r'"estimated_cycles":"(\d+)"', line))
  assert per_trip > 0 and totals[6] - totals[3] == totals[9] - totals[6] == 3 * per_trip


@pytest.mark.slow
@needs_libtpu
@pytest.mark.parametrize('generation, topology', [('v4', 'v4:2x2x1'), ('v5e', 'v5e:1x1'), ('v5p', 'v5p:2x2x1'),
                                                  ('v6e', 'v6e:1x1')])
def test_a_large_matmul_runs_near_the_chips_peak_at_its_clock(generation, topology):
  """The clock table is right: the compiler's cycles for a bfloat16 8192³ product, at the chip's clock, give 60–100%
  of its peak FLOP/s (a clock off by a factor of 1.5 would not)."""
  tpu = hardware.TPUS[generation]
  share = aot.matmul_rate(aot.slice_devices(topology)) * tpu.clock_hz / tpu.peak_flops
  assert 0.6 < share <= 1.0, share


@pytest.mark.slow
@needs_libtpu
def test_a_scanned_layer_stack_costs_what_the_unrolled_one_does(chip):
  """Three layers (x·W_l, tanh) as one scan or written out: the estimate counts the scan's body once per layer. The
  compiler schedules the loop's own copies of its carry besides (the scan came to 1.27× the unrolled stack here, 1.13×
  with a residual add in each layer); the body counted once would give under half, twice over 2×."""
  def stack(scan):
    def forward(w_NxDxD, x_BxD):
      layer = lambda x, w: jnp.tanh(x @ w).astype(x.dtype)
      if scan:
        return jax.lax.scan(lambda x, w: (layer(x, w), None), x_BxD, w_NxDxD)[0].astype(jnp.float32).sum()
      for w in w_NxDxD:
        x_BxD = layer(x_BxD, w)
      return x_BxD.astype(jnp.float32).sum()
    return schedule.estimate(compiled(forward, (3, 16384, 16384), (512, 16384), chip=chip), 1.0, 1.0).cycles
  assert 1.0 <= stack(scan=True) / stack(scan=False) <= 1.4


@pytest.mark.slow
@needs_libtpu
def test_the_steps_groups_cover_its_estimate_and_its_kernels_are_counted():
  small = {**TINY_LM, 'model.num_layers': 2, 'model.dtype': 'bfloat16', 'data.seq_len': 128, 'batch_size': 8,
           'model.attention': 'flash'}
  facts = aot.compile_for_slice(load_config('configs/c4_ablation.py:rw_lr,preset=tiny', small), 'v6e:2x2', costs=False)
  est = facts['schedule']
  assert est['kernel_cycles'] > 0 and est['uncounted_kernels'] == 0 and est['unknown_loops'] == []
  assert sum(est['groups'].values()) == pytest.approx(facts['estimated_cycles'])
  assert {'attention', 'matmuls', 'residual stream', 'optimizer'} <= set(est['groups'])
  assert facts['estimated_step_s'] == facts['estimated_cycles'] / hardware.TPUS['v6e'].clock_hz
