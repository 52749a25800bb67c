"""Where a compiled train step spends its time: a jax.profiler trace of a few steps, its ops summed by time and
grouped by what they compute (scripts/benchmark.py --profile).

Each XLA op the trace records (a GPU kernel, or a CPU thunk) names its HLO instruction (`hlo_op`); the compiled
module's text gives that instruction's opcode and the JAX name stack it came from (`op_name`), which groups it:
  attention   the attention core under an `attn` module (scores, softmax, value product, cuDNN's fused kernel), not
              its q/k/v/out projections
  loss        the chunked cross-entropy (laurel.cross_entropy: its scan and custom VJP) and the logits' matmuls
  embedding   the token and position lookups (laurel.lm.lookup: a gather and its scatter-add, or one-hot matmuls),
              and any other gather or scatter
  residual    the residual connection (laurel.residual): LAuReL's ops (the RW weights, the low-rank term, PA's
              shortcuts), a plain add for Baseline-24
  matmul      the layers' other matmuls (projections, MLP): dots, cuBLAS and Triton GEMMs
  optimizer   what runs after the gradients: AdamW, clipping, the gradient norm (outside jvp and its transpose)
  other       the rest of the layers: norms, activations, the layer loop's copies
A fusion carries one op's name for all it fuses, so the groups are the compiler's attribution, not exact.
"""

import collections
import glob
import gzip
import importlib.metadata
import importlib.util
import json
import os
import re
import subprocess

import jax
import numpy as np

from laurel import sharding

CATEGORIES = ('embedding', 'attention', 'matmul', 'residual', 'loss', 'optimizer', 'other')
CONTAINERS = ('while', 'call', 'conditional')  # ops whose time is their body's, counted there
_INSTRUCTION = re.compile(r'^\s*(?:ROOT\s+)?%?([^\s=]+)\s*=\s*.*?\b([a-z][a-z0-9\-]*)\(')


def hlo_instructions(hlo_text: str) -> dict:
  """{instruction name: (opcode, op_name, line)} of a compiled module's text, nested computations included."""
  out = {}
  for line in hlo_text.splitlines():
    match = _INSTRUCTION.match(line)
    if match:
      op_name = re.search(r'op_name="([^"]*)"', line)
      out[match.group(1)] = (match.group(2), op_name.group(1) if op_name else '', line)
  return out


def category(op_name: str, line: str = '') -> str:
  """The group of an op (the module docstring) from its JAX name stack and its HLO line."""
  projection = re.search(r'/attn/(query|key|value|out)\b', op_name)
  if 'fmha' in line.lower() or ('/attn/' in op_name and not projection):  # cuDNN's kernels and custom calls
    return 'attention'
  if 'jvp()' in op_name or '_scan_chunks' in op_name or '_chunked' in op_name:
    return 'loss'
  if '/lookup/' in op_name or re.search(r'\b(gather|scatter)\(', line):
    return 'embedding'
  if 'laurel.' in op_name or 'laurel_' in op_name:
    return 'residual'
  gemm = re.search(r'\b(dot|convolution)\(|gemm|cublas|nvjet|cutlass|xmma', line, re.IGNORECASE)
  if gemm or op_name.endswith('/dot_general'):
    return 'matmul'  # an HLO dot, a GEMM's custom call or fusion, a GEMM kernel's name, a fusion named by its dot
  if op_name and 'jvp(' not in op_name and 'transpose(' not in op_name:  # after the gradients
    return 'optimizer'
  return 'other'


def trace_steps(step_fn, state, batch, logdir: str, steps: int):
  """Runs `steps` steps under jax.profiler (a Perfetto trace in `logdir`); returns the state and the trace file."""
  jax.block_until_ready(state)
  with jax.profiler.trace(logdir, create_perfetto_trace=True):
    for _ in range(steps):
      state, _ = jax.block_until_ready(step_fn(state, batch))
  traces = sorted(glob.glob(os.path.join(logdir, 'plugins', 'profile', '*', 'perfetto_trace.json.gz')),
                  key=os.path.getmtime)
  return state, traces[-1]


def op_times(trace_file: str, hlo_text: str, module: str, steps: int) -> dict:
  """The step's ops by time per step, from a trace: the device's events where it has any (GPU kernels), else the
  host's (CPU thunks). {'ops': [{hlo_op, opcode, category, op_name, ms}] longest first, 'categories': {name:
  {'ms', 'share', 'ops' (how many)}}, 'total_ms', 'source'}."""
  with gzip.open(trace_file, 'rt') as f:
    events = json.load(f)['traceEvents']
  processes = {e['pid']: e['args']['name'] for e in events if e.get('ph') == 'M' and e.get('name') == 'process_name'}
  ops = [e for e in events if e.get('ph') == 'X' and (e.get('args') or {}).get('hlo_module', '').startswith(module)
         and 'hlo_op' in e['args'] and not e['name'].startswith('end: ')]
  device = lambda e: processes.get(e.get('pid'), '').startswith('/device:')
  on_device = [e for e in ops if device(e)]
  source = 'device' if on_device else 'host' if ops else 'device kernels without hlo_op'
  if not ops:  # e.g. kernels replayed from a CUDA graph: named by kernel, grouped by name only
    on_device = [dict(e, args={'hlo_op': e['name']}) for e in events if e.get('ph') == 'X' and device(e)]
  instructions, seconds = hlo_instructions(hlo_text), collections.Counter()
  for e in on_device or ops:
    seconds[e['args']['hlo_op']] += e.get('dur', 0) / 1e6 / steps  # microseconds
  rows = []
  for name, s in seconds.most_common():
    opcode, op_name, line = instructions.get(name, ('?', '', name))  # a kernel's name stands in for its line
    if opcode not in CONTAINERS:
      rows.append({'hlo_op': name, 'opcode': opcode, 'category': category(op_name, line), 'op_name': op_name,
                   'ms': s * 1e3})
  total = sum(r['ms'] for r in rows) or 1.0
  groups = {c: [r['ms'] for r in rows if r['category'] == c] for c in CATEGORIES}
  return {'source': source, 'total_ms': total, 'ops': rows,
          'categories': {c: {'ms': sum(ms), 'share': sum(ms) / total, 'ops': len(ms)} for c, ms in groups.items()}}


def print_profile(name: str, profile: dict, top: int = 15):
  shares = ', '.join(f"{c} {v['share']:.1%}" for c, v in profile['categories'].items())
  print(f"\nprofile of {name}: {profile['total_ms']:.2f} ms of {profile['source']} ops per step | {shares}")
  for r in profile['ops'][:top]:
    print(f"  {r['ms']:9.3f} ms  {r['ms'] / profile['total_ms']:6.1%}  {r['category']:<9}  {r['opcode']:<12} "
          f"{r['hlo_op'][:40]:<40}  {r['op_name'][-60:]}")


def runtime_versions() -> dict:
  """jax's and jaxlib's versions and, on a GPU, the CUDA plug-in's, CUDA's, cuDNN's and the driver's."""
  out = {'jax_version': jax.__version__, 'jaxlib_version': importlib.metadata.version('jaxlib')}
  if jax.default_backend() != 'gpu':
    return out
  plugins = [p for p in ('jax-cuda13-plugin', 'jax-cuda12-plugin') if importlib.util.find_spec(p.replace('-', '_'))]
  out['cuda_plugin'] = [f'{p} {importlib.metadata.version(p)}' for p in plugins]
  out['compute_capability'] = getattr(jax.devices()[0], 'compute_capability', None)
  try:
    from jax._src.lib import cuda_versions  # pylint: disable=import-outside-toplevel  # private: best effort
    out.update(cuda_runtime_version=cuda_versions.cuda_runtime_get_version(),
               cuda_driver_version=cuda_versions.cuda_driver_get_version(),
               cudnn_version=cuda_versions.cudnn_get_version())
  except Exception as e:  # pylint: disable=broad-except  # the versions are a record, not a reason to stop
    out['cuda_versions_error'] = repr(e)
  smi = subprocess.run(['nvidia-smi', '--query-gpu=name,driver_version,memory.total', '--format=csv,noheader'],
                       capture_output=True, text=True, check=False)
  out['nvidia_smi'] = smi.stdout.strip() if smi.returncode == 0 else None
  return out


def synthetic_batch(task, config, mesh):
  """One fixed batch of random tokens, one document per row, placed like the train loop places its batches."""
  batch = task.example_batch(config.batch_size // jax.process_count())
  batch['tokens'] = np.random.default_rng(jax.process_index()).integers(
      1, config.model.vocab_size, batch['tokens'].shape, dtype=np.int32)
  batch['positions'] = np.broadcast_to(np.arange(config.data.seq_len, dtype=np.int32), batch['tokens'].shape).copy()
  return sharding.global_batch(batch, mesh)
