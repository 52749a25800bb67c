"""The run-safety trial of issue 40, rerun: signals at random moments, checkpoint damage, bad command lines.

  python scripts/experiments/run_safety_trial.py [--out=runs/run_safety_trial] [--signals=15] [--seed=0]
      [--parts=signals,phase_signals,damage,bad_inputs] [--result=results/run_safety_trial.json]

$T is the tiny rw_lr run, 30 steps, a checkpoint every 5 (warm-up 5 steps: the row's 50 is refused for 30 steps),
a metrics line every step and a 2-batch final eval, so that a CPU runs it in about a minute.
  signals        an uninterrupted reference run; then --signals runs of $T, each sent SIGKILL, SIGINT or SIGTERM
                 (drawn with --seed) at a random moment (a random delay after the start, or after a random step's
                 line), then rerun to the end. Survived: both exits as specified, every step logged once, and the
                 final parameters, optimizer state, input position, per-step metrics and eval bit-equal to the
                 reference's.
  phase_signals  the same, each signal 1 s into the compile and 0.2 s into the final eval.
  damage         one kind of damage each to a copy of the finished reference run (its latest checkpoint, 30, or its
                 run files), then $T with steps=35: recovered when the run does what laurel specifies for that damage
                 (moved aside and resumed from checkpoint 25, taken as it is, or stopped in one line).
  bad_inputs     command lines that must exit non-zero with one `error:` line on stderr before anything compiles.
Every successful run's stderr is scanned for 'Event loop is closed' and tracebacks.

Each case's result is added to OUT/cases_<part>.jsonl as it finishes; a rerun skips the cases done; parts may run in
separate processes at once. The summary (every part's cases) is written to --result.
"""

import json
import os
import pathlib
import platform
import random
import re
import shutil
import signal
import subprocess
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import common  # pylint: disable=wrong-import-position  # puts the repo root on sys.path
from absl import app, flags  # pylint: disable=wrong-import-position

from laurel import files  # pylint: disable=wrong-import-position

ROOT = common.ROOT
_OUT = flags.DEFINE_string('out', 'runs/run_safety_trial', 'Folder of the trial\'s runs and its cases_*.jsonl.')
_SIGNALS = flags.DEFINE_integer('signals', 15, 'Runs interrupted by a signal.')
_SEED = flags.DEFINE_integer('seed', 0, 'Seed of the signals and their moments.')
_PARTS = flags.DEFINE_list('parts', ['signals', 'phase_signals', 'damage', 'bad_inputs'],
                           'Which parts of the trial to run (each may run in its own process at once).')
_HOST_MEMORY = flags.DEFINE_bool('host_memory_case', False, 'Also data.seq_len=100000 (issue 40 point 6): a compile '
                                  'that may exhaust the host\'s memory before laurel checks it.')
_RESULT = flags.DEFINE_string('result', 'results/run_safety_trial.json', 'The summary (JSON).')

SPEC = f'{ROOT}/configs/c4_ablation.py:rw_lr,preset=tiny'
STEPS, EVERY, LONGER = 30, 5, 35
T_FLAGS = [f'--config.steps={STEPS}', f'--config.checkpoint_every={EVERY}', '--config.optimizer.warmup_steps=5',
           '--config.log_every=1', '--config.eval_steps=2']
# The per-step figures that a resumed run must reproduce bit-exactly (not the timings).
EXACT_FIELDS = ('loss', 'accuracy', 'grad_norm', 'learning_rate', 'eval_loss', 'eval_accuracy')
NOISE = ('Event loop is closed', 'Traceback')
CLUSTER_VARIABLES = ('SLURM_', 'OMPI_', 'PMIX_', 'JOB_COMPLETION_INDEX', 'KUBERNETES_SERVICE_HOST', 'JAX_COORDINATOR')


def env() -> dict:
  variables = {k: v for k, v in os.environ.items() if not k.startswith(CLUSTER_VARIABLES)}
  return {**variables, 'JAX_PLATFORMS': 'cpu', 'PYTHONPATH': str(ROOT)}


def t_command(workdir, *extra, spec=SPEC) -> list[str]:
  """$T in `workdir` (its compilation cache shared by the trial's runs), then `extra` flags."""
  return [sys.executable, '-m', 'laurel.main', f'--config={spec}', f'--workdir={workdir}', *T_FLAGS,
          f'--compilation_cache={OUT / "jax_cache"}', *extra]


def shown(command: list[str]) -> str:
  """`command` as typed in the repo root."""
  return ' '.join(a.replace(sys.executable, 'python').replace(f'{ROOT}/', '') for a in command)


def run(command, timeout=900, cwd=ROOT) -> dict:
  start = time.monotonic()
  result = subprocess.run(command, env=env(), cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False)
  return {'rc': result.returncode, 'stdout': result.stdout, 'stderr': result.stderr,
          's': round(time.monotonic() - start, 1)}


def noise(stderr: str) -> list[str]:
  return [n for n in NOISE if n in stderr]


def error_lines(stderr: str) -> list[str]:
  return [l for l in stderr.splitlines() if l.strip()]


class Cases:
  """OUT/cases_<part>.jsonl: one JSON line per finished case, each file rewritten whole (laurel.files) as a case is
  added; parts may run in separate processes at once (--parts), each writing its own file."""

  def __init__(self, folder: pathlib.Path):
    self.folder = folder
    self.done = {}
    for path in sorted(folder.glob('cases_*.jsonl')):
      for line in path.read_text().splitlines():
        if line.strip():
          case = json.loads(line)
          self.done[case['id']] = case

  def add(self, case: dict) -> None:
    self.done[case['id']] = case
    part = [c for c in self.done.values() if c['part'] == case['part']]
    files.write_text_atomic(self.folder / f"cases_{case['part']}.jsonl", ''.join(json.dumps(c) + '\n' for c in part))
    print(f"{case['id']}: {'ok' if case['ok'] else 'FAILED'} ({case.get('why', '')})", flush=True)


# The run's files, for bit-exact comparisons.

def metrics(workdir) -> list[dict]:
  rows = []
  for line in (pathlib.Path(workdir) / 'metrics.jsonl').read_text().splitlines():
    try:
      rows.append(json.loads(line))
    except json.JSONDecodeError:
      rows.append({'torn': line})
  return rows


def exact(rows: list[dict]) -> dict:
  """{(step, kind): the exact fields} of the train and eval lines."""
  out = {}
  for r in rows:
    values = {k: r[k] for k in EXACT_FIELDS if k in r}
    if values and 'step' in r:
      out[(r['step'], 'eval' if 'eval_loss' in r else 'train')] = values
  return out


def final_state(workdir, step=STEPS):
  """The state and the input position that checkpoint `step` holds, as numpy arrays and JSON."""
  import jax  # pylint: disable=import-outside-toplevel
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  directory = pathlib.Path(workdir).resolve() / 'checkpoints'
  with ocp.CheckpointManager(directory) as mngr:
    state = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))['state']
  data = sorted((directory / str(step) / 'data').glob('process_*'))
  return jax.tree.map(lambda x: jax.device_get(x), state), [p.read_text() for p in data]


def differing_arrays(state, reference) -> list[str]:
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  paths = lambda tree: {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(tree)}
  ours, theirs = paths(state), paths(reference)
  if ours.keys() != theirs.keys():
    return sorted(set(ours) ^ set(theirs))
  return [p for p in ours if not np.array_equal(np.asarray(ours[p]), np.asarray(theirs[p]))]


# a) signals

def reference(cases: Cases) -> dict:
  workdir = OUT / 'reference'
  if 'reference' not in cases.done:
    shutil.rmtree(workdir, ignore_errors=True)
    result = run(t_command(workdir))
    ok = result['rc'] == 0 and not noise(result['stderr'])
    cases.add({'id': 'reference', 'part': 'reference', 'ok': ok, 'command': shown(t_command(workdir)),
               'rc': result['rc'], 's': result['s'], 'noise': noise(result['stderr']),
               'stderr_tail': result['stderr'][-1500:], 'why': f"rc {result['rc']} in {result['s']} s"})
    if not ok:
      raise RuntimeError(f"the reference run failed: {result['stderr'][-3000:]}")
  return cases.done['reference']


def signal_case(name: str, sig: int, trigger: str | None, delay: float, ref_state, ref_rows, part='signals') -> dict:
  """$T in OUT/signals/`name`, sent `sig` `delay` seconds after its stdout shows `trigger` (None: after its start),
  then rerun to the end and compared with the reference."""
  workdir = OUT / 'signals' / name
  shutil.rmtree(workdir, ignore_errors=True)
  workdir.mkdir(parents=True)
  command = t_command(workdir)
  case = {'id': f'signal_{name}', 'part': part, 'signal': signal.Signals(sig).name, 'after': trigger,
          'delay_s': delay}
  out_path, err_path = workdir.parent / f'{name}.stdout', workdir.parent / f'{name}.stderr'
  with open(out_path, 'w') as out, open(err_path, 'w') as err:
    proc = subprocess.Popen(command, env=env(), cwd=ROOT, stdout=out, stderr=err, start_new_session=True)
    start = time.monotonic()
    while trigger and trigger not in out_path.read_text() and proc.poll() is None:
      time.sleep(0.02)
    time.sleep(delay)
    case['sent_at_s'] = round(time.monotonic() - start, 2)
    case['sent'] = proc.poll() is None
    if case['sent']:
      proc.send_signal(sig)
    case['interrupted_rc'] = proc.wait(timeout=600)
  stdout, stderr = out_path.read_text(), err_path.read_text()
  logged = [int(l.split()[1].split('/')[0]) for l in stdout.splitlines() if l.startswith('step ')]
  case['interrupted_last_step_logged'] = max(logged, default=0)
  case['interrupted_stderr'] = error_lines(stderr)[-3:]
  case['interrupted_stdout_tail'] = stdout.splitlines()[-2:]
  expected_rc = {signal.SIGKILL: (-signal.SIGKILL,), signal.SIGINT: (0, 130), signal.SIGTERM: (0, 143)}[sig]
  interrupted_ok = not case['sent'] or (case['interrupted_rc'] in expected_rc and 'Traceback' not in stderr)
  rerun = run(command)
  case.update(rerun_rc=rerun['rc'], rerun_s=rerun['s'], noise=noise(rerun['stderr']),
              resumed_from=next((int(l.split()[3]) for l in rerun['stdout'].splitlines()
                                 if l.startswith('resumed from checkpoint')), 0))
  why = []
  if not interrupted_ok:
    why.append(f"interrupted run: rc {case['interrupted_rc']}, stderr {case['interrupted_stderr']}")
  if rerun['rc'] != 0:
    why.append(f"rerun rc {rerun['rc']}: {rerun['stderr'][-1500:]}")
    case['rerun_stderr_tail'] = rerun['stderr'][-3000:]
  else:
    rows = metrics(workdir)
    steps = [r['step'] for r in rows if 'loss' in r]
    if steps != list(range(1, STEPS + 1)):
      why.append(f'train lines for steps {steps}, not 1..{STEPS} once each')
    if exact(rows) != exact(ref_rows):
      why.append('per-step metrics differ from the reference at ' +
                 str(sorted(k for k in set(exact(rows)) | set(exact(ref_rows))
                            if exact(rows).get(k) != exact(ref_rows).get(k))[:5]))
    state, data = final_state(workdir)
    if differing := differing_arrays(state, ref_state[0]):
      why.append(f'{len(differing)} arrays of checkpoint {STEPS} differ, e.g. {differing[:3]}')
    if data != ref_state[1]:
      why.append(f'the input position of checkpoint {STEPS} differs')
    if case['noise']:
      why.append(f"rerun stderr has {case['noise']}: {rerun['stderr'][-1500:]}")
      case['rerun_stderr_tail'] = rerun['stderr'][-3000:]
  case['ok'] = not why
  case['why'] = '; '.join(why) or (f"{case['signal']} at {case['sent_at_s']} s (step "
                                  f"{case['interrupted_last_step_logged']}); resumed from {case['resumed_from']}; "
                                  'bit-exact')
  return case


def signals(cases: Cases) -> None:
  ref_state, ref_rows = final_state(OUT / 'reference'), metrics(OUT / 'reference')
  rng = random.Random(_SEED.value)
  for i in range(_SIGNALS.value):
    case_rng = random.Random(rng.random())  # each case's draws independent of the others being rerun
    sig = case_rng.choice([signal.SIGKILL, signal.SIGINT, signal.SIGTERM])
    after_step = case_rng.randint(0, STEPS - 1)  # 0: a delay after the start (imports, restore, compiling)
    delay = round(case_rng.uniform(0, 12) if after_step == 0 else case_rng.uniform(0, 1.5), 2)
    if f'signal_{i}' not in cases.done:
      cases.add(signal_case(str(i), sig, f'step {after_step}/{STEPS} ' if after_step else None, delay, ref_state,
                            ref_rows))


def phase_signals(cases: Cases) -> None:
  """Each signal 1 s into the compile and 0.2 s into the final eval: the moments outside the train loop."""
  ref_state, ref_rows = final_state(OUT / 'reference'), metrics(OUT / 'reference')
  for phase, trigger, delay in (('compiling', 'compiling the train step', 1.0), ('eval', 'evaluating on', 0.2)):
    for sig in (signal.SIGKILL, signal.SIGINT, signal.SIGTERM):
      name = f'{phase}_{signal.Signals(sig).name}'
      if f'signal_{name}' not in cases.done:
        cases.add(signal_case(name, sig, trigger, delay, ref_state, ref_rows, part='phase_signals'))


# b) damage to the finished reference run, then $T with steps=35

def largest_array_file(step_dir: pathlib.Path) -> pathlib.Path:
  return max((step_dir / 'state').rglob('d/*'), key=lambda p: p.stat().st_size)


def truncate(path: pathlib.Path) -> None:
  path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])


def flip_byte(path: pathlib.Path) -> None:
  data = bytearray(path.read_bytes())
  data[len(data) // 2] ^= 0x10
  path.write_bytes(bytes(data))


def empty_folder(path: pathlib.Path) -> None:
  for p in path.iterdir():
    shutil.rmtree(p) if p.is_dir() else p.unlink()


def orbax_tmp(workdir: pathlib.Path) -> None:
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  litter = workdir / 'checkpoints' / f'{LONGER}{ocp.path.atomicity_types.TMP_DIR_SUFFIX}'
  shutil.copytree(workdir / 'checkpoints' / str(STEPS), litter)  # a save killed before its rename
  for done in litter.rglob('commit_success.txt'):
    done.unlink()


POISON = """import sys, jax, numpy as np
from laurel import checkpoint, main, train
compile_step = train.compile_step
class Poisoning:  # the step's first call returns a NaN state and the finite loss of the state it was given
  def __init__(self, compiled): self.compiled, self.calls = compiled, 0
  def __getattr__(self, name): return getattr(self.compiled, name)
  def __call__(self, state, batch):
    self.calls += 1
    state, metrics = self.compiled(state, batch)
    if self.calls == 1: state = state.replace(params=jax.tree.map(lambda x: x * np.nan, state.params))
    return state, metrics
def poisoning(*args):
  compiled, *rest = compile_step(*args)
  return (Poisoning(compiled), *rest)
train.compile_step = poisoning
if sys.argv.pop(1) == 'old':  # the code before issue 40 saved any state
  checkpoint.is_finite = lambda state: True
sys.argv[0] = 'laurel'
main.run()
"""


def nan_state(old_code: bool):
  """The step after checkpoint 30 makes the state NaN (as learning_rate=inf did, which validation now refuses):
  with the old code it is saved as checkpoint 31; with today's it must not be, in one line and status 3."""
  def damage(workdir):
    command = [sys.executable, '-c', POISON, 'old' if old_code else 'new'] + t_command(workdir)[3:] + [
        '--config.steps=31', '--config.checkpoint_every=1']
    result = run(command)
    return {'setup_rc': result['rc'], 'setup_stderr': error_lines(result['stderr'])[-3:],
            'setup_command': 'a poisoned step (scripts/experiments/run_safety_trial.py POISON): ' + shown(command)}
  return damage


def torn_last_line(workdir: pathlib.Path) -> None:
  """A kill in the middle of a metrics line (the log is appended to where the filesystem can)."""
  with open(workdir / 'metrics.jsonl', 'a') as f:
    f.write('{"step": 31, "lo')


def config_change(workdir: pathlib.Path) -> None:
  (workdir / 'config.json').unlink()


# kind: (what it does to the workdir W, its latest checkpoint C = W/checkpoints/30, the outcome laurel specifies)
#   moved: C moved to W/unreadable_checkpoints with one warning line, resumed from 25, 35 steps, no line lost;
#   kept: resumed from C (its data is whole), 35 steps; stop: exit 2 with one `error:` line.
def damage_kinds():
  ckpt = lambda w: w / 'checkpoints' / str(STEPS)
  return {
      'truncated_array_file': (lambda w: truncate(largest_array_file(ckpt(w))), 'moved'),
      'flipped_byte_in_array_data': (lambda w: flip_byte(largest_array_file(ckpt(w))), 'moved'),
      'deleted_data_iterator_file': (lambda w: [p.unlink() for p in (ckpt(w) / 'data').glob('process_*')], 'moved'),
      'deleted_state_METADATA': (lambda w: (ckpt(w) / 'state' / '_METADATA').unlink(), 'moved'),
      'corrupt_state_METADATA_json': (lambda w: truncate(ckpt(w) / 'state' / '_METADATA'), 'moved'),
      'deleted_ocdbt_manifest': (lambda w: (ckpt(w) / 'state' / 'manifest.ocdbt').unlink(), 'moved'),
      'corrupt_config_signature_json': (lambda w: truncate(ckpt(w) / 'config' / 'metadata'), 'moved'),
      'corrupt_CHECKPOINT_METADATA_json': (lambda w: truncate(ckpt(w) / '_CHECKPOINT_METADATA'), 'moved_or_kept'),
      'emptied_step_dir': (lambda w: empty_folder(ckpt(w)), 'moved'),
      'deleted_state_dir': (lambda w: shutil.rmtree(ckpt(w) / 'state'), 'moved'),
      'nan_state_saved_by_old_code': (nan_state(old_code=True), 'moved_nan'),
      'deleted_checksum_list': (lambda w: (ckpt(w) / 'checksums.process_0.json').unlink(), 'kept'),
      'orbax_tmp_dir_left_behind': (orbax_tmp, 'kept_no_tmp'),
      'torn_final_json': (lambda w: truncate(w / 'final.json'), 'kept'),
      'torn_last_metrics_line': (torn_last_line, 'kept'),
      'torn_config_json': (lambda w: truncate(w / 'config.json'), 'kept_or_stop'),
      'nan_state_today': (nan_state(old_code=False), 'kept_after_exit_3'),
      'deleted_config_json_then_other_learning_rate': (config_change, 'stop_config'),
      'all_checkpoints_unreadable': (lambda w: [truncate(largest_array_file(w / 'checkpoints' / s))
                                                for s in ('20', '25', '30')], 'stop_fresh'),
  }


def check_damage(kind, expected, workdir, before_metrics, setup, result, cases_extra) -> list[str]:
  why = []
  out, err, rc = result['stdout'], result['stderr'], result['rc']
  warnings = [l for l in err.splitlines() if l.startswith('warning: checkpoint')]
  resumed = next((int(l.split()[3]) for l in out.splitlines() if l.startswith('resumed from checkpoint')), 0)
  aside = sorted(p.name.split('.')[0] for p in (workdir / 'unreadable_checkpoints').iterdir()) if (
      workdir / 'unreadable_checkpoints').is_dir() else []
  final_path = workdir / 'final.json'
  final_step = json.loads(final_path.read_text()).get('step') if rc == 0 and final_path.exists() else None
  cases_extra.update(rc=rc, resumed_from=resumed, moved_aside=aside, warnings=warnings, final_step=final_step,
                     noise=noise(err), stderr_lines=error_lines(err)[-4:])
  if 'Traceback' in err:
    why.append(f'a traceback: {err[-2000:]}')
  lines = error_lines(err)
  if expected == 'kept_or_stop' and rc == 2 and len(lines) == 1 and lines[0].startswith('error: '):
    return why  # refused in one line, naming the file
  if expected.startswith('stop'):  # one error line, after the warnings of the checkpoints it moved aside
    errors = [l for l in lines if not l.startswith('warning: checkpoint') and not re.match(r'W\d{4} ', l)]
    if rc != 2 or len(errors) != 1 or not errors[0].startswith('error: '):
      why.append(f'expected exit 2 and one error line; got rc {rc}, stderr {lines[-4:]}')
    return why
  if expected == 'kept_after_exit_3':
    lines = setup['setup_stderr']
    if setup['setup_rc'] != 3 or not lines or 'last good checkpoint: 30' not in lines[-1]:
      why.append(f"the poisoned run: expected exit 3 naming checkpoint 30; got rc {setup['setup_rc']}, {lines}")
  if rc != 0:
    return why + [f'rc {rc}: {err[-1500:]}']
  if final_step != LONGER:
    why.append(f'final.json step {final_step}, not {LONGER}')
  moved = expected in ('moved', 'moved_nan') or (expected == 'moved_or_kept' and bool(aside))
  want_aside, want_from = (['31'], STEPS) if expected == 'moved_nan' else (['30'], 25) if moved else ([], STEPS)
  if aside != want_aside or resumed != want_from:
    why.append(f'moved aside {aside}, resumed from {resumed}; expected {want_aside} and {want_from}')
  if moved and len(warnings) != 1:
    why.append(f'{len(warnings)} warning lines, not one: {warnings}')
  if expected == 'kept_no_tmp' and list((workdir / 'checkpoints').glob('*tmp*')):
    why.append('the orbax temporary folder is still there')
  text = (workdir / 'metrics.jsonl').read_text()
  kept = before_metrics if kind != 'torn_last_metrics_line' else before_metrics[:before_metrics.rindex('\n') + 1]
  if not text.startswith(kept):
    why.append('metrics.jsonl lost lines')
  if noise(err):
    why.append(f'stderr has {noise(err)}')
  return why


def damage(cases: Cases) -> None:
  for kind, (apply, expected) in damage_kinds().items():
    if f'damage_{kind}' in cases.done:
      continue
    workdir = OUT / 'damage' / kind
    shutil.rmtree(workdir, ignore_errors=True)
    shutil.copytree(OUT / 'reference', workdir)
    before = (workdir / 'metrics.jsonl').read_text()  # a poisoned setup run's step 31 is redone: its line goes
    setup = apply(workdir)
    setup = setup if isinstance(setup, dict) else {}
    if kind == 'torn_last_metrics_line':
      before = (workdir / 'metrics.jsonl').read_text()
    extra = ['--config.optimizer.learning_rate=0.0015'] if expected == 'stop_config' else []
    command = t_command(workdir, f'--config.steps={LONGER}', *extra)
    result = run(command)
    case = {'id': f'damage_{kind}', 'part': 'damage', 'kind': kind, 'expected': expected, 's': result['s'], **setup,
            'command': shown(command)}
    why = check_damage(kind, expected, workdir, before, setup, result, case)
    if expected == 'stop_fresh' and not why:  # it stops again, then trains fresh only when told to
      again = run(command)
      if again['rc'] != 2 or len([l for l in error_lines(again['stderr']) if l.startswith('error: ')]) != 1:
        why.append(f"the rerun: rc {again['rc']}, {error_lines(again['stderr'])[-3:]}")
      fresh = run(command + ['--allow_fresh_start'])
      rows = metrics(workdir)
      new = rows[len(before.splitlines()):]
      case.update(fresh_rc=fresh['rc'], fresh_first_line=new[0] if new else None, fresh_noise=noise(fresh['stderr']))
      if fresh['rc'] != 0 or not new or new[0].get('step') != 1 or 'fresh_start_after' not in new[0]:
        why.append(f"--allow_fresh_start: rc {fresh['rc']}, first new line {new[:1]}: {fresh['stderr'][-1500:]}")
      if noise(fresh['stderr']):
        why.append(f"--allow_fresh_start stderr has {noise(fresh['stderr'])}")
    case['ok'] = not why
    case['why'] = '; '.join(why) or f"{expected}: {case['stderr_lines'][-1:] if expected.startswith('stop') else ''}" \
        f"resumed from {case['resumed_from']}, moved aside {case['moved_aside']}"
    cases.add(case)


# c) bad command lines: (name, the flags after python -m laurel.main, or a whole command)

def bad_inputs() -> list[tuple[str, list[str]]]:
  base = lambda *flags_: ['--config=' + SPEC, '--workdir=WORKDIR', *T_FLAGS, *flags_]
  over = lambda field, value: base(f'--config.{field}={value}')
  cases = [
      # issue 40 point 6
      ('flag_without_value', base('--config.steps')),
      ('seq_len_1', over('data.seq_len', 1)),
      ('empty_corpus', over('data.path', 'EMPTY/*.txt')),
      ('learned_positions_max_len_short', base('--config.model.positional=learned', '--config.model.max_len=64')),
      ('learning_rate_inf', over('optimizer.learning_rate', 'inf')),
      ('rw_scale_inf', over('model.laurel.rw_scale', 'inf')),
      ('rope_base_inf', over('model.rope_base', 'inf')),
      ('steps_1e22', over('steps', 10**22)),
      ('steps_1e22_float', over('steps', '1e22')),
      ('generate_past_context', ['-m', 'laurel.generate', '--workdir=REFERENCE', '--prompt=ab',
                                 '--max_new_tokens=200']),
      ('prepare_text_empty_input', ['scripts/prepare_text.py', '--input=EMPTY/*.txt', '--output=WORKDIR',
                                    '--text_unit=line', '--validation_fraction=0.3', '--vocab_size=512']),
      # typos of fields and flags
      *[(f'typo_{f}', over(f, 1)) for f in (
          'stesp', 'batchsize', 'checkpoint_evry', 'optimizer.learing_rate', 'optimiser.learning_rate',
          'model.d_modle', 'model.laurel.rnak', 'model.lauerl.rank', 'data.seqlen', 'model.laurel.varient')],
      ('typo_flag_workdri', ['--config=' + SPEC, '--workdri=WORKDIR', *T_FLAGS]),
      ('typo_flag_confg', ['--confg=' + SPEC, '--workdir=WORKDIR', *T_FLAGS]),
      ('typo_flag_allow_config_chnage', base('--allow_config_chnage')),
      ('unexpected_positional', base('extra')),
      # wrong types
      *[(f'type_{f}_{v}', over(f, v)) for f, v in (
          ('steps', 'abc'), ('steps', '3.5'), ('batch_size', 'eight'), ('optimizer.learning_rate', 'fast'),
          ('model.laurel.rank', '4.5'), ('model.scan_layers', 'maybe'), ('tensorboard', 'sometimes'),
          ('model.laurel.variant', '7'), ('data.seq_len', '[1]'), ('mesh.data', 'x'), ('seed', 'abc'),
          ('model.d_model', '1e2'), ('optimizer.warmup_steps', 'none'))],
      ('type_preempted_exit', base('--preempted_exit=abc')),
      # out of range
      *[(f'range_{f}_{v}', over(f, v)) for f, v in (
          ('steps', 0), ('steps', -1), ('batch_size', 0), ('batch_size', -16), ('optimizer.learning_rate', 0),
          ('optimizer.learning_rate', -0.001), ('optimizer.learning_rate', 'nan'), ('optimizer.warmup_steps', -1),
          ('optimizer.warmup_steps', 31), ('model.d_model', 0), ('model.d_model', 130), ('model.num_heads', 0),
          ('model.num_heads', 3), ('model.d_ff', 0), ('model.num_layers', 0), ('model.num_layers', -2),
          ('model.vocab_size', 10), ('model.vocab_size', 0), ('model.laurel.rank', 0), ('model.laurel.rank', -1),
          ('model.laurel.variant', 'bogus'), ('model.laurel.rw_norm', 'bogus'), ('model.laurel.rw_scale', 0),
          ('model.laurel.rw_scale', -1), ('model.laurel.rw_scale', 'nan'), ('model.laurel.a_init', 'bogus'),
          ('model.laurel.form', 'bogus'), ('model.laurel.site', 'bogus'), ('model.dtype', 'float8'),
          ('model.param_dtype', 'int8'), ('model.positional', 'bogus'), ('model.norm_position', 'bogus'),
          ('model.mlp', 'bogus'), ('model.attention', 'bogus'), ('model.attention_scores', 'bogus'),
          ('model.remat', 'bogus'), ('model.loss_chunk', -1), ('model.rope_base', 0),
          ('model.rope_base', 1), ('model.rope_base', -5), ('model.max_len', 0), ('optimizer.b1', 1.5),
          ('optimizer.b1', -0.1), ('optimizer.b2', 2), ('optimizer.eps', -1), ('optimizer.weight_decay', -1),
          ('optimizer.grad_clip', -1), ('optimizer.grad_clip', 'nan'), ('optimizer.grad_accum_steps', 0),
          ('optimizer.grad_accum_steps', 3), ('optimizer.min_lr_ratio', 2), ('optimizer.min_lr_ratio', -1),
          ('log_every', 0), ('eval_every', 0), ('eval_steps', 0), ('checkpoint_every', 0), ('checkpoint_every', -5),
          ('keep_checkpoints', 0), ('data.seq_len', 0), ('data.seq_len', -1), ('data.validation_fraction', 1.5),
          ('data.validation_fraction', -0.1), ('data.name', 'bogus'), ('data.num_workers', -1),
          ('data.prefetch', -1), ('mesh.data', 3), ('mesh.tensor', 2), ('mesh.fsdp', 0), ('data_shards', -1),
          ('data_shards', 3), ('model.share.group_size', 0), ('watchdog_factor', -1))],
      # missing or wrong config files
      ('config_missing_file', ['--config=configs/nonexistent.py:rw', '--workdir=WORKDIR']),
      ('config_unknown_row', ['--config=configs/c4_ablation.py:nonexistent_row', '--workdir=WORKDIR']),
      ('config_unknown_preset', ['--config=configs/c4_ablation.py:rw_lr,preset=huge', '--workdir=WORKDIR']),
      ('config_unknown_option', ['--config=configs/c4_ablation.py:rw_lr,preset=tiny,foo=bar', '--workdir=WORKDIR']),
      ('config_unknown_name', ['--config=nonexistent:rw', '--workdir=WORKDIR']),
      ('config_empty', ['--config=', '--workdir=WORKDIR']),
      ('config_not_python', ['--config=README.md', '--workdir=WORKDIR']),
      ('config_absent', ['--workdir=WORKDIR', *T_FLAGS]),
      ('config_workdir_without_run', ['--config=EMPTY', '--workdir=WORKDIR']),
      # bad workdirs
      ('workdir_absent', ['--config=' + SPEC, *T_FLAGS]),
      ('workdir_empty', ['--config=' + SPEC, '--workdir=', *T_FLAGS]),
      ('workdir_is_a_file', ['--config=' + SPEC, '--workdir=README.md', *T_FLAGS]),
      ('workdir_under_a_file', ['--config=' + SPEC, '--workdir=README.md/run', *T_FLAGS]),
      ('workdir_in_proc', ['--config=' + SPEC, '--workdir=/proc/laurel_run', *T_FLAGS]),
      ('workdir_of_another_model', ['--config=' + SPEC, '--workdir=REFERENCE', *T_FLAGS, '--config.model.d_model=64',
                                    '--config.steps=35']),
      ('workdir_of_another_learning_rate', ['--config=' + SPEC, '--workdir=REFERENCE', *T_FLAGS,
                                            '--config.optimizer.learning_rate=0.0015', '--config.steps=35']),
      ('topology_without_compile_only', base('--topology=v6e:4x4')),
  ]
  if _HOST_MEMORY.value:  # its compile alone may take more than the host has: the kernel may kill it (or others)
    cases.append(('seq_len_100000_host_memory', over('data.seq_len', 100000)))
  return cases


def bad_input_case(name: str, args: list[str]) -> dict:
  workdir = OUT / 'bad_inputs' / name
  shutil.rmtree(workdir, ignore_errors=True)
  empty = OUT / 'bad_inputs' / 'empty_corpus_files'
  empty.mkdir(parents=True, exist_ok=True)
  for i in range(3):
    (empty / f'{i}.txt').write_text('')
  reference_copy = OUT / 'bad_inputs' / f'{name}.reference'
  if any('REFERENCE' in a for a in args):  # a copy: a refusal that still wrote would not spoil the reference
    shutil.rmtree(reference_copy, ignore_errors=True)
    shutil.copytree(OUT / 'reference', reference_copy)
  args = [a.replace('WORKDIR', str(workdir)).replace('EMPTY', str(empty)).replace('REFERENCE', str(reference_copy))
          for a in args]
  command = [sys.executable, *(args if args[0] in ('-m',) or args[0].endswith('.py') else ['-m', 'laurel.main', *args])]
  memory = name.endswith('host_memory')  # refused against the compiled step's need: after compiling, before running
  limit = 600 if memory else 60
  start = time.monotonic()
  proc = subprocess.Popen(command, env=env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True)
  stdout_lines, started = [], False
  for line in proc.stdout:  # a run that starts compiling (or training, for the memory case) was accepted: stop it
    stdout_lines.append(line)
    if line.startswith('step ') or (line.startswith('compiling') and not memory):
      started = True
      proc.kill()
      break
  try:
    _, stderr = proc.communicate(timeout=limit)
  except subprocess.TimeoutExpired:
    proc.kill()
    _, stderr = proc.communicate()
    started = True
  lines = error_lines(stderr)
  refused = (not started and proc.returncode not in (0, None) and len(lines) == 1 and lines[0].startswith('error: '))
  case = {'id': f'bad_{name}', 'part': 'bad_inputs', 'command': shown(command), 'rc': proc.returncode,
          's': round(time.monotonic() - start, 1), 'started': started, 'stderr': lines[-3:],
          'stdout_tail': [l.rstrip() for l in stdout_lines[-2:]]}
  if name == 'prepare_text_empty_input' and refused:  # nothing kept that a rerun on good input would reuse
    refused = not any(workdir.glob('*.array_record'))
  case['ok'] = refused
  case['why'] = lines[0][:160] if refused else (f"accepted (reached {'training' if memory else 'compiling'})"
                                                if started else f'rc {proc.returncode}, stderr {lines[-3:]}')
  return case


def bad(cases: Cases) -> None:
  for name, args in bad_inputs():
    if f'bad_{name}' not in cases.done:
      cases.add(bad_input_case(name, args))


def cpu_name() -> str:
  cpuinfo = pathlib.Path('/proc/cpuinfo')
  names = [l.split(':', 1)[1].strip() for l in cpuinfo.read_text().splitlines() if l.startswith('model name')] if (
      cpuinfo.exists()) else []
  return names[0] if names else platform.machine()


def summary(cases: Cases, started: float) -> dict:
  by_part = lambda part: [c for c in cases.done.values() if c['part'] == part]
  counts = {part: {'ok': sum(c['ok'] for c in by_part(part)), 'of': len(by_part(part))}
            for part in ('signals', 'phase_signals', 'damage', 'bad_inputs')}
  successful_runs = [c for c in cases.done.values() if c.get('rerun_rc', c.get('rc')) == 0
                     and c['part'] != 'bad_inputs']
  noisy = [c['id'] for c in successful_runs if c.get('noise')]
  return {
      'command': f'python scripts/experiments/run_safety_trial.py --signals={_SIGNALS.value} --seed={_SEED.value}',
      'this_invocation': common.command(),  # the parts may run in separate processes at once (--parts)
      'device': f'CPU ({cpu_name()}, {os.cpu_count()} cores, shared with other jobs), JAX_PLATFORMS=cpu',
      't': shown(t_command(OUT / 'W')),
      'counts': {**counts, 'successful_runs_scanned': len(successful_runs), 'with_event_loop_or_traceback': noisy},
      'failures': [{k: v for k, v in c.items() if k in ('id', 'why', 'command', 'rc', 'stderr')}
                   for c in cases.done.values() if not c['ok']],
      'wall_s_this_invocation': round(time.monotonic() - started, 1),
      'case_s_total': round(sum(c.get('s', 0) + c.get('rerun_s', 0) for c in cases.done.values())),
      'cases': list(cases.done.values()),
  }


def without_machine_paths() -> list[tuple[str, str]]:
  """(this machine's path, what the results say instead): the repo's (relative paths), Python's folders."""
  pythons = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix)} | {sys.prefix, sys.base_prefix}
  return [(f'{ROOT}/', ''), (str(ROOT), '.'),
          *sorted(((p, 'PYTHON') for p in pythons), key=lambda pair: -len(pair[0]))]


def main_body():
  global OUT  # pylint: disable=global-statement
  OUT = pathlib.Path(_OUT.value).resolve()
  OUT.mkdir(parents=True, exist_ok=True)
  started = time.monotonic()
  cases = Cases(OUT)
  reference(cases)
  parts = {'signals': signals, 'phase_signals': phase_signals, 'damage': damage, 'bad_inputs': bad}
  for part in _PARTS.value:
    parts[part](cases)
  result = summary(Cases(OUT), started)  # every part's cases, those other processes added included
  text = json.dumps(result, indent=2) + '\n'
  for path, name in without_machine_paths():
    text = text.replace(path, name)
  pathlib.Path(_RESULT.value).parent.mkdir(parents=True, exist_ok=True)
  files.write_text_atomic(_RESULT.value, text)
  print(json.dumps(result['counts']), flush=True)


OUT = pathlib.Path('runs/run_safety_trial')

if __name__ == '__main__':
  app.run(common.main(main_body))
