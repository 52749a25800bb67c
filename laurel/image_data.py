"""Image classification input on grain: ImageNet through TFDS (prepared, never downloaded) or synthetic images, as
batches {'images': float32 (b, S, S, 3) normalised, 'labels': int32 (b,)}."""

import dataclasses
import io
import math

import grain
import numpy as np
from PIL import Image  # TFDS's own numpy decoder uses pillow too

from laurel.config_lib import (BOOL, NON_EMPTY_STRING, NON_NEGATIVE, NON_NEGATIVE_INT, POSITIVE_INT, STRING, build,
                               field, in_range, is_int, is_number, one_of, optional_import)

MEAN_RGB = np.array([0.485, 0.456, 0.406], np.float32) * 255
STDDEV_RGB = np.array([0.229, 0.224, 0.225], np.float32) * 255


@dataclasses.dataclass(frozen=True)
class ImageDataConfig:
  """`config.data` of a classification run."""
  name: str = field('synthetic', one_of('imagenet', 'synthetic'))
  image_size: int = field(224, (lambda v: is_int(v) and v >= 8, 'must be an integer >= 8'))
  num_classes: int = field(1000, POSITIVE_INT)
  tfds_name: str = field('imagenet2012', NON_EMPTY_STRING)
  tfds_data_dir: str = field('', STRING)  # '' = TFDS's default ($TFDS_DATA_DIR or ~/tensorflow_datasets)
  train_split: str = field('train', NON_EMPTY_STRING)
  eval_split: str = field('validation', NON_EMPTY_STRING)
  min_crop_area: float = field(0.08, in_range(0, 1, closed=(False, True)))  # random-resized crop: area share
  max_aspect_ratio: float = field(4 / 3, (lambda v: is_number(v) and v >= 1, 'must be a number >= 1'))
  eval_crop_fraction: float = field(0.875, in_range(0, 1, closed=(False, True)))  # centre crop (224 of 256)
  random_flip: bool = field(True, BOOL)
  synthetic_train_examples: int = field(10_000, POSITIVE_INT)
  synthetic_eval_examples: int = field(1_000, POSITIVE_INT)
  synthetic_noise: float = field(0.3, NON_NEGATIVE)  # noise std as a share of the pixel range
  read_threads: int = field(4, NON_NEGATIVE_INT)  # threads decoding per process (PIL releases the GIL)
  num_workers: int = field(0, NON_NEGATIVE_INT)  # grain worker processes; 0 reads in the main process
  prefetch: int = field(2, NON_NEGATIVE_INT)  # batches buffered ahead


def normalize(image_HxWx3: np.ndarray) -> np.ndarray:
  return (np.asarray(image_HxWx3, np.float32) - MEAN_RGB) / STDDEV_RGB


def random_crop_box(height, width, rng, min_area, max_ratio):
  """(left, top, right, bottom) of torchvision's RandomResizedCrop: ten tries, then the whole image clamped."""
  log_ratio = (-math.log(max_ratio), math.log(max_ratio))
  for _ in range(10):
    area = height * width * rng.uniform(min_area, 1.0)
    ratio = math.exp(rng.uniform(*log_ratio))
    w, h = int(round(math.sqrt(area * ratio))), int(round(math.sqrt(area / ratio)))
    if 0 < w <= width and 0 < h <= height:
      top, left = int(rng.integers(0, height - h + 1)), int(rng.integers(0, width - w + 1))
      return left, top, left + w, top + h
  w, h = min(width, int(round(height * max_ratio))), min(height, int(round(width * max_ratio)))
  top, left = (height - h) // 2, (width - w) // 2
  return left, top, left + w, top + h


def centre_crop_box(height, width, fraction):
  side = min(height, width) * fraction
  top, left = (height - side) / 2, (width - side) / 2
  return left, top, left + side, top + side


@dataclasses.dataclass(frozen=True)
class CropTransform(grain.transforms.RandomMap):
  """TFDS's image (decoded or encoded) -> cropped (train: random-resized, flipped; eval: centre), S×S, normalised."""
  cfg: ImageDataConfig
  train: bool

  def random_map(self, example, rng: np.random.Generator | None = None):
    image = example['image']
    if isinstance(image, (bytes, np.bytes_)):
      image = Image.open(io.BytesIO(image)).convert('RGB')
    else:
      array = np.asarray(image, np.uint8)
      image = Image.fromarray(array[..., 0] if array.ndim == 3 and array.shape[-1] == 1 else array).convert('RGB')
    cfg, h, w = self.cfg, image.height, image.width
    box = (random_crop_box(h, w, rng, cfg.min_crop_area, cfg.max_aspect_ratio) if self.train else
           centre_crop_box(h, w, cfg.eval_crop_fraction))
    out_SxSx3 = np.asarray(image.resize((cfg.image_size, cfg.image_size), Image.BILINEAR, box=box))
    if self.train and cfg.random_flip and rng.random() < 0.5:  # the crop draws first, then the flip
      out_SxSx3 = out_SxSx3[:, ::-1]
    return {'images': normalize(out_SxSx3), 'labels': np.int32(example['label'])}


@dataclasses.dataclass(frozen=True)
class SyntheticExample(grain.transforms.Map):
  """Index -> a deterministic learnable example: class colour and stripes, plus noise."""
  cfg: ImageDataConfig
  split: int  # 0 train, 1 eval: disjoint generator streams

  def map(self, index):
    s, c = self.cfg.image_size, self.cfg.num_classes
    rng = np.random.default_rng([self.split, int(index)])
    label = int(rng.integers(c))
    klass = np.random.default_rng([7, label])  # the class's fixed look
    colour_3 = klass.uniform(0.2, 0.8, 3)
    angle, freq, phase = klass.uniform(0, math.pi), klass.uniform(1, 4), rng.uniform(0, 2 * math.pi)
    yy, xx = np.meshgrid(np.linspace(0, 1, s), np.linspace(0, 1, s), indexing='ij')
    stripes_SxS = np.sin(2 * math.pi * freq * (xx * math.cos(angle) + yy * math.sin(angle)) + phase)
    image = colour_3 + 0.15 * stripes_SxS[..., None] + self.cfg.synthetic_noise * rng.standard_normal((s, s, 3))
    return {'images': normalize(np.clip(image, 0, 1) * 255), 'labels': np.int32(label)}


def _source(cfg: ImageDataConfig, train: bool) -> grain.MapDataset:
  if cfg.name == 'synthetic':
    n = cfg.synthetic_train_examples if train else cfg.synthetic_eval_examples
    return grain.MapDataset.range(n).map(SyntheticExample(cfg, 0 if train else 1))
  tfds = optional_import('tensorflow_datasets', 'tfds', f'data.name={cfg.name!r}')
  split = cfg.train_split if train else cfg.eval_split
  return grain.MapDataset.source(tfds.data_source(cfg.tfds_name, split=split, data_dir=cfg.tfds_data_dir or None,
                                                  download=False))


def image_dataset(data_cfg, *, train: bool, batch_size: int, seed: int, process_index: int = 0,
                  process_count: int = 1, num_epochs: int | None = None) -> grain.IterDataset:
  """Shuffled (train: one permutation on every process, another each epoch), sharded, repeated (forever unless
  num_epochs is set), decoded and augmented, batched."""
  cfg = build(ImageDataConfig, data_cfg, 'data')
  if not 0 <= process_index < process_count:
    raise ValueError(f'process_index={process_index}: must be in [0, process_count={process_count})')
  ds = _source(cfg, train)
  if train:
    ds = ds.shuffle(seed=seed % 2 ** 32)
  ds = ds[process_index::process_count].repeat(num_epochs)
  if cfg.name == 'imagenet':
    # Fold the process in, so processes draw different crops for their (different) images.
    aug_seed = int(np.random.SeedSequence([seed, process_index]).generate_state(1)[0])
    ds = ds.random_map(CropTransform(cfg, train), seed=aug_seed)
  read = grain.ReadOptions(num_threads=cfg.read_threads, prefetch_buffer_size=max(1, cfg.prefetch) * batch_size)
  it = ds.to_iter_dataset(read).batch(batch_size, drop_remainder=True)
  if cfg.num_workers > 0:  # grain's workers read absl flags: run under absl.app (laurel.main)
    it = it.mp_prefetch(grain.MultiprocessingOptions(num_workers=cfg.num_workers,
                                                     per_worker_buffer_size=max(1, cfg.prefetch)))
  return it
