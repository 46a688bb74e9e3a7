#!/bin/sh
# Wheels the GPU machine (device tool, nvidia-h200: Python 3.12, torch 2.11, no diffusers/wids/datasets)
# lacks, downloaded here into .whl/ (ignored) and carried with `run(carry=[".whl"])`. There:
#   python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
# (with their bytecode compiled, as in a container image: without it every timed process spends about
# 8 s compiling diffusers' sources at import, bench/RESULTS.md 2026-12-03)
#   export PYTHONPATH=/tmp/site
# tensorboardX, protobuf: trainer.jobs.train writes TensorBoard event files.
# pydantic: bench/catalog_shards.py writes shards with the packer's own records (core.models.Sample).
# c2pa-python and cryptography: trainer/serve/credentials.py signs what the server serves (bench/demo_recipe.py draws through it).
# torchao: the bench's +fp8 lever (torchao.float8); 0.18.0 is built against torch 2.11 (its C++ extensions load
#   only from 2.11 on; float8 training is Python over torch._scaled_mm). A cp310-abi3 wheel: it installs on 3.12.
# diffusers' and datasets' other needs are already in the device image (KINDS.md's package list).
set -eu
cd "$(dirname "$0")/.."
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
  diffusers==0.42.1 wids==0.1.11 braceexpand==0.1.7 importlib_metadata==8.7.0 \
  datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 \
  c2pa-python==0.38.1 cryptography==46.0.3 cffi==2.0.0 pycparser==2.23 \
  pydantic==2.13.5 pydantic-core==2.46.5 annotated-types==0.7.0 typing-inspection==0.4.2 \
  tensorboardX==2.6.5 protobuf==7.36.2 \
  torchao==0.18.0
ls -la .whl
