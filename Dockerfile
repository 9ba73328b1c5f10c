# GPU image: any script runs as `docker run --gpus all --ipc=host IMAGE grpo.py --model Qwen/Qwen3-1.7B-Base`.
# --ipc=host (or --shm-size 1g): Docker's 64 MiB /dev/shm is too small for NCCL under torchrun and for vLLM's 160 MiB
# message queue with --tensor-parallel-size 2 (vllm/distributed/device_communicators/shm_broadcast.py, docs/gpu.md).
# python:3.11 (not -slim) because Triton, which vLLM uses on GPUs, compiles small C launchers with gcc at run time.
# vLLM's wheel brings its CUDA libraries through torch's nvidia-* packages; the host needs only the NVIDIA driver,
# 580 or newer: the vLLM 0.32.0 wheel is built for CUDA 13 (it links libnvrtc.so.13).
FROM python:3.11
WORKDIR /app
# bubblewrap: the code sandbox (verifiers.run_program) runs model-written programs in namespaces with no network
# and a read-only root. Docker's default seccomp profile forbids the namespaces: run with
# `--security-opt seccomp=unconfined` (or a profile that allows unshare) or the sandbox falls back to limits alone.
RUN apt-get update && apt-get install -y --no-install-recommends bubblewrap && rm -rf /var/lib/apt/lists/*
COPY requirements.txt .
RUN pip install --no-cache-dir -r requirements.txt
COPY . .
# .dockerignore leaves .git out: system.jsonl's commit comes from the build,
# `docker build --build-arg GIT_COMMIT=$(git rev-parse HEAD) .`
ARG GIT_COMMIT
ENV NANORLVR_GIT_COMMIT=$GIT_COMMIT
ENTRYPOINT ["python"]
