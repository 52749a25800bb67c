"""What a table of a few seeds can claim: Student-t intervals of a mean and of paired differences, and the standard
error of an eval loss over its batches (the eval set's own sampling noise, apart from the seeds')."""

import dataclasses
import math
import statistics

LEVEL = 0.95  # the tables' confidence level


def _incomplete_beta(x: float, a: float, b: float) -> float:
  """The regularised incomplete beta I_x(a, b), by its continued fraction (Lentz's method)."""
  if x <= 0 or x >= 1:
    return min(max(x, 0.0), 1.0)
  if x > (a + 1) / (a + b + 2):  # the fraction converges fast on this side only
    return 1.0 - _incomplete_beta(1.0 - x, b, a)
  front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)) / a
  tiny, c, d = 1e-300, 1.0, 1.0 - (a + b) * x / (a + 1)
  d = 1.0 / (d if abs(d) > tiny else tiny)
  result = d
  for m in range(1, 500):
    for numerator in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                      -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
      d = 1.0 + numerator * d
      d = 1.0 / (d if abs(d) > tiny else tiny)
      c = 1.0 + numerator / c
      c = c if abs(c) > tiny else tiny
      result *= c * d
    if abs(c * d - 1.0) < 1e-15:
      break
  return front * result


def t_cdf(t: float, df: float) -> float:
  """P(T <= t) for Student's t with `df` degrees of freedom."""
  tail = 0.5 * _incomplete_beta(df / (df + t * t), df / 2, 0.5)
  return 1.0 - tail if t > 0 else tail


def t_quantile_pure(p: float, df: float) -> float:
  """The p-quantile of Student's t, by bisection on t_cdf: needs no scipy."""
  if not 0 < p < 1 or df <= 0:
    raise ValueError(f't_quantile: need 0 < p < 1 and df > 0 (got p={p}, df={df})')
  if p < 0.5:
    return -t_quantile_pure(1 - p, df)
  low, high = 0.0, 1.0
  while t_cdf(high, df) < p:
    high *= 2
  for _ in range(200):
    mid = (low + high) / 2
    low, high = (mid, high) if t_cdf(mid, df) < p else (low, mid)
    if high - low < 1e-12 * max(1.0, high):
      break
  return (low + high) / 2


def t_quantile(p: float, df: float) -> float:
  """scipy's where installed, else t_quantile_pure (the same to ~1e-10)."""
  try:
    from scipy import stats  # pylint: disable=import-outside-toplevel
  except ImportError:
    return t_quantile_pure(p, df)
  return float(stats.t.ppf(p, df))


@dataclasses.dataclass(frozen=True)
class Interval:
  """The mean of n values and its two-sided t-interval at `level`; low and high are None below 2 values."""
  mean: float
  n: int
  sd: float | None
  low: float | None
  high: float | None
  level: float = LEVEL

  @property
  def resolved(self) -> bool:
    """The interval excludes zero."""
    return self.low is not None and (self.low > 0 or self.high < 0)


def mean_interval(values, level: float = LEVEL) -> Interval | None:
  """The t-interval of the mean of `values` (None for none)."""
  values = [float(v) for v in values]
  if not values:
    return None
  mean = statistics.fmean(values)
  if len(values) < 2:
    return Interval(mean, 1, None, None, None, level)
  sd = statistics.stdev(values)
  half = t_quantile(0.5 + level / 2, len(values) - 1) * sd / math.sqrt(len(values))
  return Interval(mean, len(values), sd, mean - half, mean + half, level)


def paired_difference(values: dict, reference: dict, level: float = LEVEL) -> Interval | None:
  """The t-interval of values[k] - reference[k] over the keys (seeds) both have; None where they share none."""
  return mean_interval([values[k] - reference[k] for k in sorted(set(values) & set(reference))], level)


def weighted_mean_se(sums, weights) -> float | None:
  """The standard error of sum(sums) / sum(weights), the batches being the sampled units (the ratio estimator:
  with equal weights, the std of the batch means over sqrt(batches)). None below 2 batches."""
  sums, weights = [float(s) for s in sums], [float(w) for w in weights]
  if len(sums) < 2 or not sum(weights):
    return None
  mean = sum(sums) / sum(weights)
  residuals = sum((s - mean * w) ** 2 for s, w in zip(sums, weights))
  return math.sqrt(len(sums) / (len(sums) - 1) * residuals) / sum(weights)
