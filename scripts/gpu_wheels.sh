#!/usr/bin/env bash
# make gpu-wheels: the packages this project needs beyond an image that already has JAX with CUDA, Flax, Optax,
# Orbax, TensorBoard, SentencePiece, NumPy, matplotlib, Pillow, absl-py, etils, PyYAML, cloudpickle, protobuf and
# psutil, as wheels for CPython 3.12 on manylinux x86-64, into .whl/ (ignored by git; docs/gpu.md installs them on a
# machine without network). Versions are pinned so that the set stays consistent: grain needs array-record and
# portpicker; xxhash is laurel.run.checkpoint's; ml_collections needs absl-py and PyYAML; the rest of their requirements are on such an image.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=(ml_collections==1.1.0 grain==0.2.18 array-record==0.8.6 portpicker==1.6.0 xxhash==3.6.0)
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64
           manylinux2014_x86_64 manylinux1_x86_64)
rm -rf .whl
mkdir -p .whl
${PIP:-python3 -m pip} download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${PLATFORMS[@]/#/--platform=}" -d .whl "${WHEELS[@]}"
ls .whl
du -sh .whl
