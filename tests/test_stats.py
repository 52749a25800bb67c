"""laurel/stats.py: t quantiles as printed tables give them, the paired interval against a hand-computed case,
the eval loss's standard error."""
import math

import pytest

from laurel import stats


@pytest.mark.parametrize('df, expected', [(1, 12.706205), (2, 4.302653), (4, 2.776445), (10, 2.228139),
                                          (1000, 1.962339)])
def test_t_quantile_matches_the_printed_tables(df, expected):
  assert stats.t_quantile(0.975, df) == pytest.approx(expected, abs=2e-6)


def test_paired_interval_by_hand():
  # Differences 0.1, 0.2, 0.3: mean 0.2, sd 0.1, s.e. 0.1/sqrt(3) = 0.0577350; t(0.975, 2) = 4.3026527 gives a
  # half-width of 0.2484138: [-0.0484138, 0.4484138], which holds zero.
  base = {'seed0': 2.0, 'seed1': 2.5, 'seed2': 3.0, 'seed9': 1.0}  # seed9: not in the row, left out
  row = {'seed0': 2.1, 'seed1': 2.7, 'seed2': 3.3}
  d = stats.paired_difference(row, base)
  assert (d.n, d.mean, d.sd) == (3, pytest.approx(0.2), pytest.approx(0.1))
  assert (d.low, d.high) == (pytest.approx(-0.0484138, abs=1e-7), pytest.approx(0.4484138, abs=1e-7))
  assert not d.resolved
  # Differences -0.10, -0.12, -0.11: mean -0.11, sd 0.01, half-width 4.3026527 * 0.01 / sqrt(3) = 0.0248414.
  d = stats.paired_difference({'a': 0.9, 'b': 0.88, 'c': 0.89}, {'a': 1.0, 'b': 1.0, 'c': 1.0})
  assert (d.low, d.high) == (pytest.approx(-0.1348414, abs=1e-7), pytest.approx(-0.0851586, abs=1e-7))
  assert d.resolved


def test_one_seed_has_a_mean_and_no_interval():
  d = stats.paired_difference({'seed0': 1.5}, {'seed0': 1.25, 'seed1': 9.0})
  assert (d.mean, d.n, d.sd, d.low, d.high, d.resolved) == (0.25, 1, None, None, None, False)
  assert stats.paired_difference({'seed0': 1.0}, {'seed1': 1.0}) is None


def test_weighted_mean_se_by_hand():
  # Equal weights: the std of the batch means (2 and 4: 1.414) over sqrt(2) = 1.
  assert stats.weighted_mean_se([2.0, 4.0], [1.0, 1.0]) == pytest.approx(1.0)
  # Sums 10, 30 over 10 and 20 tokens: mean 40 / 30 = 4/3; residuals 10 - 40/3 and 30 - 80/3 (both -+10/3);
  # sqrt(2 / 1 * 2 * (10/3)^2) / 30 = (20/3) / 30 = 0.2222.
  assert stats.weighted_mean_se([10.0, 30.0], [10.0, 20.0]) == pytest.approx(2 / 9)
  assert stats.weighted_mean_se([1.0], [1.0]) is None
  assert math.isclose(stats.weighted_mean_se([3.0, 3.0, 3.0], [1.0, 1.0, 1.0]), 0.0)
