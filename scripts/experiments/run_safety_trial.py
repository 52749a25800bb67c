"""The run-safety trial of issues 40 and 54: signals at random moments, checkpoint damage, bad command lines, and the
layers around a run (lease, checksum lists, a full disk, scripts sharing a folder, exit statuses, a lost process).

  python scripts/experiments/run_safety_trial.py [--out=runs/run_safety_trial] [--signals=15] [--seed=0]
      [--parts=signals,phase_signals,damage,bad_inputs,lease,checksums,disk,tables,exits,peers,smaller]
      [--cases=NAME,...] [--stop_s=65] [--lease_timing=HEARTBEAT_S,STALE_S] [--result=results/run_safety_trial.json]

$T is the tiny rw_lr run, 30 steps, a checkpoint every 5 (warm-up 5 steps: the row's 50 is refused for 30 steps),
a metrics line every step and a 2-batch final eval, so that a CPU runs it in about a minute.
  signals        an uninterrupted reference run; then --signals runs of $T, each sent SIGKILL, SIGINT or SIGTERM
                 (drawn with --seed) at a random moment (a random delay after the start, or after a random step's
                 line), then rerun to the end. Survived: both exits as specified, every step logged once, and the
                 final parameters, optimizer state, input position, per-step metrics and eval bit-equal to the
                 reference's.
  phase_signals  the same, each signal 1 s into the compile and 0.2 s into the final eval.
  damage         one kind of damage each to a copy of the finished reference run (its latest checkpoint, 30, its
                 checksum lists, its lease file or its run files), then $T with steps=35: recovered when the run does
                 what laurel specifies for that damage (moved aside and resumed from checkpoint 25, taken as it is,
                 or stopped in one line).
  bad_inputs     command lines that must exit non-zero with one `error:` line on stderr before anything compiles.
Issue 54's parts, each case as its "What must hold" says (the statuses: the constants below, laurel's own where it
names them):
  lease          a restarted container (unshare --pid, else pid 1 simulated), a holder stopped for --stop_s, a
                 second run with its clock 90 s ahead, another holder's lease written over a live run's (fencing),
                 a dead lease whose heartbeat is an hour ahead.
  checksums      SIGKILL once checkpoint 25 is saved, then a bit flipped in it.
  disk           a tmpfs that fills at the third checkpoint, one full at start, one turned read-only at step 12
                 (root: mount -t tmpfs).
  tables         two reproduce_c4_ablation.py with one --out, two sweep.py on one --workdir, at once.
  exits          SIGTERM at step 10 under Slurm's variables; SIGTERM in the final eval, with and without them.
  peers          process 1 of a two-process Slurm simulation SIGKILLed at step 5.
  smaller        a kill between the first config_history.jsonl line and config.json; next: commands quoting a
                 workdir with spaces. (.tmp leftovers are a damage kind.)
Every successful run's stderr is scanned for 'Event loop is closed' and tracebacks.

Each case's result is added to OUT/cases_<part>.jsonl as it finishes; a rerun skips the cases done; parts may run in
separate processes at once. The summary (every part's cases) is written to --result.
"""

import contextlib
import json
import os
import pathlib
import platform
import random
import re
import shutil
import shlex
import signal
import socket
import subprocess
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import common  # pylint: disable=wrong-import-position  # puts the repo root on sys.path
from absl import app, flags  # pylint: disable=wrong-import-position

from laurel.run import files, process

ROOT = common.ROOT
_OUT = flags.DEFINE_string('out', 'runs/run_safety_trial', 'Folder of the trial\'s runs and its cases_*.jsonl.')
_SIGNALS = flags.DEFINE_integer('signals', 15, 'Runs interrupted by a signal.')
_SEED = flags.DEFINE_integer('seed', 0, 'Seed of the signals and their moments.')
_PARTS = flags.DEFINE_list('parts', ['signals', 'phase_signals', 'damage', 'bad_inputs', 'lease', 'checksums', 'disk',
                                     'tables', 'exits', 'peers', 'smaller'],
                           'Which parts of the trial to run (each may run in its own process at once).')
_HOST_MEMORY = flags.DEFINE_bool('host_memory_case', False, 'Also data.seq_len=100000 (issue 40 point 6): a compile '
                                  'that may exhaust the host\'s memory before laurel checks it.')
_RESULT = flags.DEFINE_string('result', 'results/run_safety_trial.json', 'The summary (JSON).')
_CASES = flags.DEFINE_list('cases', [], 'Only these cases of the damage part and issue 54\'s (e.g. peer_death); '
                           'default: all.')
_STOP_S = flags.DEFINE_float('stop_s', 65, 'How long the lease case stops its first run (SIGSTOP): past the lease\'s '
                             'stale limit (60 s, or --lease_timing\'s).')
_LEASE_TIMING = flags.DEFINE_string('lease_timing', '', "HEARTBEAT_S,STALE_S of the lease cases' runs (e.g. 1,8 with "
                                    '--stop_s=12, for a shorter trial); default: the lease\'s own.')

SPEC = f'{ROOT}/configs/c4_ablation.py:rw_lr,preset=tiny'
STEPS, EVERY, LONGER = 30, 5, 35
T_FLAGS = [f'--config.steps={STEPS}', f'--config.checkpoint_every={EVERY}', '--config.optimizer.warmup_steps=5',
           '--config.log_every=1', '--config.eval_steps=2']
# The per-step figures that a resumed run must reproduce bit-exactly (not the timings).
EXACT_FIELDS = ('loss', 'accuracy', 'grad_norm', 'learning_rate', 'eval_loss', 'eval_accuracy')
NOISE = ('Event loop is closed', 'Traceback')


# The exit statuses issue 54's cases expect, as laurel defines them.
BAD_INPUT = 2
PREEMPTED = process.PREEMPTED  # stopped before it finished, under a scheduler
HELD = process.HELD  # another live run holds the workdir
PEER_LOST = process.PEER_LOST  # a process of the run died (the join's status: restart them all)
FENCED = process.LOST  # the run found its lease taken: it stops before writing
SAVE_FAILED = process.DIVERGED  # a checkpoint could not be written: a rerun would repeat it
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
  """OUT/cases_<part>.jsonl: one JSON line per finished case, each file rewritten whole (laurel.run.files) as a case is
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
from laurel import main
from laurel.run import checkpoint
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
  listed = lambda w: ckpt(w) / 'checksums.process_0.json'
  every_list = lambda w: (w / 'checkpoints').glob('*/checksums.process_*.json')
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
      'deleted_checksum_list': (lambda w: (ckpt(w) / 'checksums.process_0.json').unlink(), 'moved'),  # unvouched
      'orbax_tmp_dir_left_behind': (orbax_tmp, 'kept_no_tmp'),
      'torn_final_json': (lambda w: truncate(w / 'final.json'), 'kept'),
      'torn_last_metrics_line': (torn_last_line, 'kept'),
      'torn_config_json': (lambda w: truncate(w / 'config.json'), 'kept_or_stop'),
      'nan_state_today': (nan_state(old_code=False), 'kept_after_exit_3'),
      'deleted_config_json_then_other_learning_rate': (config_change, 'stop_config'),
      'all_checkpoints_unreadable': (lambda w: [truncate(largest_array_file(w / 'checkpoints' / s))
                                                for s in ('20', '25', '30')], 'stop_fresh'),
      # issue 54 point 4: a damaged list alone never sets intact data aside, and is never a traceback
      'checksum_list_random_bytes': (lambda w: listed(w).write_bytes(random.Random(54).randbytes(64)), 'kept'),
      'checksum_list_empty_json_list': (lambda w: listed(w).write_text('[]'), 'kept'),
      'checksum_list_without_files': (lambda w: listed(w).write_text('{"step": 30}'), 'kept'),
      'checksum_list_truncated': (lambda w: truncate(listed(w)), 'kept'),
      'every_checksum_list_truncated': (lambda w: [truncate(p) for p in every_list(w)], 'kept'),
      # issue 54 point 6: a damaged lease file is taken over or refused in one line, never a traceback
      'lease_heartbeat_of_a_wrong_type': (lambda w: write_lease(w, heartbeat='soon'), 'kept_or_stop'),
      'lease_is_a_directory': (lambda w: (w / 'lease.json').mkdir(), 'kept_or_stop'),
      'lease_random_bytes': (lambda w: (w / 'lease.json').write_bytes(random.Random(6).randbytes(64)),
                             'kept_or_stop'),
      # issue 54 point 9: the temporary files of atomic writes a kill cut short are removed
      'tmp_files_of_cut_writes': (tmp_leftovers, 'kept_no_tmp'),
  }


def write_lease(workdir: pathlib.Path, **fields) -> None:
  """A lease file of a run on this host whose pid is gone, with `fields` instead of its own."""
  dead = subprocess.Popen([sys.executable, '-c', 'pass'])
  dead.wait()
  record = {'host': socket.gethostname(), 'pid': dead.pid, 'process_id': 0, 'processes': 1,
            'started_at': '2026-01-01T00:00:00+00:00', 'heartbeat': time.time(), 'token': 'trial', **fields}
  (workdir / 'lease.json').write_text(json.dumps(record))


def tmp_leftovers(workdir: pathlib.Path) -> None:
  for path in (workdir / '.config.json.k1ll3d.tmp', workdir / '.final.json.k1ll3d.tmp',
               workdir / 'checkpoints' / str(STEPS) / '.checksums.process_0.json.k1ll3d.tmp'):
    path.write_text('{"cut": ')


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
  if kind.startswith('lease_') and re.search(r'\bNone\b|-\d+ s ago', err):
    why.append(f'a lease line naming None or a negative age: {lines[-2:]}')
  if expected == 'kept_or_stop' and rc in (BAD_INPUT, HELD) and len(lines) == 1 and lines[0].startswith('error: '):
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
  if expected == 'kept_no_tmp' and list((workdir / 'checkpoints').glob('*tmp*')) + list(workdir.rglob('*.tmp')):
    why.append(f"temporary files are still there: {list((workdir / 'checkpoints').glob('*tmp*'))[:2]}, "
               f"{[p.name for p in workdir.rglob('*.tmp')][:3]}")
  text = (workdir / 'metrics.jsonl').read_text()
  kept = before_metrics if kind != 'torn_last_metrics_line' else before_metrics[:before_metrics.rindex('\n') + 1]
  if not text.startswith(kept):
    why.append('metrics.jsonl lost lines')
  if noise(err):
    why.append(f'stderr has {noise(err)}')
  return why


def damage(cases: Cases) -> None:
  for kind, (apply, expected) in damage_kinds().items():
    if f'damage_{kind}' in cases.done or (_CASES.value and kind not in _CASES.value):
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
      ('generate_past_context', ['-m', 'laurel.serve.generate', '--workdir=REFERENCE', '--prompt=ab',
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


# d) issue 54: the layers around the run (lease, checksums, a full disk, scripts sharing a folder, exit statuses, the
# smaller points). Each case is a function of the reference's metrics (rows) returning (what it saw, why it failed).

WRAPPER = """import os, sys, time
patch, timing = sys.argv.pop(1), sys.argv.pop(1)
if patch.startswith('clock+'):  # this process's clock runs ahead (another host's)
  ahead, real_time = float(patch[6:]), time.time
  time.time = lambda: real_time() + ahead
elif patch == 'pid1':  # a container's python is pid 1 in every incarnation
  os.getpid = lambda: 1
if timing:  # the lease's heartbeat and stale limit, in seconds
  from laurel.run import lease
  heartbeat_s, stale_s = map(float, timing.split(','))
  init = lease.Lease.__init__
  def shortened(self, *args, **kwargs):
    kwargs.setdefault('heartbeat_s', heartbeat_s)
    kwargs.setdefault('stale_s', stale_s)
    init(self, *args, **kwargs)
  lease.Lease.__init__ = shortened
from laurel import main
sys.argv[0] = 'laurel'
main.run()
"""
SLURM = {'SLURM_JOB_ID': '54', 'SLURM_NTASKS': '1', 'SLURM_PROCID': '0'}  # sbatch's one task: no join


def w_command(workdir, patch='', *extra) -> list[str]:
  """$T through WRAPPER: `patch` (clock+SECONDS, pid1 or ''), the lease timing of --lease_timing."""
  return [sys.executable, '-c', WRAPPER, patch, _LEASE_TIMING.value] + t_command(workdir)[3:] + list(extra)


class Started:
  """A command running in the background, its output in files beside `workdir`."""

  def __init__(self, command, workdir: pathlib.Path, name: str, environ=None):
    workdir.parent.mkdir(parents=True, exist_ok=True)
    self.out, self.err = workdir.parent / f'{name}.stdout', workdir.parent / f'{name}.stderr'
    with open(self.out, 'w') as out, open(self.err, 'w') as err:
      self.proc = subprocess.Popen(command, env={**env(), **(environ or {})}, cwd=ROOT, stdout=out, stderr=err,
                                   start_new_session=True)

  def wait_for(self, text: str, timeout=600) -> bool:
    deadline = time.monotonic() + timeout
    while text not in self.out.read_text():
      if self.proc.poll() is not None or time.monotonic() > deadline:
        return False
      time.sleep(0.05)
    return True

  def signal(self, sig) -> None:
    with contextlib.suppress(ProcessLookupError):
      os.killpg(self.proc.pid, sig)

  def wait(self, timeout=900) -> dict:
    try:
      rc = self.proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
      self.signal(signal.SIGKILL)
      rc = f'no exit in {timeout} s'
    return {'rc': rc, 'stdout': self.out.read_text(), 'stderr': self.err.read_text()}


def one_line_stop(result: dict, status: int | None) -> list[str]:
  """Why `result` is not a stop with `status` (None: any but 0 and 1) and one `error:` line, without a traceback."""
  errors = [l for l in error_lines(result['stderr']) if l.startswith('error: ')]
  ok_status = result['rc'] == status if status is not None else result['rc'] not in (0, 1) and isinstance(
      result['rc'], int) and result['rc'] > 0
  if ok_status and len(errors) == 1 and 'Traceback' not in result['stderr']:
    return []
  return [f"expected status {status or 'not 0 or 1'} and one error line; got rc {result['rc']}, "
          f"{error_lines(result['stderr'])[-3:]}"]


def finished_like_reference(workdir, ref_rows, result) -> list[str]:
  """Why a run that should have finished did not, with every step logged once and bit-equal to the reference."""
  if result['rc'] != 0:
    return [f"rc {result['rc']}: {error_lines(result['stderr'])[-3:]}"]
  why = [f'stderr has {noise(result["stderr"])}'] if noise(result['stderr']) else []
  rows = metrics(workdir)
  if [r['step'] for r in rows if 'loss' in r] != list(range(1, STEPS + 1)):
    why.append(f"train lines for steps {[r['step'] for r in rows if 'loss' in r]}, not 1..{STEPS} once each")
  if exact(rows) != exact(ref_rows):
    why.append('per-step metrics differ from the reference')
  return why


def fresh(name: str) -> pathlib.Path:
  workdir = OUT / 'issue54' / name / 'run'
  shutil.rmtree(workdir.parent, ignore_errors=True)
  workdir.parent.mkdir(parents=True)
  return workdir


def restarted_container(ref_rows) -> tuple[dict, list[str]]:
  """Point 1: the run as a container's pid 1 (unshare; else os.getpid patched), SIGKILLed at step 25, then the same
  again: the rerun is not refused by its own earlier incarnation."""
  workdir = fresh('restarted_container')
  unshare = ['unshare', '--pid', '--fork', '--mount-proc']
  real = shutil.which('unshare') and subprocess.run(unshare + ['true'], capture_output=True).returncode == 0
  command = unshare + t_command(workdir) if real else w_command(workdir, 'pid1')
  first = Started(command, workdir, 'first')
  killed = first.wait_for(f'step 25/{STEPS}')
  first.signal(signal.SIGKILL)
  first.wait()
  rerun = run(command)
  seen = {'pid_namespace': 'unshare --pid --fork --mount-proc' if real else 'os.getpid() patched to 1',
          'command': shown(command), 'rerun_rc': rerun['rc'], 'rerun_stderr': error_lines(rerun['stderr'])[-2:]}
  return seen, ([] if killed else ['not killed at step 25']) + finished_like_reference(workdir, ref_rows, rerun)


def second_run_on_a_live_holder(ref_rows, name: str, stop_s: float = 0, patch: str = '') -> tuple[dict, list[str]]:
  """Point 2: a run holds the workdir; it is stopped (SIGSTOP) for `stop_s` first, or the second run's clock is
  ahead (`patch`). The second run is refused (HELD, one line) and the first finishes with every step logged once."""
  workdir = fresh(name)
  first = Started(w_command(workdir), workdir, 'first')
  why = [] if first.wait_for(f'step 5/{STEPS}') else ['the first run did not reach step 5']
  if stop_s:
    first.signal(signal.SIGSTOP)
    time.sleep(stop_s)
  second = run(w_command(workdir, patch))
  first.signal(signal.SIGCONT)
  result = first.wait()
  why += one_line_stop(second, HELD) + finished_like_reference(workdir, ref_rows, result)
  seen = {'stopped_s': stop_s, 'second': patch or 'same clock', 'second_rc': second['rc'],
          'second_stderr': error_lines(second['stderr'])[-2:], 'first_rc': result['rc'],
          'command': shown(w_command(workdir, patch))}
  return seen, why


def stopped_holder(ref_rows):
  return second_run_on_a_live_holder(ref_rows, 'stopped_holder', stop_s=_STOP_S.value)


def skewed_clock(ref_rows):
  return second_run_on_a_live_holder(ref_rows, 'skewed_clock', patch='clock+90')


def lease_taken_while_running(ref_rows) -> tuple[dict, list[str]]:
  """Point 2 (fencing): another holder's lease written over a live run's at step 5: the run stops in one line
  (FENCED) before its next checkpoint, and leaves the other's lease and the log's steps as they were."""
  del ref_rows
  workdir = fresh('lease_taken_while_running')
  first = Started(w_command(workdir), workdir, 'first')
  why = [] if first.wait_for(f'step 5/{STEPS}') else ['step 5 not reached']
  write_lease(workdir, host='another-host', pid=1, token='intruder', heartbeat=time.time() + 5)
  taken_at = max((r['step'] for r in metrics(workdir) if 'loss' in r), default=0)
  result = first.wait()
  why += one_line_stop(result, FENCED)
  lease_now = (workdir / 'lease.json').read_text() if (workdir / 'lease.json').is_file() else ''
  if 'intruder' not in lease_now:
    why.append('the other holder\'s lease was overwritten or removed')
  saved = [int(p.name) for p in (workdir / 'checkpoints').glob('*') if p.name.isdigit()]
  if any(step > taken_at + EVERY for step in saved):
    why.append(f'checkpoints {sorted(saved)} saved after the lease was taken at step {taken_at}')
  return {'taken_at_step': taken_at, 'rc': result['rc'], 'stderr': error_lines(result['stderr'])[-2:]}, why


def heartbeat_from_a_clock_ahead(ref_rows) -> tuple[dict, list[str]]:
  """Point 6: the lease of a run on another host whose clock is an hour ahead, no longer renewed: it blocks the
  workdir no longer than the stale limit, and no line names a negative age."""
  workdir = OUT / 'issue54' / 'clock_ahead' / 'run'
  shutil.rmtree(workdir.parent, ignore_errors=True)
  shutil.copytree(OUT / 'reference', workdir)
  write_lease(workdir, host='another-host', heartbeat=time.time() + 3600)
  command = w_command(workdir, '', f'--config.steps={LONGER}')
  tries, stale_s = [], float(_LEASE_TIMING.value.split(',')[1]) if _LEASE_TIMING.value else 60.0
  for _ in range(2):
    tries.append(run(command))
    if tries[-1]['rc'] != HELD:
      break
    time.sleep(stale_s + 5)  # refused while it might live: never past the stale limit
  why = [f'a negative age: {error_lines(t["stderr"])[-1:]}' for t in tries if re.search(r'-\d+ s ago', t['stderr'])]
  if tries[-1]['rc'] != 0 or 'Traceback' in tries[-1]['stderr']:
    why.append(f"rc {[t['rc'] for t in tries]}: {error_lines(tries[-1]['stderr'])[-2:]}")
  return {'rcs': [t['rc'] for t in tries], 'command': shown(command)}, why


def crash_then_flipped_bit(ref_rows) -> tuple[dict, list[str]]:
  """Point 3: SIGKILL once checkpoint 25 is saved (the newest), a bit flipped in it: the rerun moves it aside and
  resumes from 20, as the reference."""
  workdir = fresh('crash_then_flipped_bit')
  first = Started(t_command(workdir), workdir, 'first')
  newest = workdir / 'checkpoints' / '25'
  saved = first.wait_for(f'step 27/{STEPS}')
  while saved and not (newest / '_CHECKPOINT_METADATA').exists() and first.proc.poll() is None:
    time.sleep(0.05)
  first.signal(signal.SIGKILL)
  first.wait()
  listed = (newest / 'checksums.process_0.json').exists()
  flip_byte(largest_array_file(newest))
  rerun = run(t_command(workdir))
  aside = sorted(p.name.split('.')[0] for p in (workdir / 'unreadable_checkpoints').glob('*'))
  why = [] if saved else ['not killed after checkpoint 25']
  if aside != ['25']:
    why.append(f'moved aside {aside}, not [25] (its checksum list was {"there" if listed else "missing"})')
  if rerun['rc'] != 0 or exact(metrics(workdir)) != exact(ref_rows):
    why.append(f"rerun rc {rerun['rc']}, metrics {'equal' if exact(metrics(workdir)) == exact(ref_rows) else 'differ'}"
               f": {error_lines(rerun['stderr'])[-2:]}")
  return {'checksum_list_at_the_kill': listed, 'moved_aside': aside, 'command': shown(t_command(workdir))}, why


@contextlib.contextmanager
def tmpfs(folder: pathlib.Path, size: str):
  """A tmpfs of `size` at `folder` (root only), removed afterwards."""
  folder.mkdir(parents=True, exist_ok=True)
  subprocess.run(['mount', '-t', 'tmpfs', '-o', f'size={size}', 'tmpfs', str(folder)], check=True,
                 capture_output=True)
  try:
    yield folder
  finally:
    subprocess.run(['umount', '-l', str(folder)], check=False, capture_output=True)


def remount(folder: pathlib.Path, options: str, tries: int = 100) -> None:
  """Remounts `folder`; read-only only between writes (a file open for writing: EBUSY), so retried."""
  for _ in range(tries - 1):
    if subprocess.run(['mount', '-o', f'remount,{options}', str(folder)], capture_output=True).returncode == 0:
      return
    time.sleep(0.05)
  subprocess.run(['mount', '-o', f'remount,{options}', str(folder)], check=True, capture_output=True)


def disk_size(path: pathlib.Path) -> int:
  return sum(p.stat().st_size for p in path.rglob('*') if p.is_file())


def full_disk(ref_rows) -> tuple[dict, list[str]]:
  """Point 5: a disk with room for about two checkpoints: the failed save stops the run at once in one line; the
  rerun on the still-full disk stops before training; with room again it finishes as the reference."""
  reference_dir = OUT / 'reference'
  size = disk_size(reference_dir) - disk_size(reference_dir / 'checkpoints') + int(
      2.5 * disk_size(reference_dir / 'checkpoints' / str(STEPS))) + 2**20
  folder = fresh('full_disk').parent / 'disk'
  with tmpfs(folder, str(size)):
    workdir = folder / 'run'
    first = run(t_command(workdir))
    good = max((int(p.name) for p in (workdir / 'checkpoints').glob('*') if p.name.isdigit()), default=0)
    logged = max((r['step'] for r in metrics(workdir) if 'loss' in r), default=0)
    why = one_line_stop(first, SAVE_FAILED)
    if logged > good + 2 * EVERY:  # the failed save is good + EVERY; nothing trained past the next one
      why.append(f'trained on to step {logged} after the last good checkpoint {good}')
    again = run(t_command(workdir))
    why += one_line_stop(again, None)
    if any(l.startswith('step ') for l in again['stdout'].splitlines()):
      why.append('the rerun on the full disk trained')
    remount(folder, 'size=512m')
    last = run(t_command(workdir))
    why += finished_like_reference(workdir, ref_rows, last)
  return {'tmpfs_bytes': size, 'first': error_lines(first['stderr'])[-1:], 'last_good': good, 'logged': logged,
          'rerun_on_full_disk': error_lines(again['stderr'])[-1:], 'command': shown(t_command(workdir))}, why


def disk_full_at_start(ref_rows) -> tuple[dict, list[str]]:
  """Point 5: a disk that cannot hold even the lease: one line, no traceback."""
  del ref_rows
  folder = fresh('disk_full_at_start').parent / 'disk'
  with tmpfs(folder, '16k'):
    (folder / 'filler').write_bytes(b'\0' * 12288)
    result = run(t_command(folder / 'run'))
  return {'stderr': error_lines(result['stderr'])[-2:], 'rc': result['rc']}, one_line_stop(result, None)


def read_only_mid_run(ref_rows) -> tuple[dict, list[str]]:
  """Point 9: the workdir's filesystem turned read-only at step 12: one line naming the cause; the rerun with it
  writable again finishes as the reference."""
  logs = fresh('read_only')
  folder = logs.parent / 'disk'
  with tmpfs(folder, '512m'):
    workdir = folder / 'run'
    command = t_command(workdir, '--config.tensorboard=false')  # no file held open for writing: remount works
    first = Started(command, logs, 'first')
    reached = first.wait_for(f'step 12/{STEPS}')
    remount(folder, 'ro')
    result = first.wait()
    why = ([] if reached else ['step 12 not reached']) + one_line_stop(result, None)
    if not re.search(r'read-only', ''.join(error_lines(result['stderr'])[-1:]), re.I):
      why.append(f'the line does not name the cause: {error_lines(result["stderr"])[-1:]}')
    remount(folder, 'rw')
    why += finished_like_reference(workdir, ref_rows, run(command))
  return {'stderr': error_lines(result['stderr'])[-2:], 'rc': result['rc']}, why


def two_scripts(command_of, name: str, check) -> tuple[dict, list[str]]:
  """Point 7: two scripts at once on one folder: each finishes or is refused in one line; `check` the rest."""
  folder = fresh(name).parent
  started = [Started(command_of(folder, i), folder / f'script{i}' / 'x', f'script{i}') for i in range(2)]
  results = [s.wait(timeout=1800) for s in started]
  why = [] if any(r['rc'] == 0 for r in results) else ['neither script finished']
  for i, result in enumerate(results):
    if result['rc'] != 0 and one_line_stop(result, None):
      why.append(f"script {i}: rc {result['rc']}, {error_lines(result['stderr'])[-2:]}")
  return {'rcs': [r['rc'] for r in results], 'command': shown(command_of(folder, 0))}, why + check(folder, results)


SHORT = ['--set=steps=10', '--set=optimizer.warmup_steps=5', '--set=eval_steps=2', '--set=checkpoint_every=10',
         '--set=log_every=5']


def two_tables(ref_rows):
  del ref_rows
  rows = ('baseline_24', 'rw')
  command = lambda folder, i: [sys.executable, 'scripts/reproduce_c4_ablation.py', '--preset=tiny', '--seeds=1',
                               f'--rows={rows[i]}', f'--workdir={folder / f"runs{i}"}', f'--out={folder / "out"}',
                               *SHORT]

  def check(folder, results):
    table = folder / 'out' / 'c4_ablation_tiny.json'
    measured = {r['name'] for r in json.loads(table.read_text())['rows'] if r.get('test_losses')} if (
        table.exists()) else set()
    return [f'the table lacks {row}' for row, r in zip(rows, results) if r['rc'] == 0 and row not in measured]
  return two_scripts(command, 'two_tables', check)


def two_sweeps(ref_rows):
  del ref_rows
  command = lambda folder, i: [sys.executable, 'scripts/sweep.py', f'--config={SPEC}', '--field=model.laurel.rank',
                               '--values=4,8', f'--workdir={folder / "sweep"}', *SHORT]

  def check(folder, results):
    why = [f'script {i} reports failed points' for i, r in enumerate(results)
           if 'point(s) failed' in r['stdout'] + r['stderr']]
    return why + [f'{p.parent.name} finished and has failed.json' for p in (folder / 'sweep').rglob('final.json')
                  if (p.parent / 'failed.json').exists()]
  return two_scripts(command, 'two_sweeps', check)


def sigterm_under_slurm(ref_rows) -> tuple[dict, list[str]]:
  """Point 8: SIGTERM at step 10 of a run that Slurm's variables name: status PREEMPTED, never 0; the rerun resumes
  as the reference."""
  workdir = fresh('sigterm_under_slurm')
  first = Started(t_command(workdir), workdir, 'first', SLURM)
  why = [] if first.wait_for(f'step 10/{STEPS}') else ['step 10 not reached']
  first.signal(signal.SIGTERM)
  result = first.wait()
  if result['rc'] != PREEMPTED or (workdir / 'final.json').exists():
    why.append(f"rc {result['rc']} (expected {PREEMPTED}), final.json {(workdir / 'final.json').exists()}")
  rerun = Started(t_command(workdir), workdir, 'rerun', SLURM).wait()
  return ({'rc': result['rc'], 'env': SLURM, 'command': shown(t_command(workdir))},
          why + finished_like_reference(workdir, ref_rows, rerun))


def sigterm_in_the_final_eval(environ: dict, expected_rc: int):
  def case(ref_rows) -> tuple[dict, list[str]]:
    """Point 8: SIGTERM in the final eval: its line says interrupted, not done, and the status is the stop's; the
    rerun logs the eval once and final.json has a median step time."""
    del ref_rows
    workdir = fresh('sigterm_in_the_final_eval' + '_slurm' * bool(environ))
    command = t_command(workdir, '--config.eval_steps=400')  # seconds of eval: the signal lands inside it
    first = Started(command, workdir, 'first', environ)
    why = [] if first.wait_for('evaluating on') else ['the eval did not start']
    time.sleep(0.5)
    first.signal(signal.SIGTERM)
    result = first.wait()
    phase = [l for l in result['stdout'].splitlines() if l.startswith('evaluating on 400 batches:')]
    if result['rc'] != expected_rc or len(phase) != 1 or 'interrupted' not in phase[0]:
      why.append(f"rc {result['rc']} (expected {expected_rc}), eval line {phase}")
    rerun = Started(command, workdir, 'rerun', environ).wait()
    evals = [r['step'] for r in metrics(workdir) if 'eval_loss' in r]
    final = json.loads((workdir / 'final.json').read_text()) if (workdir / 'final.json').exists() else {}
    if rerun['rc'] != 0 or evals != [STEPS] or not isinstance(final.get('median_step_time_s'), float):
      why.append(f"rerun rc {rerun['rc']}, eval lines at {evals}, median_step_time_s "
                 f"{final.get('median_step_time_s')}")
    return {'rc': result['rc'], 'eval_line': phase, 'env': environ, 'command': shown(command)}, why
  return case


def peer_death(ref_rows) -> tuple[dict, list[str]]:
  """Point 9: process 1 of a two-process Slurm simulation SIGKILLed at step 5: process 0 ends within 30 s with one
  line naming it (status PEER_LOST); both rerun to the end, every step logged once."""
  del ref_rows
  workdir = fresh('peer_death')
  with socket.socket() as free:
    free.bind(('localhost', 0))
    port = free.getsockname()[1]
  slurm = lambda i: {'SLURM_JOB_ID': '4254', 'SLURM_STEP_NODELIST': 'localhost', 'SLURM_NTASKS': '2',
                     'SLURM_PROCID': str(i), 'SLURM_LOCALID': str(i), 'SLURM_NODEID': '0',
                     'SLURM_STEP_TASKS_PER_NODE': '2', 'JAX_COORDINATOR_PORT': str(port)}
  command = t_command(workdir, '--config.data_shards=2')  # one input shard per process
  procs = [Started(command, workdir, f'process{i}', slurm(i)) for i in range(2)]
  why = [] if procs[0].wait_for(f'step 5/{STEPS}') else ['step 5 not reached']
  procs[1].signal(signal.SIGKILL)
  killed = time.monotonic()
  result = procs[0].wait(timeout=300)
  ended_s = round(time.monotonic() - killed, 1)
  procs[1].wait()
  errors = [l for l in error_lines(result['stderr']) if l.startswith('error: ')]
  if result['rc'] != PEER_LOST or len(errors) != 1 or 'process 1 of 2' not in errors[0] or ended_s > 30:
    why.append(f"process 0: rc {result['rc']} after {ended_s} s, {error_lines(result['stderr'])[-2:]}")
  if 'Fatal Python error' in result['stderr'] or 'Traceback' in result['stderr']:
    why.append('process 0 printed a traceback or an abort')
  reruns = [Started(command, workdir, f'rerun{i}', slurm(i)) for i in range(2)]
  rcs = [r.wait()['rc'] for r in reruns]
  steps = [r['step'] for r in metrics(workdir) if 'loss' in r]
  if rcs != [0, 0] or steps != list(range(1, STEPS + 1)):
    why.append(f'reruns: rc {rcs}, train lines {steps[:3]}..{steps[-3:]} ({len(steps)})')
  return {'process_0_rc': result['rc'], 'ended_after_s': ended_s, 'line': errors[:1], 'rerun_rcs': rcs,
          'command': shown(command), 'env': slurm(0)}, why


def first_config_write_cut(ref_rows) -> tuple[dict, list[str]]:
  """Point 9: a kill between the first config_history.jsonl line and config.json: the run records its config once."""
  workdir = fresh('first_config_write_cut')
  workdir.mkdir()
  history = (OUT / 'reference' / 'config_history.jsonl').read_text().splitlines()[0] + '\n'
  (workdir / 'config_history.jsonl').write_text(history)
  result = run(t_command(workdir))
  lines = (workdir / 'config_history.jsonl').read_text().splitlines()
  return {'history_lines': len(lines)}, finished_like_reference(workdir, ref_rows, result) + (
      [f'config_history.jsonl has {len(lines)} lines for one config'] if len(lines) != 1 else [])


def next_commands_quote_the_workdir(ref_rows) -> tuple[dict, list[str]]:
  """Point 9: the printed next: commands name a workdir with spaces so that a shell reads it back."""
  del ref_rows
  workdir = OUT / 'issue54' / 'quoting' / 'a run with spaces'
  shutil.rmtree(workdir.parent, ignore_errors=True)
  shutil.copytree(OUT / 'reference', workdir)
  result = run(t_command(workdir, f'--config.steps={LONGER}'))
  generate = [l for l in result['stdout'].splitlines() if '-m laurel.serve.generate' in l]
  try:
    named = [a.split('=', 1)[1] for a in shlex.split(generate[0]) if a.startswith('--workdir=')] if generate else []
  except ValueError:
    named = []
  ok = result['rc'] == 0 and named and (ROOT / named[0]).resolve() == workdir.resolve()
  return {'next': generate[:1]}, [] if ok else [f"rc {result['rc']}, the command names {named}: {generate[:1]}"]


ISSUE54 = {
    'lease': {'restarted_container': restarted_container, 'stopped_holder': stopped_holder,
              'skewed_clock': skewed_clock, 'lease_taken_while_running': lease_taken_while_running,
              'heartbeat_from_a_clock_ahead': heartbeat_from_a_clock_ahead},
    'checksums': {'crash_then_flipped_bit': crash_then_flipped_bit},
    'disk': {'full_disk': full_disk, 'disk_full_at_start': disk_full_at_start, 'read_only_mid_run': read_only_mid_run},
    'tables': {'two_tables': two_tables, 'two_sweeps': two_sweeps},
    'exits': {'sigterm_under_slurm': sigterm_under_slurm,
              'sigterm_in_the_final_eval': sigterm_in_the_final_eval({}, 0),
              'sigterm_in_the_final_eval_under_slurm': sigterm_in_the_final_eval(SLURM, PREEMPTED)},
    'peers': {'peer_death': peer_death},
    'smaller': {'first_config_write_cut': first_config_write_cut,
                'next_commands_quote_the_workdir': next_commands_quote_the_workdir},
}
NEEDS_ROOT = ('full_disk', 'disk_full_at_start', 'read_only_mid_run')  # they mount a tmpfs


def issue54_part(part: str):
  def run_part(cases: Cases) -> None:
    ref_rows = metrics(OUT / 'reference')
    for name, case in ISSUE54[part].items():
      if f'{part}_{name}' in cases.done or (_CASES.value and name not in _CASES.value):
        continue
      start = time.monotonic()
      if name in NEEDS_ROOT and os.geteuid() != 0:
        seen, why = {'skipped': 'mounting a tmpfs needs root'}, ['skipped: needs root (mount -t tmpfs)']
      else:
        try:
          seen, why = case(ref_rows)
        except (OSError, subprocess.SubprocessError, ValueError) as e:  # the trial's own setup (a mount) failed
          seen, why = {}, [f'the case could not be set up: {e!r}'[:300]]
      cases.add({'id': f'{part}_{name}', 'part': part, 'case': name, 'point': case.__doc__.split(':')[0].strip()
                 if case.__doc__ else '', **seen, 's': round(time.monotonic() - start, 1), 'ok': not why,
                 'why': '; '.join(why) or 'as issue 54 requires'})
  return run_part


def cpu_name() -> str:
  cpuinfo = pathlib.Path('/proc/cpuinfo')
  names = [l.split(':', 1)[1].strip() for l in cpuinfo.read_text().splitlines() if l.startswith('model name')] if (
      cpuinfo.exists()) else []
  return names[0] if names else platform.machine()


def summary(cases: Cases, started: float) -> dict:
  by_part = lambda part: [c for c in cases.done.values() if c['part'] == part]
  counts = {part: {'ok': sum(c['ok'] for c in by_part(part)), 'of': len(by_part(part))}
            for part in ('signals', 'phase_signals', 'damage', 'bad_inputs', *ISSUE54) if by_part(part)}
  successful_runs = [c for c in cases.done.values() if c.get('rerun_rc', c.get('rc')) == 0
                     and c['part'] != 'bad_inputs']
  noisy = [c['id'] for c in successful_runs if c.get('noise')]
  return {
      'command': f'python scripts/experiments/run_safety_trial.py --signals={_SIGNALS.value} --seed={_SEED.value}'
                 + (f' --stop_s={_STOP_S.value:g} --lease_timing={_LEASE_TIMING.value}' if _LEASE_TIMING.value else ''),
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
  parts = {'signals': signals, 'phase_signals': phase_signals, 'damage': damage, 'bad_inputs': bad,
           **{part: issue54_part(part) for part in ISSUE54}}
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
