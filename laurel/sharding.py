"""Device mesh (data, fsdp, tensor) and logical-axis shardings for parameters, state and batches."""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from laurel.config_lib import InputError

MESH_AXES = ('data', 'fsdp', 'tensor')
# Logical axis -> mesh axes; each residual design adds its own (laurel.designs.logical_axis_rules), and a config may
# override `logical_axis_rules`.
LOGICAL_AXIS_RULES = (
    ('act_batch', ('data', 'fsdp')), ('act_len', None), ('act_embed', None), ('act_heads', 'tensor'),
    ('act_mlp', 'tensor'), ('act_vocab', 'tensor'), ('act_channels', None), ('embed', 'fsdp'), ('vocab', 'tensor'),
    ('mlp', 'tensor'), ('heads', 'tensor'), ('kv', None), ('layers', None), ('conv_in', None), ('conv_out', 'fsdp'),
    ('classes', None), ('spatial', None), ('share_rank', None), ('share_diag', None))


def num_params(tree) -> int:
  """How many numbers a tree of arrays (or of shapes) holds."""
  return int(sum(math.prod(x.shape) for x in jax.tree.leaves(tree)))


def mesh_shape(mesh_cfg, num_devices: int, field: str = 'mesh') -> tuple[int, ...]:
  """Resolves -1 and checks the mesh fits the devices (axis values are checked by train_config.MeshConfig)."""
  sizes = [getattr(mesh_cfg, a) for a in MESH_AXES]
  fixed = math.prod(s for s in sizes if s != -1)
  if -1 in sizes:
    if num_devices % fixed:
      raise InputError(f'{field}={dict(zip(MESH_AXES, sizes))}: the fixed axes ({fixed}) do not divide '
                       f'the {num_devices} devices')
    sizes[sizes.index(-1)] = num_devices // fixed
  elif fixed != num_devices:
    raise InputError(f'{field}={dict(zip(MESH_AXES, sizes))}: needs {fixed} devices, found {num_devices}')
  return tuple(sizes)


def make_mesh(mesh_cfg, devices=None) -> jax.sharding.Mesh:
  devices = jax.devices() if devices is None else devices
  return jax.make_mesh(mesh_shape(mesh_cfg, len(devices)), MESH_AXES,
                       axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES), devices=devices)


def logical_shardings(abstract_boxed_tree, mesh, rules):
  """NamedShardings for a tree whose leaves may be flax `nn.Partitioned` boxes."""
  return nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract_boxed_tree), mesh, rules)


def batch_sharding(mesh) -> NamedSharding:
  return NamedSharding(mesh, P(('data', 'fsdp')))


def global_batch(local_batch: dict, mesh) -> dict:
  """Per-process numpy batch -> global jax.Arrays sharded over data x fsdp (multi-host safe)."""
  return {k: jax.make_array_from_process_local_data(batch_sharding(mesh), np.asarray(v))
          for k, v in local_batch.items()}


def platform() -> str:
  """The platform being traced for: the abstract mesh's devices' (a TPU slice compiled on this machine), else JAX's
  default backend."""
  device = jax.sharding.get_abstract_mesh().abstract_device
  return device.platform if device else jax.default_backend()


def per_device(fn, args, axes, out_axes):
  """fn(*args) on each device's share under shard_map (the partitioner cannot split a Pallas kernel). `axes`: the
  args' logical axes; `out_axes`: the output's (a tuple of them: the outputs'). The batch (`act_batch`) is padded
  with zero rows to divide its mesh axes and cut back after; an arg without it is whole on every device."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return fn(*args)
  several = isinstance(out_axes[0], tuple)
  outs = out_axes if several else (out_axes,)
  in_specs = tuple(nn.logical_to_mesh_axes(names) for names in axes)
  out_specs = tuple(nn.logical_to_mesh_axes(names) for names in outs)
  batch_axis = lambda names: names.index('act_batch')
  batch_mesh_axes = in_specs[0][batch_axis(axes[0])]
  parts = math.prod(mesh.shape[a] for a in ((batch_mesh_axes,) if isinstance(batch_mesh_axes, str)
                                            else batch_mesh_axes or ()))
  batch = args[0].shape[batch_axis(axes[0])]
  pad = lambda x, names: jnp.pad(x, [(0, -batch % parts if name == 'act_batch' else 0) for name in names])
  out = jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs if several else out_specs[0],
                      check_vma=False)(*map(pad, args, axes))
  cut = lambda x, names: jax.lax.slice_in_dim(x, 0, batch, axis=batch_axis(names))
  return tuple(map(cut, out, outs)) if several else cut(out, out_axes)
