#!/usr/bin/env bash
# Prepare the lent GPU machine (Python 3.12, torch with CUDA, no network, no SGLang, no Ray) for the benchmarks and
# the GPU demo: the wheels carried in .gpuwheels/ (megatron-core, SGLang's front end's light dependencies) and its
# .tar.xz archives (Ray stripped by bench/strip_ray_wheel.py, the installed sglang 0.5.23's Python sources) are
# installed into /tmp/gpusite and put on PYTHONPATH (docs/en/benchmarks/gpu-setup.md says how to fill .gpuwheels/).
# Usage (on the GPU machine, from the repo root; do not pipe it): source bench/gpu_env.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # never NVLink multicast
if [ ! -f /tmp/gpusite/.installed ]; then  # a machine still warm from an earlier call has them already
  python3 -m pip install -q --no-deps --no-index --target /tmp/gpusite .gpuwheels/*.whl > /tmp/gpusite.log 2>&1 \
    || tail -5 /tmp/gpusite.log
  for archive in .gpuwheels/*.tar.xz; do  # tar keeps the executable bits of Ray's gcs_server and raylet
    [ -f "$archive" ] && tar -xJf "$archive" -C /tmp/gpusite
  done
  if [ -f .gpuwheels/sglang_py.zip ]; then  # the sglang sources in their older form
    python3 -c "import zipfile; zipfile.ZipFile('.gpuwheels/sglang_py.zip').extractall('/tmp/gpusite')"
  fi
  touch /tmp/gpusite/.installed
fi
export PYTHONPATH=$PWD:/tmp/gpusite HF_HUB_OFFLINE=1 PATH=/tmp/gpusite/bin:$PATH  # bin: py-spy, where carried
python3 -c "import torch, sglang, megatron.core, ray; print('gpu env ok: torch', torch.__version__, 'sglang', \
sglang.__version__, 'ray', ray.__version__, torch.cuda.device_count(), 'GPUs')"
