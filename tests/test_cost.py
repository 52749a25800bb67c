"""laurel.plan.cost: what the pre-flight says a run will cost, checked against figures worked out by hand."""
import pytest
from absl.testing import flagsaver

from laurel.plan import cost

# A v6e-16 run: 6e15 model FLOPs and 256 x 1024 tokens a step, 1,000 steps, 918 TFLOP/s per chip.
RUN = {'model_flops': 6e15, 'units_per_step': 256 * 1024, 'steps': 1000, 'chips': 16, 'peak_flops': 918e12}


def test_an_assumed_mfu_gives_step_time_wall_time_and_chip_hours():
  est = cost.estimate(**RUN, mfu=0.5)
  # 6e15 / (16 · 918e12 · 0.5) = 6e15 / 7.344e15 s; 1,000 of them; 16 chips for that long.
  assert est['step_s'] == pytest.approx(0.816993, rel=1e-6)
  assert est['wall_s'] == pytest.approx(816.993, rel=1e-6)
  assert est['chip_hours'] == pytest.approx(3.631082, rel=1e-6)
  assert cost.line(est, 'tokens') == (
      'cost: 262,144 tokens per step; 0.817 s per step (320,864 tokens/s), 1,000 steps in 13m36s on 16 chips: 3.63 '
      'chip-hours (estimated from an MFU of 50% (--mfu); training steps only: not compiling, evaluation or '
      'checkpoints)')


def test_without_an_mfu_the_compilers_schedule_sets_the_step_time_and_the_mfu_it_implies():
  est = cost.estimate(**RUN, cycles=3.5e9, clock_hz=1.75e9)  # 2 s a step
  assert (est['step_s'], est['wall_s']) == (2.0, 2000.0)
  assert est['chip_hours'] == pytest.approx(16 * 2000 / 3600)
  assert est['mfu'] == pytest.approx(6e15 / (16 * 918e12 * 2.0))  # 20.4%
  assert cost.line(est, 'tokens') == (
      'cost: 262,144 tokens per step; 2 s per step (131,072 tokens/s), 1,000 steps in 33m20s on 16 chips: 8.89 '
      "chip-hours (estimated from the TPU compiler's schedule, 3,500.0M cycles per chip at 1.75 GHz: an MFU of "
      '20.4%; --mfu=F assumes a measured one; training steps only: not compiling, evaluation or checkpoints)')


@pytest.mark.parametrize('value', [0.0, 1.5, -0.2])
def test_an_mfu_outside_0_1_is_one_line(value):
  with flagsaver.flagsaver(mfu=value), pytest.raises(ValueError, match=rf'^mfu={value}: must be a fraction in '
                                                                       r'\(0, 1\]'):
    cost.mfu_flag()


def test_the_mfu_flag_is_read_when_set():
  with flagsaver.flagsaver(mfu=0.4):
    assert cost.mfu_flag() == 0.4
  assert cost.mfu_flag() is None
