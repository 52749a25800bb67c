"""The suite's own tools (tests/conftest.py): --cpu-times."""
import re
import subprocess
import sys

import pytest

from helpers import ROOT

TESTS = '''
import subprocess, sys, time

def _busy(seconds):
  start = time.process_time()
  while time.process_time() - start < seconds:
    pass

def test_busy_here():
  _busy(0.3)

def test_busy_in_a_subprocess():
  subprocess.run([sys.executable, '-c', 'import time\\nstart = time.process_time()\\n'
                  'while time.process_time() - start < 0.6: pass'], check=True)
'''


@pytest.mark.slow
def test_cpu_times_reports_each_tests_own_and_subprocess_seconds(tmp_path):
  (tmp_path / 'test_timed.py').write_text(TESTS)
  r = subprocess.run([sys.executable, '-m', 'pytest', '-q', '-n', '0', '-p', 'conftest', '-p', 'no:cacheprovider',
                      f'--rootdir={tmp_path}', str(tmp_path / 'test_timed.py'), '--cpu-times=5'],
                     cwd=tmp_path, env={'PYTHONPATH': str(ROOT / 'tests'), 'PATH': ''}, capture_output=True, text=True,
                     timeout=120, check=False)
  assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
  rows = {m['test']: (float(m['own']), float(m['sub'])) for m in re.finditer(
      r'^ *[\d.]+ +(?P<own>[\d.]+) +(?P<sub>[\d.]+)  \S+::(?P<test>\w+)$', r.stdout, re.M)}
  assert rows.keys() == {'test_busy_here', 'test_busy_in_a_subprocess'}, r.stdout
  assert rows['test_busy_here'][0] >= 0.3 and rows['test_busy_here'][1] == 0.0
  assert rows['test_busy_in_a_subprocess'][1] >= 0.6 > rows['test_busy_in_a_subprocess'][0]
  [total] = re.findall(r'^([\d.]+) in all: ([\d.]+) in the test processes, ([\d.]+) in subprocesses$', r.stdout, re.M)
  assert float(total[2]) >= 0.6 and float(total[1]) >= 0.3
