"""Image pipelines: shapes, normalisation, determinism, sharding, iterator state, ImageNet via mocked TFDS."""

import dataclasses
import json
import math
import re

import numpy as np
import pytest
import tensorflow_datasets as tfds

from configs import imagenet_resnet50
from laurel import config_lib, image_data
from laurel.plan import preflight


def synthetic(**overrides):
  base = dict(name='synthetic', image_size=16, num_classes=4, synthetic_train_examples=24,
              synthetic_eval_examples=10, read_threads=0, num_workers=0, prefetch=1)
  return image_data.ImageDataConfig(**{**base, **overrides})


def validate(data_cfg, prefix='data'):
  return config_lib.build(image_data.ImageDataConfig, data_cfg, prefix)


def take(ds_or_it, n):
  it = iter(ds_or_it)
  return [next(it) for _ in range(n)]


def stacked(batches, key):
  return np.concatenate([b[key] for b in batches])


def pixels(images):
  """Undoes the normalisation: back to [0, 255] RGB."""
  return images * image_data.STDDEV_RGB + image_data.MEAN_RGB


# --- synthetic ---

def test_synthetic_shapes_dtypes_and_normalisation():
  cfg = synthetic()
  for train in (True, False):
    batch = take(image_data.image_dataset(cfg, train=train, batch_size=5, seed=0), 1)[0]
    assert set(batch) == {'images', 'labels'}
    assert batch['images'].shape == (5, 16, 16, 3) and batch['images'].dtype == np.float32
    assert batch['labels'].shape == (5,) and batch['labels'].dtype == np.int32
    assert ((batch['labels'] >= 0) & (batch['labels'] < 4)).all()
    raw = pixels(batch['images'])
    assert raw.min() >= -1e-3 and raw.max() <= 255 + 1e-3 and raw.std() > 10


def test_normalize_uses_imagenet_mean_and_std():
  out = image_data.normalize(np.broadcast_to(image_data.MEAN_RGB, (2, 2, 3)))
  np.testing.assert_allclose(out, 0, atol=1e-6)
  np.testing.assert_allclose(image_data.normalize(np.full((1, 1, 3), 255.0))[0, 0],
                             (1 - np.array([0.485, 0.456, 0.406])) / np.array([0.229, 0.224, 0.225]), rtol=1e-5)


def test_synthetic_is_deterministic_and_seed_only_reorders():
  cfg = synthetic()
  a = take(image_data.image_dataset(cfg, train=True, batch_size=4, seed=3), 6)  # one epoch of 24
  b = take(image_data.image_dataset(cfg, train=True, batch_size=4, seed=3), 6)
  c = take(image_data.image_dataset(cfg, train=True, batch_size=4, seed=4), 6)
  np.testing.assert_array_equal(stacked(a, 'images'), stacked(b, 'images'))
  assert not np.array_equal(stacked(a, 'labels'), stacked(c, 'labels'))
  key = lambda batches: sorted(x.tobytes() for x in stacked(batches, 'images'))
  assert key(a) == key(c)  # same examples, another order


def test_train_reshuffles_each_epoch_and_covers_the_data():
  cfg = synthetic(synthetic_train_examples=12)
  batches = take(image_data.image_dataset(cfg, train=True, batch_size=4, seed=0), 6)
  first, second = stacked(batches[:3], 'images'), stacked(batches[3:], 'images')
  assert len({x.tobytes() for x in first}) == 12
  assert sorted(x.tobytes() for x in first) == sorted(x.tobytes() for x in second)
  assert not np.array_equal(first, second)


def test_processes_read_disjoint_shards():
  cfg = synthetic(synthetic_eval_examples=12)
  shards = [stacked(take(image_data.image_dataset(cfg, train=False, batch_size=3, seed=0, process_index=p,
                                                  process_count=2, num_epochs=1), 2), 'images') for p in range(2)]
  whole = stacked(take(image_data.image_dataset(cfg, train=False, batch_size=3, seed=0, num_epochs=1), 4), 'images')
  np.testing.assert_array_equal(shards[0], whole[0::2])
  np.testing.assert_array_equal(shards[1], whole[1::2])
  with pytest.raises(ValueError, match='process_index=2'):
    image_data.image_dataset(cfg, train=False, batch_size=3, seed=0, process_index=2, process_count=2)


def test_num_epochs_one_stops_and_default_repeats():
  cfg = synthetic(synthetic_eval_examples=10)
  assert len(list(image_data.image_dataset(cfg, train=False, batch_size=5, seed=0, num_epochs=1))) == 2
  assert len(take(image_data.image_dataset(cfg, train=False, batch_size=5, seed=0), 7)) == 7


def test_iterator_state_round_trip():
  cfg = synthetic()
  ds = image_data.image_dataset(cfg, train=True, batch_size=4, seed=1)
  it = iter(ds)
  take(it, 3)
  state = it.get_state()
  expected = take(it, 4)  # crosses the epoch boundary (24 examples = 6 batches)
  resumed = iter(image_data.image_dataset(cfg, train=True, batch_size=4, seed=1))
  resumed.set_state(state)
  for want, got in zip(expected, take(resumed, 4)):
    np.testing.assert_array_equal(want['images'], got['images'])
    np.testing.assert_array_equal(want['labels'], got['labels'])


def test_synthetic_classes_are_learnable():
  """A nearest-class-mean classifier on raw pixels beats chance by far, so a small net's loss can fall."""
  cfg = synthetic(num_classes=10, image_size=32, synthetic_train_examples=400, synthetic_eval_examples=200)
  train = take(image_data.image_dataset(cfg, train=True, batch_size=100, seed=0), 4)
  test = take(image_data.image_dataset(cfg, train=False, batch_size=100, seed=0), 2)
  x, y = stacked(train, 'images').reshape(400, -1), stacked(train, 'labels')
  means = np.stack([x[y == c].mean(0) for c in range(10)])
  xt, yt = stacked(test, 'images').reshape(200, -1), stacked(test, 'labels')
  pred = np.argmin(((xt[:, None] - means[None]) ** 2).sum(-1), axis=1)
  assert (pred == yt).mean() > 0.6


def test_tiny_preset_data_validates():
  c = imagenet_resnet50.get_config('rw,preset=tiny')
  cfg = validate(c.data)
  assert isinstance(cfg, image_data.ImageDataConfig)
  assert (cfg.name, cfg.image_size, cfg.num_classes) == ('synthetic', 32, 10)
  assert set(c.data.keys()) == {f.name for f in dataclasses.fields(image_data.ImageDataConfig)}
  batch = take(image_data.image_dataset(c.data, train=True, batch_size=c.batch_size, seed=c.seed), 1)[0]
  assert batch['images'].shape == (32, 32, 32, 3)


# --- ImageNet through TFDS, mocked offline (random uint8 images of 5-49 px per side, labels < 1000) ---

def imagenet(image_size=24, **overrides):
  c = imagenet_resnet50.get_config('baseline')
  cfg = validate(c.data)
  return dataclasses.replace(cfg, image_size=image_size, num_workers=0, read_threads=2, prefetch=1, **overrides)


@pytest.fixture
def mock_imagenet():
  with tfds.testing.mock_data(num_examples=16, policy=tfds.testing.MockPolicy.USE_CODE):
    yield


def test_imagenet_eval_is_the_centre_crop_of_each_example(mock_imagenet):
  cfg = imagenet()
  source = tfds.data_source('imagenet2012', split='validation')
  batches = take(image_data.image_dataset(cfg, train=False, batch_size=4, seed=0, process_index=1,
                                          process_count=2, num_epochs=1), 2)
  images, labels = stacked(batches, 'images'), stacked(batches, 'labels')
  assert images.shape == (8, 24, 24, 3) and images.dtype == np.float32 and labels.dtype == np.int32
  for j, i in enumerate(range(1, 16, 2)):  # process 1 of 2 reads examples 1, 3, 5, ...
    want = image_data.CropTransform(cfg, train=False).random_map(source[i])
    np.testing.assert_array_equal(images[j], want['images'])
    assert labels[j] == int(source[i]['label'])


def test_imagenet_train_crops_are_deterministic_per_seed(mock_imagenet):
  cfg = imagenet()
  run = lambda seed: take(image_data.image_dataset(cfg, train=True, batch_size=4, seed=seed), 4)
  a, b, c = run(0), run(0), run(1)
  np.testing.assert_array_equal(stacked(a, 'images'), stacked(b, 'images'))
  assert not np.array_equal(stacked(a, 'images'), stacked(c, 'images'))
  source = tfds.data_source('imagenet2012', split='train')
  assert sorted(stacked(a, 'labels')) == sorted(int(source[i]['label']) for i in range(16))
  raw = pixels(stacked(a, 'images'))
  assert raw.min() >= -1e-3 and raw.max() <= 255 + 1e-3


def test_imagenet_state_round_trip_and_paper_size(mock_imagenet):
  cfg = imagenet(image_size=224)
  it = iter(image_data.image_dataset(cfg, train=True, batch_size=2, seed=0))
  take(it, 3)
  state = it.get_state()
  expected = take(it, 2)
  resumed = iter(image_data.image_dataset(cfg, train=True, batch_size=2, seed=0))
  resumed.set_state(state)
  for want, got in zip(expected, take(resumed, 2)):
    assert got['images'].shape == (2, 224, 224, 3)
    np.testing.assert_array_equal(want['images'], got['images'])


def test_imagenet_decodes_grayscale_and_encoded_bytes():
  import io
  from PIL import Image
  cfg = imagenet(image_size=8)
  gray = np.random.default_rng(0).integers(0, 256, (20, 30, 1), np.uint8)
  out = image_data.CropTransform(cfg, train=False).random_map({'image': gray, 'label': np.int64(3)})
  assert out['images'].shape == (8, 8, 3) and out['labels'] == 3
  buf = io.BytesIO()
  Image.fromarray(np.full((20, 30, 3), 128, np.uint8)).save(buf, format='JPEG')
  out = image_data.CropTransform(cfg, train=False).random_map({'image': buf.getvalue(), 'label': 5})
  np.testing.assert_allclose(pixels(out['images']), 128, atol=2)


def test_random_crop_box_stays_inside_and_in_range():
  rng = np.random.default_rng(0)
  for _ in range(200):
    h, w = rng.integers(5, 400, 2)
    left, top, right, bottom = image_data.random_crop_box(h, w, rng, 0.08, 4 / 3)
    assert 0 <= left < right <= w and 0 <= top < bottom <= h
  # A very wide image falls back to the widest allowed centred crop.
  assert image_data.random_crop_box(10, 1000, np.random.default_rng(0), 0.9, 4 / 3) == (493, 0, 506, 10)
  left, top, right, bottom = image_data.centre_crop_box(256, 320, 0.875)
  assert right - left == bottom - top == 224 and math.isclose(left, 48) and math.isclose(top, 16)


# --- validation ---

@pytest.mark.parametrize('name,value', [
    ('name', 'cifar'), ('image_size', 4), ('image_size', 32.0), ('num_classes', 0), ('tfds_name', ''),
    ('tfds_data_dir', None), ('train_split', 3), ('min_crop_area', 0.0), ('min_crop_area', 1.5),
    ('max_aspect_ratio', 0.5), ('eval_crop_fraction', 0), ('random_flip', 'yes'), ('synthetic_noise', -1),
    ('synthetic_train_examples', 0), ('read_threads', -1), ('num_workers', 1.5), ('prefetch', True),
])
def test_validate_errors_name_field_and_value(name, value):
  d = imagenet_resnet50.get_config('baseline').data.to_dict()
  d[name] = value
  with pytest.raises(ValueError, match=re.escape(f'data.{name}={value!r}:')) as err:
    validate(d)
  assert '\n' not in str(err.value)


def test_validate_rejects_unknown_fields_and_uses_the_given_prefix():
  with pytest.raises(ValueError, match=r'^eval_data\.bogus: unknown field'):
    validate({'bogus': 1}, 'eval_data')
  assert validate(imagenet_resnet50.get_config('rw_lr').data).name == 'imagenet'


def test_check_available_names_what_is_missing_and_how_to_prepare_it(tmp_path):
  cfg = dict(name='imagenet', tfds_data_dir=str(tmp_path))
  with pytest.raises(ValueError, match=re.escape(f"data.tfds_data_dir='{tmp_path}': no prepared imagenet2012 in "
                                                 f'{tmp_path}; prepare it with tfds build imagenet2012')):
    preflight.check_image_data(cfg)
  version = tmp_path / 'imagenet2012' / '5.1.0'
  version.mkdir(parents=True)
  info = {'fileFormat': 'array_record', 'splits': [{'name': 'train'}]}
  (version / 'dataset_info.json').write_text(json.dumps(info))
  with pytest.raises(ValueError, match=re.escape(f"{version} has no split 'validation' (it has: train)")):
    preflight.check_image_data(cfg)
  info['splits'].append({'name': 'validation'})
  (version / 'dataset_info.json').write_text(json.dumps(info))
  preflight.check_image_data(cfg)
  preflight.check_image_data({'name': 'synthetic', 'tfds_data_dir': '/nowhere'})  # reads nothing
