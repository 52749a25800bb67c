"""What the tables of reproduce_c4_ablation.py (ablation_table.py) and sweep.py share: statistics and their printed
forms, figures that fit, and the result files (JSON, CSV, Markdown, PNG), each replaced whole."""

import csv
import io
import json
import statistics
import textwrap

import cli  # puts the repo root on sys.path
import matplotlib
from etils import epath

matplotlib.use('Agg')  # figures go to files
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top,wrong-import-position  # noqa: E402

from laurel import stats  # pylint: disable=g-import-not-at-top,wrong-import-position  # noqa: E402
from laurel.cli import files  # pylint: disable=g-import-not-at-top,wrong-import-position  # noqa: E402

# The luminance at which black and white text contrast equally (WCAG 2 contrast ratios, both about 4.6).
EQUAL_CONTRAST_LUMINANCE = (1.05 * 0.05) ** 0.5 - 0.05


def luminance(rgba) -> float:
  """Relative luminance of an sRGB colour (WCAG 2): 0 black, 1 white."""
  linear = [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in rgba[:3]]
  return 0.2126 * linear[0] + 0.7152 * linear[1] + 0.0722 * linear[2]


def write_results(directory, stem: str, result: dict, rows: list[dict], markdown: str, figure) -> list[epath.Path]:
  """<stem>.json (`result`), .csv (`rows`, the keys whose values are not dicts), .md and .png in `directory`, each
  replaced whole (laurel.cli.files); returns their paths."""
  directory = epath.Path(directory)  # local or gs://
  directory.mkdir(parents=True, exist_ok=True)
  columns = [k for k in dict.fromkeys(k for r in rows for k in r) if not any(isinstance(r.get(k), dict) for r in rows)]
  table, png = io.StringIO(), io.BytesIO()
  writer = csv.DictWriter(table, columns, extrasaction='ignore', lineterminator='\n')
  writer.writeheader()
  writer.writerows(rows)
  figure.savefig(png, format='png', dpi=120)
  plt.close(figure)
  for suffix, text in (('json', json.dumps(result, indent=2) + '\n'), ('csv', table.getvalue()), ('md', markdown)):
    files.write_text_atomic(directory / f'{stem}.{suffix}', text)
  files.write_bytes_atomic(directory / f'{stem}.png', png.getvalue())
  return [directory / f'{stem}.{suffix}' for suffix in ('md', 'csv', 'json', 'png')]


# Statistics and their printed forms, shared by the tables (reproduce_c4_ablation.py, sweep.py).
CI_PERCENT = f'{stats.LEVEL:.0%}'


def paired_columns(values: dict, reference: dict, key: str) -> dict:
  """<key>_diff (mean of values[s] - reference[s] over the seeds s both have), its t-interval (<key>_diff_low,
  _high; None below 2 seeds), the seed count <key>_diff_n and <key>_resolved (the interval excludes zero)."""
  d = stats.paired_difference(values, reference)
  return {f'{key}_diff': d and d.mean, f'{key}_diff_n': d.n if d else 0, f'{key}_diff_sd': d and d.sd,
          f'{key}_diff_low': d and d.low, f'{key}_diff_high': d and d.high, f'{key}_resolved': bool(d and d.resolved)}


def mean_and_spread(values) -> tuple[float | None, float | None]:
  """(mean, sample std) of `values`; the std is None below 2 values, so a table prints no ± for one seed."""
  values = list(values)
  return (statistics.fmean(values) if values else None), (statistics.stdev(values) if len(values) > 1 else None)


def with_spread(mean, std, digits: int = 4) -> str:
  """'2.1728 ± 0.0650', or '2.1728' without a std, '—' without a mean."""
  return '—' if mean is None else f'{mean:.{digits}f}' + ('' if std is None else f' ± {std:.{digits}f}')


def paired_cells(row: dict, key: str, reference: bool = False, digits: int = 4) -> list[str]:
  """A table's cells for paired_columns: '+0.0012 [−0.0034, +0.0058]' (the mean alone for one seed), the seed
  count, and 'yes' where the interval excludes zero ('—' without an interval); '(reference)' for the reference."""
  if reference:
    return ['(reference)', '—', '—']
  mean, low, high = (row.get(f'{key}_diff{part}') for part in ('', '_low', '_high'))
  sign = lambda v: f'{v:+.{digits}f}'.replace('-', '−')
  diff = '—' if mean is None else sign(mean) + ('' if low is None else f' [{sign(low)}, {sign(high)}]')
  resolved = '—' if low is None else 'yes' if row[f'{key}_resolved'] else 'no'
  return [diff, str(row.get(f'{key}_diff_n') or 0), resolved]


def integer(value) -> str:
  """A count as an integer with thousands separators ('1,018,496'), whatever type it was read as."""
  return '—' if value is None else f'{round(value):,}'


def eval_noise(held_out: list[dict]) -> str | None:
  """The eval set's size and its own noise from the runs' final.json held_out (laurel.train), or None if none has
  it: 'the eval set is 2,097,152 tokens in 32 batches; the standard error of a run's eval loss over its batches is
  0.0012–0.0015'."""
  held_out = [h for h in held_out if (h or {}).get('loss_se') is not None]
  if not held_out:
    return None
  ses, unit = [h['loss_se'] for h in held_out], next(k for k in held_out[0] if k not in ('loss_se', 'batches'))
  return (f"the eval set is {integer(held_out[0][unit])} {unit} in {integer(held_out[0]['batches'])} batches; the "
          f"standard error of a run's eval loss over its batches is {min(ses):.4f}–{max(ses):.4f}")


def fit_title(ax, title: str, fontsize: float = 10):
  """The axes' title, wrapped to the width of the axes so that it fits its figure (about 0.6 em a character)."""
  width_points = ax.get_position().width * ax.figure.get_figwidth() * 72
  ax.set_title(textwrap.fill(title, max(12, int(width_points / (0.6 * fontsize)))), fontsize=fontsize)
