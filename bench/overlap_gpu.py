"""One GPU, the engine's thread beside the trainer's: does grpo_async.py's overlap pay when both share a device?

grpo_async.py's trainer learns in the main thread while a second thread of the same process samples the next batch.
With two GPUs each side has its own device and the step takes about max(generate, train). With one GPU shared, the
two threads' kernels meet on one device, and the Python of both meets under one interpreter lock. This measures it at
Qwen3-1.7B's shape, with random weights (nothing is downloaded), where vLLM is not installed:

    train      bench/train_step.py's update (grpo.py's, float32 weights, bf16 autocast, AdamW), --accumulation
               microbatches of --microbatch-size x --seq-len tokens
    generate   a stand-in for the engine: transformers' generate on a bf16 copy of the model, --gen-batch
               sequences of --prompt-len tokens, exactly --gen-tokens new tokens each, sampled, on its own CUDA stream
    both       the two at once: generate in a second thread while this one trains
    process    with --engine-process: the stand-in in a process of its own, which shares the GPU but not the
               interpreter lock, started once and told when to generate while this one trains

It prints the median seconds of each and both / (generate + train): 1.0 means the shared GPU gains nothing from the
overlap; max(generate, train) / (generate + train) is what two GPUs would give. transformers' generate is not vLLM
(no CUDA graphs, no paged attention, more Python per token): read the ratio, not the seconds, as the engine's.

    python -m bench.overlap_gpu                    # H100 / H200
    python -m bench.overlap_gpu --switch-interval-ms 0.1   # the interpreter lock handed over 50x as often
    python -m bench.overlap_gpu --shape tiny --seq-len 128 --gen-tokens 16 --accumulation 2   # a CPU, to try it
"""

import contextlib
import multiprocessing
import statistics
import sys
import threading
import time
from dataclasses import dataclass

import torch
import tyro
from transformers import AutoModelForCausalLM, Qwen3Config

from bench.train_step import SHAPES, microbatch_backward


@dataclass
class Args:
    shape: str = "qwen3-1.7b"
    """a key of bench.train_step.SHAPES"""
    seq_len: int = 1200
    """prompt + response tokens of a trained sequence"""
    microbatch_size: int = 2
    accumulation: int = 16
    """microbatches per optimizer step"""
    gen_batch: int = 64
    """sequences the engine stand-in samples at once"""
    prompt_len: int = 128
    gen_tokens: int = 192
    """new tokens per sampled sequence"""
    repeats: int = 3
    """timed rounds (median), after one warm-up round"""
    engine_process: bool = False
    """also the stand-in in its own process (no shared interpreter lock) beside the trainer"""
    switch_interval_ms: float | None = None
    """the interpreter's switch interval (sys.setswitchinterval; Python's default 5 ms): how long
    a thread that wants the lock waits before the one holding it is asked to let go"""


def main(args: Args) -> dict:
    if args.switch_interval_ms is not None:
        sys.setswitchinterval(args.switch_interval_ms / 1000)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    torch.manual_seed(0)
    config = Qwen3Config(**SHAPES[args.shape], max_position_embeddings=4096)
    # built on the device: random weights of 1.7B drawn on a CPU take minutes
    with device:
        policy = AutoModelForCausalLM.from_config(config, dtype=torch.float32).train()
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-6)
    generate = engine_stand_in(args, config, device)
    response_mask = torch.zeros(args.microbatch_size, args.seq_len, dtype=torch.bool, device=device)
    response_mask[:, args.seq_len // 2 :] = True
    n_batch_tokens = int(response_mask.sum()) * args.accumulation

    def train() -> None:
        for _ in range(args.accumulation):
            ids = torch.randint(0, config.vocab_size, (args.microbatch_size, args.seq_len + 1))
            advantages = torch.randn(args.microbatch_size, device=device)
            microbatch_backward(policy, ids.to(device), response_mask, advantages, n_batch_tokens)
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def both() -> None:
        sampler = threading.Thread(target=generate)
        sampler.start()
        train()
        sampler.join()

    def seconds(fn) -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    # [0]: warm-up (kernels, AdamW's state, the KV cache); each round printed as it ends, so that
    # a run stopped by a time limit still says something
    rounds = []
    for i in range(args.repeats + 1):
        rounds.append((seconds(generate), seconds(train), seconds(both)))
        print(f"round {i}: generate, train, both {[round(x, 2) for x in rounds[-1]]} s", flush=True)
    generate_s, train_s, both_s = (statistics.median(c) for c in zip(*rounds[1:], strict=True))
    process_s = None
    if args.engine_process:
        ctx = multiprocessing.get_context("spawn")
        go, done = ctx.Event(), ctx.Event()
        child = ctx.Process(target=engine_process, args=(args, go, done, args.repeats + 1))
        child.start()

        def in_process() -> None:
            done.clear()
            go.set()
            train()
            done.wait()

        # the child's first round warms it up, as above
        times = []
        for i in range(args.repeats + 1):
            times.append(seconds(in_process))
            print(f"round {i}: the stand-in in its own process {times[-1]:.2f} s", flush=True)
        process_s = statistics.median(times[1:])
        child.join()
    trained = args.accumulation * args.microbatch_size * args.seq_len
    sampled = args.gen_batch * args.gen_tokens
    print(
        f"{name}, torch {torch.__version__}: {args.shape}; train {trained} tokens a step "
        f"({args.accumulation} x {args.microbatch_size} x {args.seq_len}); generate {args.gen_batch} x "
        f"{args.gen_tokens} new tokens after {args.prompt_len}; median of {args.repeats}; switch "
        f"interval {sys.getswitchinterval() * 1000:g} ms"
    )
    print(f"generate {generate_s:.2f} s ({sampled / generate_s:.0f} tokens/s)")
    print(f"train    {train_s:.2f} s ({trained / train_s:.0f} tokens/s)")
    print(
        f"both     {both_s:.2f} s: {both_s / (generate_s + train_s):.2f} of apart "
        f"(two GPUs' bound {max(generate_s, train_s) / (generate_s + train_s):.2f})"
    )
    if process_s is not None:
        print(
            f"process  {process_s:.2f} s: {process_s / (generate_s + train_s):.2f} of apart"
            " (the stand-in in its own process, the first round of its own a warm-up)"
        )
    if device.type == "cuda":
        print(f"peak {torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB")
    return {"generate_s": generate_s, "train_s": train_s, "both_s": both_s, "process_s": process_s}


def engine_stand_in(args: Args, config, device: torch.device):
    """generate(): the engine's stand-in samples args.gen_batch sequences on its own CUDA stream."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with device:
        engine = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    engine.generation_config.pad_token_id = 0
    # the engine's own stream: its kernels may run beside the trainer's
    stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def generate() -> None:
        prompts = torch.randint(1, config.vocab_size, (args.gen_batch, args.prompt_len))
        on_stream = torch.cuda.stream(stream) if stream else contextlib.nullcontext()
        with torch.no_grad(), on_stream:
            engine.generate(
                prompts.to(device),
                attention_mask=torch.ones_like(prompts).to(device),
                do_sample=True,
                max_new_tokens=args.gen_tokens,
                min_new_tokens=args.gen_tokens,
            )
            if stream:
                stream.synchronize()

    return generate


def engine_process(args: Args, go, done, rounds: int) -> None:
    """A child process: the stand-in, which generates each time `go` is set, then sets `done`."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = Qwen3Config(**SHAPES[args.shape], max_position_embeddings=4096)
    generate = engine_stand_in(args, config, device)
    for _ in range(rounds):
        go.wait()
        go.clear()
        generate()
        done.set()


if __name__ == "__main__":
    main(tyro.cli(Args))
