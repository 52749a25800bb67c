"""A trained LM run for sampling and scoring: its latest checkpoint's parameters, each read straight into its
sharding of training, judged as resuming judges a checkpoint."""

import contextlib

import flax.linen as nn
import jax
import orbax.checkpoint as ocp
from etils import epath

from laurel import sharding, train_config
from laurel.config_lib import InputError
from laurel.run import checkpoint


@contextlib.contextmanager
def lm_run_on_mesh(workdir, trust_design_file: bool = False):
  """(task, params, step, mesh) of an LM run's latest checkpoint, inside its mesh and logical axis rules; the design
  file its config.json names is imported only with `trust_design_file` (train_config.import_outside_design)."""
  config = train_config.read_config(workdir, trust=trust_design_file)
  if config.task != 'lm':
    raise InputError(f'--workdir={str(workdir)!r}: a {config.task} run; only LM runs are sampled or scored')
  train_config.show_named_paths(config, workdir)  # the run's say: shown before they are read
  task = train_config.validate_config(config, num_devices=len(jax.devices()))
  rules, mesh = task.config.logical_axis_rules, sharding.make_mesh(task.config.mesh)
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules), contextlib.closing(
      ocp.CheckpointManager(checkpoint.run_dir(workdir) / 'checkpoints')) as mngr:
    boxed = jax.eval_shape(task.init, jax.random.key(0), task.example_batch(1))['params']
    abstract = jax.eval_shape(nn.unbox, boxed)
    item = {'params': jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract,
                                   sharding.logical_shardings(boxed, mesh, rules))}
    number = mngr.latest_step()
    if number is None:
      raise InputError(f'--workdir={str(workdir)!r}: holds no checkpoint')
    if (why := checkpoint.damage(epath.Path(mngr.directory) / str(number))) is not None:  # as resuming judges it
      raise InputError(f'--workdir={str(workdir)!r}: checkpoint {number} is damaged ({why}); resuming the run moves '
                       'it aside and goes on from the one before')
    restored = mngr.restore(number, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
        item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item), partial_restore=True)))
    yield task, restored['state']['params'], number, mesh
