"""One GPU call that says where Table 5's step spends its time and what makes it faster (docs/gpu.md).

  python scripts/gpu_profile.py [--out=results/gpu_profile_{device}.json] [--budget_s=330] [--jobs=gpu,paper,...]
      [--smoke]

Jobs, each in its own process under a time limit (a hang or a crash costs that job only), in this order:
  gpu              the `gpu` preset's Baseline-24 step (128 x 512 tokens, bfloat16, auto attention: cuDNN on Hopper),
                   timed, then one step traced and its kernels grouped by scripts/step_profile.py (embedding, attention,
                   matmul, residual, loss, optimizer, other); the base of the A/B jobs
  paper            the paper shape, likewise: the paper preset's Baseline-24 (157M parameters) at 32 x 1024 tokens,
                   auto attention with max_segments=16 (cuDNN on Hopper, as make gpu-check's benchmark)
  one_hot ... jax_toolbox
                   A/B: the `gpu` job with one thing changed (AB below), timed only
  gpu_rw_lr_pa     RW+LR+PA at the `gpu` preset, timed and traced: LAuReL's ops beside the baseline's
The JSON (--out; {device}: the device kind) holds the device and versions, each job's step times, tokens/s, MFU
(laurel.plan.hardware's peak), compile time, peak memory, and its profile; and each A/B job's step time over the `gpu`
job's. A job that fails or runs out of time is recorded with its output's last lines.

Device time on an H200 (estimated): a job starts Python and JAX (~10 s), compiles one step (~20-40 s; the jobs share
a persistent compilation cache, so XLA's GEMM autotuning is reused), runs 3 + 20 steps (~0.15 s each at the 5% MFU
measured so far; the paper shape 3 + 10 at up to ~1 s) and traces one more (~5 s): ~45 s a job, 8 jobs ~6 minutes.
--budget_s bounds it: no job starts with less than MIN_JOB_S left, and a job's limit is cut to what is left, so the
call ends within the budget (the jobs not started are recorded as such); --jobs reruns some (the A/B ratios need
`gpu` among them), reading their compiled steps back from the cache where the machine kept it.
--smoke: the same jobs at a tiny shape (2 x 32 tokens, D=32, 3 layers, vocabulary 264), 1 + 2 steps: on a CPU in
about a minute, for the tests.
"""

import json
import os
import pathlib
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `python scripts/gpu_profile.py` puts scripts/ on the path, not the repo root
  sys.path.insert(0, str(ROOT))
from laurel.cli import gpu_workarounds  # pylint: disable=g-import-not-at-top,wrong-import-position  # noqa: E402

if __name__ == '__main__':  # before JAX starts a backend, here and in every job (they inherit XLA_FLAGS)
  gpu_workarounds.apply()

# pylint: disable=g-import-not-at-top,wrong-import-position
import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
from absl import app, flags  # noqa: E402

import step_profile  # noqa: E402
from laurel import command_line, config_lib, sharding, step, train_config  # noqa: E402
from laurel.cli import compile_cache, files, process
from laurel.plan import hardware
# pylint: enable=g-import-not-at-top,wrong-import-position

_OUT = flags.DEFINE_string('out', 'results/gpu_profile_{device}.json', 'The JSON; {device}: the device kind.')
_BUDGET = flags.DEFINE_float('budget_s', 330, 'Seconds for all jobs together (module docstring).', lower_bound=1)
_JOBS = flags.DEFINE_list('jobs', None, 'Run only these jobs (default: all, in the order of the module docstring).')
_SMOKE = flags.DEFINE_bool('smoke', False, 'A tiny shape and 1 + 2 steps per job: the whole call on a CPU.')
_CACHE = flags.DEFINE_string('cache', os.path.join(tempfile.gettempdir(), 'laurel_gpu_profile_cache'),
                             "The jobs' persistent compilation cache.")
_JOB = flags.DEFINE_string('job', None, 'Internal: run this job (JSON) and write its result to --job_out.')
_JOB_OUT = flags.DEFINE_string('job_out', None, "Internal: the job's result file.")

MIN_JOB_S = 30  # no job starts with less left (--smoke: any)
TOP_OPS = 25  # ops kept per profile
# The A/B jobs: (name, config overrides, XLA flags, environment) against the `gpu` job. JAX-Toolbox's image sets the
# latency hiding scheduler; its GPU performance page adds cuBLAS GEMMs over Triton's and one CUDA queue.
AB = (
    ('one_hot', ['model.embed_lookup=one_hot'], '', {}),
    ('unrolled', ['model.scan_layers=False'], '', {}),
    ('xla_attention', ['model.attention=xla'], '', {}),
    ('no_command_buffers', [], '--xla_gpu_enable_command_buffer=', {}),
    ('jax_toolbox', [], '--xla_gpu_enable_latency_hiding_scheduler=true --xla_gpu_enable_triton_gemm=false',
     {'CUDA_DEVICE_MAX_CONNECTIONS': '1'}),
)
SMOKE_SHAPE = ['batch_size=2', 'data.seq_len=32', 'model.d_model=32', 'model.num_heads=4', 'model.d_ff=64',
               'model.num_layers=3', 'model.vocab_size=264']


def jobs(smoke: bool) -> list[dict]:
  """Every job, in the order they run (module docstring)."""
  def job(name, preset, row='baseline_24', overrides=(), xla_flags='', env=None, profile=False, steps=20,
          limit_s=120):
    shape = SMOKE_SHAPE if smoke else {'paper': ['batch_size=32', 'data.seq_len=1024']}.get(preset, [])
    return {'name': name, 'preset': preset, 'row': row, 'overrides': [*shape, *overrides], 'xla_flags': xla_flags,
            'env': env or {}, 'profile': profile, 'warmup': 1 if smoke else 3, 'steps': 2 if smoke else steps,
            'limit_s': limit_s}
  paper_attention = ['model.attention=auto', 'model.max_segments=16']  # cuDNN's, as make gpu-check's benchmark
  return [job('gpu', 'gpu', profile=True),
          job('paper', 'paper', overrides=paper_attention, profile=True, steps=10, limit_s=150),
          *(job(name, 'gpu', overrides=o, xla_flags=f, env=e, limit_s=90) for name, o, f, e in AB),
          job('gpu_rw_lr_pa', 'gpu', row='rw_lr_pa', profile=True)]


def run_job(job: dict) -> dict:
  """In the job's own process: compile, warm up, time, and trace one more step where the job asks."""
  compile_cache.setup(_CACHE.value)
  config = command_line.load(f"configs/c4_ablation.py:{job['row']},preset={job['preset']}",
                           ['data.name=synthetic', 'tensorboard=False', *job['overrides']])
  task = train_config.validate_config(config)
  mesh = sharding.make_mesh(config.mesh)
  start = time.perf_counter()
  with jax.set_mesh(mesh), nn.logical_axis_rules(config.logical_axis_rules):
    compiled, init_state, abstract, _ = step.compile_step(task, mesh)
  compile_s = time.perf_counter() - start
  with jax.set_mesh(mesh):
    state = init_state(jax.random.key(config.seed))
  batch = step_profile.synthetic_batch(task, config, mesh)
  times = []
  for _ in range(job['warmup'] + job['steps']):
    start = time.perf_counter()
    state, metrics = jax.block_until_ready(compiled(state, batch))
    times.append(time.perf_counter() - start)
  step_s = statistics.median(times[job['warmup']:])
  kind, n = jax.devices()[0].device_kind, jax.device_count()
  model_flops = task.model_flops(config.batch_size)
  result = {'params': task.num_params(abstract.params), 'compile_s': compile_s, 'step_time_s': step_s,
            'step_times_s': times[job['warmup']:], 'tokens_per_s': config.batch_size * config.data.seq_len / step_s,
            'model_flops_per_step': model_flops,
            'mfu': hardware.utilisation(model_flops, step_s, (hardware.PEAK_FLOPS.get(kind) or 0) * n),
            'peak_memory_bytes': hardware.peak_memory_bytes(compiled), 'final_loss': float(metrics['loss']),
            'device': {'platform': jax.default_backend(), 'device_kind': kind, 'device_count': n,
                       'peak_flops_per_device': hardware.PEAK_FLOPS.get(kind), **step_profile.runtime_versions(),
                       'xla_flags': os.environ.get('XLA_FLAGS', '')}}
  if job['profile']:
    logdir = tempfile.mkdtemp(prefix='laurel_gpu_profile_')
    _, trace = step_profile.trace_steps(compiled, state, batch, logdir, 1)
    text = compiled.as_text()
    profile = step_profile.op_times(trace, text, text.split()[1].rstrip(','), 1)
    result['profile'] = {**profile, 'ops': profile['ops'][:TOP_OPS], 'trace': trace}
  return result


def spawn(job: dict, limit_s: float) -> dict:
  """The job in its own process, killed after `limit_s`: its result, or its status and its output's last lines."""
  with tempfile.TemporaryDirectory() as tmp:
    out = os.path.join(tmp, 'result.json')
    env = dict(os.environ, **job['env'], PYTHONUNBUFFERED='1')
    env['XLA_FLAGS'] = f"{env.get('XLA_FLAGS', '')} {job['xla_flags']}".strip()
    command = [sys.executable, __file__, f'--job={json.dumps(job)}', f'--job_out={out}', f'--cache={_CACHE.value}']
    start = time.monotonic()
    try:
      run = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=limit_s, check=False)
      status, output = ('ok' if run.returncode == 0 else f'failed (exit {run.returncode})'), run.stdout + run.stderr
    except subprocess.TimeoutExpired as e:
      status = f'timed out after {limit_s:.0f} s'
      output = ''.join(x.decode(errors='replace') if isinstance(x, bytes) else x or '' for x in (e.stdout, e.stderr))
    result = json.loads(pathlib.Path(out).read_text()) if status == 'ok' else {}
  lines = [line for line in output.splitlines() if line.strip()]
  return {'name': job['name'], 'status': status, 'wall_s': time.monotonic() - start, 'job': job, **result,
          **({} if status == 'ok' else {'output_tail': lines[-8:]})}


def summarize(results: list[dict]) -> list[dict]:
  """Each A/B job's step time over the `gpu` job's: below 1 is faster."""
  base = next((r for r in results if r['name'] == 'gpu' and r['status'] == 'ok'), None)
  ab_names = [name for name, *_ in AB]
  return [{'name': r['name'], 'step_time_s': r['step_time_s'], 'mfu': r['mfu'],
           'step_time_ratio': round(r['step_time_s'] / base['step_time_s'], 4)}
          for r in results if base and r['name'] in ab_names and r['status'] == 'ok']


def print_table(results: list[dict]):
  print(f"\n{'job':<20}{'status':<26}{'step s':>9}{'tokens/s':>12}{'MFU':>7}{'compile s':>11}")
  for r in results:
    if r['status'] == 'ok':
      mfu = '-' if r['mfu'] is None else f"{r['mfu']:.1%}"
      print(f"{r['name']:<20}{'ok':<26}{r['step_time_s']:>9.4f}{r['tokens_per_s']:>12,.0f}{mfu:>7}"
            f"{r['compile_s']:>11.1f}")
    else:
      print(f"{r['name']:<20}{r['status']:<26}")


def main():
  if _JOB.value:
    result = run_job(json.loads(_JOB.value))
    files.write_text_atomic(_JOB_OUT.value, json.dumps(result))
    return
  chosen = {j['name']: j for j in jobs(_SMOKE.value)}
  if unknown := [name for name in _JOBS.value or () if name not in chosen]:
    raise config_lib.InputError(f'--jobs: unknown job {unknown[0]!r} (known: {", ".join(chosen)})')
  start, results = time.monotonic(), []
  deadline = start + _BUDGET.value
  for job in [chosen[name] for name in _JOBS.value] if _JOBS.value else chosen.values():
    left = deadline - time.monotonic()
    if left < (0 if _SMOKE.value else MIN_JOB_S):
      results.append({'name': job['name'], 'status': 'not run: the budget was spent', 'job': job})
      continue
    results.append(spawn(job, min(job['limit_s'], left) if not _SMOKE.value else left))
    r = results[-1]
    print(f"{r['name']}: {r['status']} in {r['wall_s']:.0f} s"
          + (f", {r['step_time_s']:.4f} s/step" if r['status'] == 'ok' else ''), flush=True)
    for line in r.get('output_tail', []):
      print(f'  | {line}', flush=True)
    if 'profile' in r:
      step_profile.print_profile(r['name'], r['profile'])
  done = [r for r in results if r['status'] == 'ok']
  if not done:  # nothing measured: no file, so no good one is overwritten
    process.fail('no job ran to the end (their output above); nothing written', code=1)
  device = done[0]['device']
  for r in done:
    del r['device']
  print_table(results)
  out = _OUT.value.replace('{device}', hardware.device_slug(device['device_kind']))
  report = {'device': device, 'command': shlex.join(['python', 'scripts/gpu_profile.py', *sys.argv[1:]]),
            'budget_s': _BUDGET.value, 'wall_s': round(time.monotonic() - start, 1), 'smoke': _SMOKE.value,
            'jobs': results, 'ab': summarize(results)}
  pathlib.Path(out).parent.mkdir(parents=True, exist_ok=True)
  files.write_text_atomic(out, json.dumps(report, indent=2) + '\n')
  print(f'wrote {out} ({report["wall_s"]:.0f} s)')


def run(argv):
  if len(argv) > 1:
    process.fail(f'unexpected arguments: {" ".join(argv[1:])}')
  try:
    main()
  except config_lib.InputError as e:
    process.fail(str(e))


if __name__ == '__main__':
  app.run(run)
