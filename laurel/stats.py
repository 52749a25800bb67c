"""What a table of a few seeds can claim: Student-t intervals of a mean and of paired differences, and the standard
error of an eval loss over its batches (the eval set's own sampling noise, apart from the seeds')."""

import dataclasses
import math
import statistics

LEVEL = 0.95  # the tables' confidence level


def t_quantile(p: float, df: float) -> float:
  """The p-quantile of Student's t with `df` degrees of freedom (scipy, a dependency of jax)."""
  from scipy import stats  # pylint: disable=import-outside-toplevel  # slow to import; the tables alone need it
  return float(stats.t.ppf(p, df))


@dataclasses.dataclass(frozen=True)
class Interval:
  """The mean of n values and its two-sided t-interval at LEVEL; low and high are None below 2 values."""
  mean: float
  n: int
  sd: float | None
  low: float | None
  high: float | None

  @property
  def resolved(self) -> bool:
    """The interval excludes zero."""
    return self.low is not None and (self.low > 0 or self.high < 0)


def paired_difference(values: dict, reference: dict) -> Interval | None:
  """The t-interval of values[k] - reference[k] over the keys (seeds) both have; None where they share none."""
  diffs = [float(values[k] - reference[k]) for k in sorted(set(values) & set(reference))]
  if not diffs:
    return None
  mean = statistics.fmean(diffs)
  if len(diffs) < 2:
    return Interval(mean, 1, None, None, None)
  sd = statistics.stdev(diffs)
  half = t_quantile(0.5 + LEVEL / 2, len(diffs) - 1) * sd / math.sqrt(len(diffs))
  return Interval(mean, len(diffs), sd, mean - half, mean + half)


def weighted_mean_se(sums, weights) -> float | None:
  """The standard error of sum(sums) / sum(weights), the batches being the sampled units (the ratio estimator:
  with equal weights, the std of the batch means over sqrt(batches)). None below 2 batches."""
  sums, weights = [float(s) for s in sums], [float(w) for w in weights]
  if len(sums) < 2 or not sum(weights):
    return None
  mean = sum(sums) / sum(weights)
  residuals = sum((s - mean * w) ** 2 for s, w in zip(sums, weights))
  return math.sqrt(len(sums) / (len(sums) - 1) * residuals) / sum(weights)
