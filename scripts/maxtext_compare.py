r"""MaxText's train step at Table 5's Baseline-24 shape, compiled by MaxText's own train_compile for a v6e 4x4, beside
this project's `scripts/benchmark.py --topology=v6e:4x4` rows.

  python scripts/maxtext_compare.py --maxtext=<MaxText checkout>
      --maxtext_python=<python of a venv with its deps>
      [--maxtext_commit=<sha>: where the checkout is no git work tree] [--settings=minimal_dot_product,...]
      [--out=results/maxtext_v6e_4x4.json]
  python scripts/maxtext_compare.py --table_only   # the table from the committed JSONs, nothing compiled

Each setting runs MaxText's `train_compile.main` in a subprocess of MaxText's python (JAX_PLATFORMS=cpu: libtpu's
compiler on abstract devices, nothing runs) and reads the compiled step's memory_analysis() and cost_analysis().
FLOPs and bytes are counted as laurel/plan/aot.py counts them: XLA counts a scanned layer body once, so every setting is
compiled a second time with the layer scan unrolled by 2 and totals = c1 + (layers - 1) * (c2 - c1). MaxText's
config has no knob for that: its decoder's scan takes an `unroll` argument (NNXDecoder._apply_layers_sequentially)
that the worker sets for the second compile. Splash (flash) attention is a custom call whose matmuls XLA does not
count, so its FLOPs leave the attention kernel out, here as in benchmark.py.

Cycles: the compiled step's text (`as_text()`, the unroll-1 compile) counted by laurel/plan/schedule.py as this project
counts its own step: every instruction's `estimated_cycles` (the compiler's own schedule estimate), a loop's body
times its trip count. The rates are the same compiler's: flops_per_cycle = 2 * 8192^3 / the estimated cycles of one
bf16 8192x8192 @ 8192x8192 matmul compiled for one chip of the same v6e slice; bytes_per_cycle = v6e's HBM bandwidth
over its clock. MaxText's splash kernels carry no cost estimate: the flash settings count them as their attention
FLOPs (laurel.attention.attention_flops(32, 1024, 12, 64) * 24: causal Q.K^T and P.V, forward and backward) at the
matmul rate; the kernel calls with no estimate are counted and recorded. Collectives carry no estimate.

MaxText's checkout and venv, outside this repository (its commit is recorded; never commit its code):
  fetch github.com/AI-Hypercomputer/maxtext; copy its src/ to <checkout> (git archive, or a clone)
  python3.12 -m venv <venv> && <venv>/bin/pip install jax==0.10.2 jaxlib==0.10.2 libtpu==0.0.42.1 flax==0.12.8 \
      optax==0.2.8 orbax-checkpoint==0.12.8 numpy==2.4.6 absl-py ml-collections pydantic omegaconf pyyaml packaging \
      jinja2 pathwaysutils qwix aqtp tokamax grain huggingface_hub transformers drjax pillow tiktoken sentencepiece \
      sympy ml-goodput-measurement
  (what train_compile imports, no TensorFlow or PyTorch; pip resolves tokamax to one that keeps jax 0.10.2)
"""

import glob
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from importlib import metadata

LAYERS = 24
# Table 5's Baseline-24: RMSNorm and RoPE (MaxText's llama2 block), non-gated GELU MLP, tied embeddings, bf16 compute,
# f32 parameters, AdamW; 32 x 1024 tokens per chip, pure data parallel on one v6e-16 slice, synthetic data.
SHAPE = ['decoder_block=llama2', 'base_emb_dim=768', 'base_num_query_heads=12', 'base_num_kv_heads=12', 'head_dim=64',
         'base_mlp_dim=2048', f'base_num_decoder_layers={LAYERS}', 'mlp_activations=[gelu]', 'vocab_size=32768',
         'logits_via_embedding=true', 'dtype=bfloat16', 'weight_dtype=float32', 'opt_type=adamw',
         'per_device_batch_size=32', 'max_target_length=1024', 'dataset_type=synthetic', 'ici_data_parallelism=-1',
         'ici_fsdp_parallelism=1', 'compile_topology=v6e-16', 'compile_topology_num_slices=1',
         'enable_checkpointing=false', 'skip_jax_distributed_system=true', 'jax_cache_dir=', 'run_name=maxtext_compare']
SEQ_MINOR = ['sa_q_layout=SEQ_MINOR', 'sa_k_layout=SEQ_MINOR', 'sa_v_layout=SEQ_MINOR']
SETTINGS = {'minimal_dot_product': ['remat_policy=minimal', 'attention=dot_product'],
            'full_dot_product': ['remat_policy=full', 'attention=dot_product'],
            'minimal_flash': ['remat_policy=minimal', 'attention=flash'],
            'minimal_flash_seq_minor': ['remat_policy=minimal', 'attention=flash', *SEQ_MINOR],
            'full_flash': ['remat_policy=full', 'attention=flash'],
            'save_qkv_proj_dot_product': ['remat_policy=save_qkv_proj', 'attention=dot_product']}
# What libtpu's start-up would otherwise ask a TPU VM's metadata server (as laurel/plan/aot.py sets it).
TPU_ENV = {'JAX_PLATFORMS': 'cpu', 'ALLOW_MULTIPLE_LIBTPU_LOAD': '1', 'TPU_SKIP_MDS_QUERY': '1',
           'TPU_WORKER_HOSTNAMES': 'localhost', 'TPU_ACCELERATOR_TYPE': 'v6e-16'}
MARK = 'MAXTEXT_COMPARE_RESULT '
SCHEDULE = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'laurel', 'run', 'schedule.py')
MATMUL = 8192  # the rate's matmul: bf16 [MATMUL, MATMUL] @ [MATMUL, MATMUL] on one chip
V6E_HBM_BYTES_PER_S, V6E_CLOCK_HZ = 1638e9, 1.75e9
# The splash kernels' FLOPs per chip and step: laurel.attention.attention_flops(32, 1024, 12, 64) * LAYERS, i.e. per
# layer 3 (forward, backward) x 4 B H (L (L + 1) / 2) K, B = per_device_batch_size, H = heads, L = length, K = head_dim.
B, H, L, K = 32, 12, 1024, 64
ATTENTION_FLOPS = LAYERS * 3 * 4 * B * H * (L * (L + 1) // 2) * K


def load_schedule():
  """laurel/plan/schedule.py by its path (standard library only: MaxText's python has no laurel)."""
  import importlib.util  # pylint: disable=import-outside-toplevel
  spec = importlib.util.spec_from_file_location('laurel_schedule', SCHEDULE)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def cycles(text: str, device, kernel_flops: float) -> dict:
  """The compiled step's schedule estimate per chip (laurel's schedule.estimate), at the rates of the same compiler
  on `device` (one chip of the slice)."""
  import jax  # pylint: disable=import-outside-toplevel
  schedule = load_schedule()
  x = jax.ShapeDtypeStruct((MATMUL, MATMUL), jax.numpy.bfloat16, sharding=jax.sharding.SingleDeviceSharding(device))
  matmul = schedule.estimate(jax.jit(jax.numpy.matmul).lower(x, x).compile().as_text(), 1, 1).estimated_cycles
  flops_per_cycle, bytes_per_cycle = 2 * MATMUL**3 / matmul, V6E_HBM_BYTES_PER_S / V6E_CLOCK_HZ
  est = schedule.estimate(text, flops_per_cycle, bytes_per_cycle, kernel_flops=kernel_flops)
  ops, _ = schedule.executed_ops(text)
  # MaxText's op_names carry no module path (schedule.GROUPS finds none): by primitive instead. The kernels carry no
  # cycles: 'pallas_call' is XLA's work on their operands and results (a relayout copy of the splash residuals).
  by_primitive = {}
  for op in ops:
    if op.cycles:
      primitive = op.op_name.rsplit('/', 1)[-1] or op.opcode
      by_primitive[primitive] = by_primitive.get(primitive, 0) + op.cycles * op.trips
  return {'estimated_cycles': est.estimated_cycles, 'kernel_cycles': est.kernel_cycles, 'cycles': est.cycles,
          'matmul_estimated_cycles': matmul, 'flops_per_cycle': flops_per_cycle, 'bytes_per_cycle': bytes_per_cycle,
          'kernel_flops': kernel_flops,
          'kernel_calls_without_estimate': sum(o.trips for o in ops
                                               if o.target == 'tpu_custom_call' and o.kernel_flops is None),
          'kernel_calls_with_estimate': sum(o.trips for o in ops if o.kernel_flops is not None),
          'uncounted_kernel_calls': est.uncounted_kernels, 'unknown_loops': list(est.unknown_loops),
          'by_primitive': dict(sorted(by_primitive.items(), key=lambda kv: -kv[1])[:10]),
          'top_10': [{'cycles': c, 'op_name': n, 'trips': t} for c, n, t in est.top[:10]]}


def worker(maxtext: str, factor: int, kernel_flops: float, argv: list) -> None:
  """In MaxText's python: its train_compile.main(argv), the layer scan unrolled by `factor`; prints the facts."""
  sys.path.insert(0, os.path.join(maxtext, 'src'))
  import jax  # pylint: disable=import-outside-toplevel
  from maxtext.layers import nnx_decoders  # pylint: disable=import-outside-toplevel
  from maxtext.trainers.pre_train import train_compile  # pylint: disable=import-outside-toplevel
  compiled, meshes, jit_and_compile = [], [], train_compile.jit_and_compile

  def kept(*a, **k):  # the compiled step, and the mesh of the slice's compile-only devices it was compiled for
    meshes.append(k['mesh'] if 'mesh' in k else a[3])
    compiled.append(jit_and_compile(*a, **k))
    return compiled[-1]

  train_compile.jit_and_compile = kept
  apply_layers = nnx_decoders.NNXDecoder._apply_layers_sequentially  # pylint: disable=protected-access
  nnx_decoders.NNXDecoder._apply_layers_sequentially = (  # pylint: disable=protected-access
      lambda self, *a, unroll=1, **k: apply_layers(self, *a, unroll=unroll * factor, **k))
  train_compile.main(argv)
  m, cost = compiled[0].memory_analysis(), compiled[0].cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  print(MARK + json.dumps({
      'peak_memory_bytes': m.peak_memory_in_bytes, 'argument_bytes': m.argument_size_in_bytes,
      'output_bytes': m.output_size_in_bytes, 'alias_bytes': m.alias_size_in_bytes, 'temp_bytes': m.temp_size_in_bytes,
      'flops': cost.get('flops', 0.0), 'bytes_accessed': cost.get('bytes accessed', 0.0),
      'jax_version': jax.__version__, 'libtpu_version': metadata.version('libtpu'), 'unroll': factor,
      # the rate's matmul on a chip of the slice train_compile compiled for
      'schedule': cycles(compiled[0].as_text(), meshes[0].devices.flat[0], kernel_flops)}), flush=True)


def compile_setting(maxtext: str, python: str, overrides: list, unroll: int, output_dir: str) -> dict:
  argv = ['train_compile', os.path.join(maxtext, 'src/maxtext/configs/base.yml'), *SHAPE, *overrides,
          f'base_output_directory={output_dir}']
  kernel_flops = ATTENTION_FLOPS if 'attention=flash' in overrides else 0
  cmd = [python, os.path.abspath(__file__), '--worker', str(unroll), str(kernel_flops), maxtext, *argv]
  start = time.perf_counter()
  run = subprocess.run(cmd, env={**os.environ, **TPU_ENV}, capture_output=True, text=True, check=False)
  lines = [l for l in run.stdout.splitlines() if l.startswith(MARK)]
  if run.returncode or not lines:
    sys.exit(f'MaxText compile failed (unroll={unroll}, {" ".join(overrides)}):\n{run.stderr[-3000:]}')
  # MaxText's own command for the same compile (it prints the memory analysis; unroll 2 has no flag).
  command = ['JAX_PLATFORMS=cpu', 'python', '-m', 'maxtext.trainers.pre_train.train_compile', *argv[1:]]
  return {**json.loads(lines[-1][len(MARK):]), 'compile_s': round(time.perf_counter() - start, 1),
          'command': shlex.join(command).replace(maxtext, '<maxtext>').replace(output_dir, '<tmp>')}


def measure(maxtext: str, python: str, commit: str, names: list, out: str, command: str) -> None:
  """Each setting's row into `out`, written as each finishes; rows of other settings already there, of the same
  MaxText commit, are kept."""
  rows = {}
  if os.path.exists(out):
    with open(out, encoding='utf-8') as f:
      before = json.load(f)
    rows = {r['name']: r for r in before['rows']} if before['maxtext_commit'] == commit else {}
  with tempfile.TemporaryDirectory() as tmp:
    for name in names:
      c1, c2 = (compile_setting(maxtext, python, SETTINGS[name], unroll, tmp) for unroll in (1, 2))
      per_layer = {k: c2[k] - c1[k] for k in ('flops', 'bytes_accessed')}
      if per_layer['flops'] <= 0:  # the decoder did not take the unroll: MaxText's scan moved
        sys.exit(f'{name}: unrolling the layer scan by 2 added no FLOPs; NNXDecoder._apply_layers_sequentially unused?')
      schedule, schedule_2 = c1['schedule'], c2['schedule']
      rows[name] = {
          'name': name, **{k: c1[k] for k in ('peak_memory_bytes', 'argument_bytes', 'output_bytes', 'alias_bytes',
                                              'temp_bytes')},
          'flops_per_step': c1['flops'] + (LAYERS - 1) * per_layer['flops'],
          'bytes_accessed_per_step': c1['bytes_accessed'] + (LAYERS - 1) * per_layer['bytes_accessed'],
          'scan_body_counted_once': {f'unroll_{c["unroll"]}': {k: c[k] for k in per_layer} for c in (c1, c2)},
          # per chip and step, the unroll-1 compile: the compiler's own estimate, the kernels', their sum
          'estimated_cycles_per_step': schedule.pop('estimated_cycles'),
          'kernel_cycles_per_step': schedule.pop('kernel_cycles'), 'cycles_per_step': schedule.pop('cycles'),
          'schedule': {**schedule, 'estimated_cycles_unroll_2': schedule_2['estimated_cycles']},  # the loop: a check
          'compile_s': [c1['compile_s'], c2['compile_s']], 'command': c1['command'],
          'cycles_command': command.replace(f'--settings={",".join(names)}', f'--settings={name}')}
      print(f'{name}: {rows[name]["peak_memory_bytes"] / 1e9:.2f} GB, '
            f'{rows[name]["cycles_per_step"] / 1e6:.1f} M cycles per chip', flush=True)
      result = {'maxtext_commit': commit, 'jax_version': c1['jax_version'], 'libtpu_version': c1['libtpu_version'],
                'topology': 'v6e-16 (v6e 4x4, one slice)', 'layers': LAYERS, 'command': command,
                'procedure': 'each row is MaxText\'s train_compile as `command` (run in <maxtext>/src), per chip; '
                             'FLOPs and bytes per step = c1 + (layers - 1) * (c2 - c1), c2 with the decoder scan '
                             'unrolled by 2; cycles per step: the c1 program\'s as_text() counted by '
                             'laurel/plan/schedule.py (`cycles_command`, see the script\'s docstring)',
                'rows': sorted(rows.values(), key=lambda r: list(SETTINGS).index(r['name']))}
      with open(out, 'w', encoding='utf-8') as f:
        json.dump(result, f, indent=1)


def table(maxtext_json: str) -> None:
  """MaxText's rows beside Baseline-24 of every results/benchmark_tpu_v6e_4x4*.json, per chip."""
  rows = []
  if os.path.exists(maxtext_json):
    with open(maxtext_json, encoding='utf-8') as f:
      rows += [(f'MaxText {r["name"]}', r) for r in json.load(f)['rows']]
  for path in sorted(glob.glob(os.path.join(os.path.dirname(maxtext_json), 'benchmark_tpu_v6e_4x4*.json'))):
    with open(path, encoding='utf-8') as f:
      ours = json.load(f)
    for r in ours['rows']:
      if r['name'].split()[0] == 'baseline_24':  # --vary rows are named 'baseline_24 <field>=<value>'
        shape = {**ours['shape'], **dict(v.split('=') for v in r['name'].split()[1:])}
        setting = ', '.join([shape['remat'], shape.get('attention', 'xla')]  # xla: LMConfig's default
                            + ['bfloat16 scores'] * (shape.get('attention_scores') == 'bfloat16')
                            + [f'loss_chunk {shape["loss_chunk"]}'] * ('loss_chunk=' in r['name']))
        rows.append((f'laurel baseline_24 ({setting})', r))
  # cycles: the compiler's estimate, the attention kernels', their sum (M, per chip and step; see the docstring)
  print(f'{"step (per chip, v6e 4x4, 32 x 1024 tokens)":58} {"peak GB":>8} {"args GB":>8} {"temp GB":>8} '
        f'{"TFLOPs":>8} {"TB read+written":>16} {"est. Mcyc":>10} {"kernel Mcyc":>11} {"total Mcyc":>10}')
  mcycles = lambda r, k, w: f'{r[k] / 1e6:{w}.1f}' if k in r else f'{"-":>{w}}'
  for name, r in rows:
    print(f'{name:58} {r["peak_memory_bytes"] / 1e9:8.2f} {r["argument_bytes"] / 1e9:8.2f} '
          f'{r["temp_bytes"] / 1e9:8.2f} {r["flops_per_step"] / 1e12:8.2f} {r["bytes_accessed_per_step"] / 1e12:16.3f} '
          f'{mcycles(r, "estimated_cycles_per_step", 10)} {mcycles(r, "kernel_cycles_per_step", 11)} '
          f'{mcycles(r, "cycles_per_step", 10)}')


def main() -> None:
  import argparse  # pylint: disable=import-outside-toplevel
  parser = argparse.ArgumentParser(description=__doc__.split('\n', maxsplit=1)[0])
  parser.add_argument('--maxtext', help='MaxText checkout (its src/ and src/maxtext/configs/base.yml)')
  parser.add_argument('--maxtext_python', help="python of a venv with MaxText's dependencies and libtpu")
  parser.add_argument('--maxtext_commit', help="MaxText's commit, where the checkout is no git work tree")
  parser.add_argument('--settings', default=','.join(SETTINGS), help=f'comma-separated, of {", ".join(SETTINGS)}')
  results = os.path.join(os.path.dirname(__file__), '..', 'results')
  parser.add_argument('--out', default=os.path.join(results, 'maxtext_v6e_4x4.json'))
  parser.add_argument('--table_only', action='store_true', help='print the table from the JSONs, compile nothing')
  args = parser.parse_args()
  if not args.table_only:
    names = args.settings.split(',')
    if unknown := [n for n in names if n not in SETTINGS]:
      parser.error(f'--settings={args.settings}: unknown {unknown}; known: {", ".join(SETTINGS)}')
    if not args.maxtext or not os.path.exists(os.path.join(args.maxtext, 'src/maxtext/configs/base.yml')):
      parser.error(f'--maxtext={args.maxtext}: not a MaxText checkout (no src/maxtext/configs/base.yml)')
    if not args.maxtext_python or not os.access(args.maxtext_python, os.X_OK):
      parser.error(f'--maxtext_python={args.maxtext_python}: not an executable python')
    git = subprocess.run(['git', '-C', args.maxtext, 'rev-parse', 'HEAD'], capture_output=True, text=True, check=False)
    if not (commit := args.maxtext_commit or os.path.exists(os.path.join(args.maxtext, '.git')) and git.stdout.strip()):
      parser.error(f'--maxtext={args.maxtext}: no git work tree; name its commit with --maxtext_commit')
    command = ['python', 'scripts/maxtext_compare.py', '--maxtext=<maxtext>', '--maxtext_python=<python>',
               *[f'--maxtext_commit={args.maxtext_commit}'] * bool(args.maxtext_commit), f'--settings={args.settings}']
    measure(os.path.abspath(args.maxtext), args.maxtext_python, commit, names, args.out, shlex.join(command))
  table(args.out)


if __name__ == '__main__':
  if sys.argv[1:2] == ['--worker']:
    worker(sys.argv[4], int(sys.argv[2]), float(sys.argv[3]), sys.argv[5:])
  else:
    main()
