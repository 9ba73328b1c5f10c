"""Supervised fine-tuning (SFT) on reasoning traces, evaluated by a vLLM engine that reloads the
trainer's weights.

SFT is maximum likelihood on (prompt, response) pairs: minimise the negative log-probability of each
response token (its EOS included) given the prompt and the tokens before it. On worked solutions (a
dataset's, or a stronger model's traces) a base model learns the answer format and a way of
reasoning; expert_iter.py and grpo.py start from the result.

Deliberate simplifications: (1) more GPUs means data parallel (torchrun: each rank a whole model, an
engine and a share of each batch): a 1.7B model in fp32 with AdamW fits one 80 GB GPU; (2) every
optimizer step sees exactly `batch_size` examples (an epoch's last partial batch is dropped); (3)
the loss is the mean NLL over a batch's response tokens, however microbatched or padded; (4) a
mixture (--dataset gsm8k:0.5,math:0.5) is mixed once, before training.

Usage:
    python sft.py --model Qwen/Qwen3-1.7B-Base                     # GSM8K solutions, R1-Zero template, 2 GPUs
    torchrun --nproc-per-node 4 sft.py                             # 8 GPUs: 4 ranks of 2 (docs/distributed.md)
    python sft.py --model runs/tiny-qwen3 --dataset synthetic --batch-size 16 --lr 1e-3   # CPU, tiny model
    python sft.py --sft-file traces.jsonl --dataset gsm8k          # your own {"prompt", "response"} pairs
    python sft.py --dataset gsm8k:0.5,math:0.25,mbpp:0.25 --data-dir ../shared/data   # a mixture: docs/tasks.md
"""

import contextlib
import copy
import datetime
import json
import math
import os
import shutil
import sys
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import tyro
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup
from vllm import LLM, SamplingParams

import data
import verifiers


@dataclass
class Args:
    # --- run ---
    # runs/<exp_name>__<seed>__<unix time>
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    seed: int = 1  # seed for the data order, the weights' dropout (none in Qwen3) and the engine
    output_dir: str = "runs"  # where run folders are made
    resume: str | None = None  # a run folder to continue from its last checkpoint
    track: bool = False  # also log to Weights & Biases (pip install wandb)
    wandb_project: str = "rlvr-sft"  # the W&B project, with --track
    # --- model ---
    # Hugging Face model name or local model folder to fine-tune
    model: str = "Qwen/Qwen3-1.7B-Base"
    # device of the trainer; None: this rank's first GPU, else cpu (resolve_devices)
    policy_device: str | None = None
    # device of the vLLM engine; None: this rank's second GPU, else the trainer's
    vllm_device: str | None = None
    # the engine's share of its GPU; None: 0.85 alone, 0.3 shared
    vllm_gpu_memory_utilization: float | None = None
    # recompute activations in the backward pass: less memory, about 30% more time
    gradient_checkpointing: bool = False
    # --- data ---
    dataset: str = "gsm8k"  # gsm8k | math | mbpp | synthetic, or a mixture: gsm8k:0.5,math:0.5
    data_dir: str | None = None  # data root, one folder per dataset (../shared/data); None: the hub
    # JSONL of {"prompt", "response"} pairs to train on instead of solutions
    sft_file: str | None = None
    template: str = "r1_zero"  # r1_zero | question | chat (data.py)
    # e.g. ifeval=question: another template for a dataset
    dataset_templates: list[str] = field(default_factory=list)
    # train on the first n examples (of a mixture, n in all); None: all
    n_examples: int | None = None
    # keep only training responses whose final answer the verifier accepts
    filter_correct: bool = False
    # longest prompt + response in tokens; longer examples are cut at the end (and counted)
    max_seq_len: int = 1024
    # --- optim ---
    lr: float = 2e-5  # peak learning rate of AdamW
    weight_decay: float = 0.0  # AdamW weight decay
    warmup_ratio: float = 0.03  # share of the steps warming up, before the cosine decay
    n_epochs: int = 1  # passes over the training examples
    batch_size: int = 32  # examples per optimizer step
    microbatch_size: int = 2  # examples per forward/backward pass (gradients accumulate)
    max_grad_norm: float = 1.0  # clip the gradient's global L2 norm to this
    # --- eval ---
    eval_split: str = "val"  # val (or test where there is none) | test
    n_eval: int = 256  # problems evaluated per dataset, greedy, from the start of its eval split
    eval_every: int = 50  # evaluate every this many optimizer steps (and at the start and the end)
    # train on while the engine evaluates; None: when it has its own device
    eval_in_background: bool | None = None
    eval_max_tokens: int = 512  # max new tokens per evaluation response
    n_log_generations: int = 4  # evaluation responses to generations.jsonl
    save_every: int = 100  # checkpoint every this many optimizer steps (and at the end)
    # keep only the newest this many checkpoints (Qwen3-1.7B: ~20.6 GB each); 0 keeps all
    keep_checkpoints: int = 2
    reload_tol: float | None = None  # max probe gap (reload_and_check); None: 1e-3 fp32, 0.5 bf16
    # under torchrun: how long a rank waits for the others before naming them and stopping
    rank_timeout_s: float = 1800


# --- ALGORITHM, CS336 vocabulary: tokenizing and log-probs (same in sft.py, expert_iter.py, grpo.py, distill.py) ---


def tokenize_prompt_and_output(
    prompt_strs: list[str], output_strs: list[str], tokenizer
) -> dict[str, torch.Tensor]:
    """Tokenize prompts and outputs separately, then collate_token_ids: input_ids, labels,
    response_mask (B, T)."""
    prompt_ids = tokenizer(prompt_strs, add_special_tokens=False)["input_ids"]
    output_ids = tokenizer(output_strs, add_special_tokens=False)["input_ids"]
    pad_id = (
        tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    )
    return collate_token_ids(prompt_ids, output_ids, pad_id if pad_id is not None else 0)


def collate_token_ids(
    prompt_ids: list[list[int]], output_ids: list[list[int]], pad_id: int
) -> dict:
    """Concatenate, pad and shift: input_ids, labels, response_mask (1 where the label is an output
    token), each (B, max_len - 1). From lengths, not pad ids: pad == EOS in Qwen3 base models, and
    the EOS must be learned."""
    max_len = max(len(p) + len(o) for p, o in zip(prompt_ids, output_ids, strict=True))
    full = torch.full((len(prompt_ids), max_len), pad_id, dtype=torch.long)  # (B, L)
    is_output = torch.zeros((len(prompt_ids), max_len), dtype=torch.bool)  # (B, L)
    for i, (p, o) in enumerate(zip(prompt_ids, output_ids, strict=True)):
        full[i, : len(p) + len(o)] = torch.tensor([*p, *o], dtype=torch.long)
        is_output[i, len(p) : len(p) + len(o)] = True
    return {"input_ids": full[:, :-1], "labels": full[:, 1:], "response_mask": is_output[:, 1:]}


def compute_entropy(logits: torch.Tensor, chunk_size: int = 1024) -> torch.Tensor:
    """Entropy of each next-token distribution, (B, T, V) logits -> (B, T): logsumexp(z) - sum
    softmax(z) z, which never takes the log of an underflowed probability. In chunks: at once, two
    more (B, T, V) float32 tensors."""
    flat = logits.reshape(-1, logits.shape[-1])  # (B T, V)
    chunks = [
        torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(dim=-1)
        for z in flat.split(chunk_size)
    ]
    return torch.cat(chunks).reshape(logits.shape[:-1])


def get_response_log_probs(
    model,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    return_token_entropy: bool = False,
    temperature: float = 1.0,
) -> dict[str, torch.Tensor]:
    """log p(labels[t] | input_ids[:t+1]): (B, T) -> {"log_probs": (B, T)}, and "token_entropy" (B,
    T). The logits are divided by `temperature` as the engine's are when it samples (grpo.py needs
    it; SFT uses 1)."""
    logits = model(input_ids).logits.float()  # (B, T, V); float32 even under bf16 autocast
    # at T = 1, no second (B, T, V) copy
    logits = logits / temperature if temperature != 1.0 else logits
    # (B, T)
    log_probs = torch.log_softmax(logits, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    if not return_token_entropy:
        return {"log_probs": log_probs}
    with torch.no_grad():
        return {"log_probs": log_probs, "token_entropy": compute_entropy(logits)}


def masked_normalize(
    tensor: torch.Tensor, mask: torch.Tensor, normalize_constant: float, dim: int | None = None
) -> torch.Tensor:
    """Sum of `tensor` where mask is 1, over `dim` (all dims if None), divided by
    normalize_constant."""
    return (tensor * mask).sum(dim=dim) / normalize_constant


# --- ALGORITHM: the SFT loss (same in sft.py and expert_iter.py) ---


def sft_microbatch_train_step(
    policy_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    gradient_accumulation_steps: int,
    normalize_constant: float = 1.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Masked NLL of one microbatch, scaled for gradient accumulation; calls backward(). With
    policy_log_probs and response_mask (B, T): loss = mean_i(-sum_t log p_it mask_it /
    normalize_constant) / gradient_accumulation_steps."""
    # (B,)
    nll_per_sequence = -masked_normalize(
        policy_log_probs, response_mask, normalize_constant, dim=-1
    )
    loss = nll_per_sequence.mean() / gradient_accumulation_steps
    loss.backward()
    return loss, {"nll_per_sequence": nll_per_sequence.detach()}


def sft_batch_train_step(
    policy,
    tokenizer,
    batch: list[dict],
    microbatch_size: int,
    max_seq_len: int,
    autocast,
    entropy: bool = False,
) -> dict:
    """Accumulate the gradient of one batch's mean NLL per response token over microbatches, each
    rank's rows, summed. batch: {"prompt", "response"}, responses ending in EOS. Returns loss,
    entropy_sum (or 0), n_response_tokens."""
    tokenized = tokenize_prompt_and_output(
        [p["prompt"] for p in batch], [p["response"] for p in batch], tokenizer
    )
    # (B, T), over-long examples cut
    tokenized = {k: v[:, : max_seq_len - 1] for k, v in tokenized.items()}
    lengths, device = tokenized["response_mask"].sum(-1).tolist(), next(policy.parameters()).device
    # every W-th example; alone, all of them, in order
    mine = list(range(RANK, len(batch), WORLD_SIZE))
    # this rank's loss and entropy sum, on the device: no sync per microbatch
    sums = torch.zeros(2, device=device)
    for start in range(0, len(mine), microbatch_size):
        micro = {
            k: v[mine[start : start + microbatch_size]].to(device) for k, v in tokenized.items()
        }
        with autocast:
            out = get_response_log_probs(
                policy, micro["input_ids"], micro["labels"], return_token_entropy=entropy
            )
        # Every response token of the batch weighs 1 / n_response_tokens, whatever microbatch or
        # rank it falls in.
        normalize_constant, accumulation = (
            sum(lengths) / len(batch),
            len(batch) / len(micro["labels"]),
        )
        loss, _ = sft_microbatch_train_step(
            out["log_probs"], micro["response_mask"], accumulation, normalize_constant
        )
        sums[0] += loss.detach()
        if entropy:
            sums[1] += masked_normalize(out["token_entropy"], micro["response_mask"], 1.0)
    sum_over_ranks(policy, sums)
    return {
        "loss": sums[0].item(),
        "entropy_sum": sums[1].item(),
        "n_response_tokens": sum(lengths),
    }


def main(args: Args) -> Path:
    args = restore_args(args)  # --resume: the stopped run's arguments
    task = data.load_task(args, train=False)  # a bad spec stops here, before the engine starts
    keep = (
        (lambda p: verifiers.score(p["response"], p["example"])["reward"] == 1)
        if args.filter_correct
        else None
    )
    pairs = data.sft_pairs(task, args.sft_file, args.n_examples, args.seed, keep)
    if len(pairs) < args.batch_size:
        raise ValueError(
            f"{len(pairs)} training examples is fewer than one batch of {args.batch_size}"
        )
    # --- PLUMBING: ranks, run folder, devices, engine, seeds, policy (the same steps in every script) ---
    # under torchrun: every rank an engine, a trainer, a share of each batch
    init_distributed(args.rank_timeout_s)
    run_dir = make_run_dir(args)
    policy_device, vllm_device, memory_fraction, reload_tol = resolve_devices(args)
    model_path = str(checkpoints(run_dir)[-1]) if checkpoints(run_dir) else args.model
    print(
        f"run folder {run_dir}; trainer on {policy_device}, vLLM on {vllm_device}; starting from {model_path}"
    )
    # an eval prompt + response; the 400-token probes
    max_model_len = max(args.max_seq_len, 512) + args.eval_max_tokens
    llm = init_vllm(model_path, vllm_device, args.seed, memory_fraction, max_model_len)
    task.tokenizer = tokenizer = AutoTokenizer.from_pretrained(model_path)
    policy, autocast = load_policy(
        model_path, policy_device, args.gradient_checkpointing, args.seed
    )

    # --- Data, optimizer, resume ---
    # the model must learn to stop
    pairs = [{**p, "response": p["response"] + tokenizer.eos_token} for p in pairs]
    tokens = lambda key: [
        len(ids)
        for ids in tokenizer([p[key] for p in pairs], add_special_tokens=False)["input_ids"]
    ]
    n_cut = sum(
        a + b > args.max_seq_len for a, b in zip(tokens("prompt"), tokens("response"), strict=True)
    )
    print(
        f"{len(pairs)} training examples; {n_cut} longer than {args.max_seq_len} tokens will be cut at the end"
    )
    probe_prompts = make_probe_prompts(tokenizer, [p["prompt"] + p["response"] for p in pairs[:8]])
    n_steps = args.n_epochs * (len(pairs) // args.batch_size)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    scheduler = get_cosine_schedule_with_warmup(
        optimizer, math.ceil(args.warmup_ratio * n_steps), n_steps
    )
    start_step = resume_from(run_dir, optimizer, scheduler)
    log = make_logger(run_dir, args)
    evaluator, evaluation = ThreadPoolExecutor(max_workers=1), None
    background = (
        vllm_device != policy_device if args.eval_in_background is None else args.eval_in_background
    )
    # off under torchrun: two threads' collectives, in another order per rank, deadlock
    background &= WORLD_SIZE == 1

    # in the background, a frozen copy of the policy
    def reload_and_evaluate(policy, step: int) -> tuple[dict, int]:
        # (+6.8 GB for Qwen3-1.7B fp32)
        gap = reload_and_check(policy, llm, probe_prompts, vllm_device, reload_tol)
        metrics = evaluate(llm, policy, tokenizer, task, args, vllm_device, run_dir, step)
        return {**metrics, "reload/logprob_gap": gap}, step

    # returns the evaluation left in flight: in the background, this one
    def start_evaluation(step: int):
        if evaluation:  # the engine keeps step s's weights until its evaluation is done
            log(*evaluation.result())
        future = evaluator.submit(
            reload_and_evaluate, copy.deepcopy(policy) if background else policy, step
        )
        return future if background else log(*future.result())

    if start_step == 0:
        evaluation = start_evaluation(0)
    else:
        # the engine follows the checkpoint
        reload_and_check(policy, llm, probe_prompts, vllm_device, reload_tol)

    # --- ALGORITHM: one optimizer step per batch of `batch_size` examples ---
    for step in range(start_step, n_steps):
        step_done, t0 = step + 1, time.time()
        batch = [pairs[i] for i in data.batch_order(len(pairs), args.batch_size, args.seed, step)]
        out = sft_batch_train_step(
            policy, tokenizer, batch, args.microbatch_size, args.max_seq_len, autocast
        )
        grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), args.max_grad_norm).item()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        metrics = {
            "train/loss": out["loss"],
            "train/grad_norm": grad_norm,
            "train/lr": scheduler.get_last_lr()[0],
            "train/response_tokens": out["n_response_tokens"],
            "time/step": time.time() - t0,
        }
        print(
            f"step {step_done:5d}/{n_steps} | loss {out['loss']:.4f} | grad norm {grad_norm:.3f} | "
            f"lr {metrics['train/lr']:.2e} | {metrics['time/step']:.2f} s"
        )
        log(metrics, step_done)
        if step_done % args.eval_every == 0 or step_done == n_steps:
            evaluation = start_evaluation(step_done)
        if step_done % args.save_every == 0 or step_done == n_steps:
            save_checkpoint(
                run_dir, step_done, policy, tokenizer, optimizer, scheduler, args.keep_checkpoints
            )
    if evaluation:
        log(*evaluation.result())
    return run_dir


# --- PLUMBING: the vLLM engine, weight reloads, evaluation (same in sft.py, expert_iter.py, grpo.py, distill.py) ---


def engine_device(device: str):
    """Run engine calls with the engine's GPU current: vLLM uses the ambient CUDA device
    (docs/gpu.md)."""
    return torch.cuda.device(device) if device.startswith("cuda") else contextlib.nullcontext()


def init_vllm(
    model: str, device: str, seed: int, gpu_memory_utilization: float, max_model_len: int
) -> LLM:
    """A vLLM engine in this process (reload_weights then takes the trainer's tensors directly) on
    "cpu" or "cuda:N"; processed_logprobs: a sampled token's log-prob after temperature, as it was
    sampled."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    common = dict(
        model=model,
        seed=seed,
        max_model_len=max_model_len,
        enable_prefix_caching=True,
        logprobs_mode="processed_logprobs",
    )
    if device == "cpu":
        # float32: log-probs match the trainer's; eager: no ~40 s compile; a 1 GiB KV cache, not
        # half the RAM. No chunked prefill: vLLM then rewinds seeded generators, which fails on CPU
        # ("CPU Generator does not use offset")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        return LLM(**common, dtype="float32", enforce_eager=True, enable_chunked_prefill=False)
    # device_ids places the engine; the memory share is of that whole GPU
    gpu = torch.device(device).index or 0
    return LLM(
        **common, dtype="bfloat16", device_ids=[gpu], gpu_memory_utilization=gpu_memory_utilization
    )


def load_policy_into_vllm(policy, llm: LLM, device: str) -> None:
    """Copy the trainer's weights into the running engine and drop its prefix cache (computed with
    the OLD weights). state_dict(), not named_parameters(): that one leaves out the tied
    lm_head.weight, which would stay stale."""
    with engine_device(device):
        weights = [
            (name, t.detach().to(llm.llm_engine.model_config.dtype))
            for name, t in policy.state_dict().items()
        ]
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        if not llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache after a weight reload")


def make_probe_prompts(tokenizer, texts: list[str], n_tokens: int = 400) -> list[list[int]]:
    """Two fixed prompts for the reload check, long: a prefix cache reuses only full blocks (128
    tokens on CPU)."""
    # surely long enough
    ids = tokenizer("\n\n".join(texts), add_special_tokens=False)["input_ids"] * (2 * n_tokens)
    return [ids[:n_tokens], ids[n_tokens : 2 * n_tokens]]


def weights_that_differ(policy, llm: LLM, device: str) -> list[str]:
    """The engine's weights that differ, bit for bit, from the trainer's in the engine's dtype
    (every 64th row; a fused weight stacks the trainer's parts): exact in bf16 too. On CPU, linear
    weights live in oneDNN (empty): skipped."""
    fused = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    state, rows = policy.state_dict(), lambda t: t if t.dim() == 1 else t[::64]
    with engine_device(device):
        (engine,) = llm.apply_model(
            lambda model: {n: rows(p.detach()).cpu() for n, p in model.named_parameters()}
        )
    differ = []
    for name, tensor in engine.items():
        module = name.split(".")[-2]  # model.layers.0.self_attn.qkv_proj.weight -> qkv_proj
        trainer = torch.cat(
            [state[name.replace(module, part)] for part in fused.get(module, (module,))]
        )
        if tensor.numel() and not torch.equal(tensor, rows(trainer).to(tensor.dtype).cpu()):
            differ.append(name)
    return differ


def probe_gap(
    policy, llm: LLM, probe_prompts: list[list[int]], device: str, n_tokens: int = 16
) -> float:
    """The engine continues each probe greedily, the trainer scores the same tokens: the worse
    prompt's median |log-prob gap| (a near-tie in bf16 must not stop a run). Generated: prompt
    log-probs skip the prefix cache."""
    params = SamplingParams(temperature=0.0, max_tokens=n_tokens, logprobs=0, ignore_eos=True)
    with engine_device(device):
        outputs = llm.generate(
            [{"prompt_token_ids": p} for p in probe_prompts], params, use_tqdm=False
        )
    gaps = []
    for prompt, output in zip(probe_prompts, outputs, strict=True):
        ids, logprobs = list(output.outputs[0].token_ids), output.outputs[0].logprobs
        full = torch.tensor([prompt + ids], device=next(policy.parameters()).device)  # (1, L)
        with torch.no_grad():
            trainer = get_response_log_probs(policy, full[:, :-1], full[:, 1:])["log_probs"][
                0, -len(ids) :
            ]
        engine = torch.tensor([lp[t].logprob for lp, t in zip(logprobs, ids, strict=True)])
        gaps.append((engine - trainer.float().cpu()).abs().median().item())
    return max(gaps)


def reload_and_check(
    policy, llm: LLM, probe_prompts: list[list[int]], device: str, tol: float
) -> float:
    """Copy the trainer's weights into the engine and prove it follows them, or raise: the weights
    read back equal the trainer's, and the probe's gap is within tol (~1e-6 in float32); a warning
    above tol / 10. Returns the gap."""
    load_policy_into_vllm(policy, llm, device)
    differ, gap = (
        weights_that_differ(policy, llm, device),
        probe_gap(policy, llm, probe_prompts, device),
    )
    if differ or not gap <= tol:
        raise RuntimeError(
            f"vLLM does not follow the trainer after a weight reload: engine weights that differ "
            f"{differ}, median |log-prob gap| {gap:.3g} (stop above {tol:.3g})"
        )
    if gap > tol / 10:
        warnings.warn(
            f"engine/trainer log-prob gap {gap:.3g} after a reload (stop above {tol:.3g})",
            stacklevel=2,
        )
    return gap


def evaluate(
    llm: LLM, policy, tokenizer, task: data.Task, args, vllm_device: str, run_dir: Path, step: int
):
    """Greedy responses to every eval example, scored: metrics per dataset and in all; a few to
    generations.jsonl."""
    # gathered below
    t0, examples = time.time(), my_share([ex for name in task.names for ex in task.evals[name]])
    # stop strings stay in the output: the verifier reads them
    prompts = [task.prompt(ex) for ex in examples]
    params = [
        SamplingParams(
            temperature=0.0,
            max_tokens=args.eval_max_tokens,
            stop=task.stop(ex),
            include_stop_str_in_output=True,
        )
        for ex in examples
    ]
    with engine_device(vllm_device):
        completions = [output.outputs[0] for output in llm.generate(prompts, params, use_tqdm=True)]
    # code: programs run in a pool
    rewards = verifiers.score_batch([c.text for c in completions], examples)
    records = [
        {
            "dataset": ex["dataset"],
            "id": ex["id"],
            "prompt": prompt,
            "response": c.text,
            "answer": ex["answer"],
            "reward": reward,
            "n_tokens": len(c.token_ids),
            "truncated": c.finish_reason == "length",
        }
        for ex, prompt, c, reward in zip(examples, prompts, completions, rewards, strict=True)
    ]
    records = gather(records)
    sample_metrics, samples = log_generations(policy, tokenizer, records[: args.n_log_generations])
    append_jsonl(run_dir / "generations.jsonl", [{"step": step, **sample} for sample in samples])
    metrics = data.eval_metrics(records)
    print(
        f"step {step:5d} | eval accuracy {metrics['eval/accuracy']:.3f} format {metrics['eval/format_rate']:.3f}"
    )
    return {**metrics, **sample_metrics, "time/eval": time.time() - t0}


def log_generations(policy, tokenizer, records: list[dict]) -> tuple[dict, list[dict]]:
    """The trainer's mean token entropy over each record's response: (metrics, records with
    "mean_token_entropy"). None, not NaN, without records: strict JSON. (data.eval_metrics has the
    lengths, over all the records.)"""
    out = []
    for record in records:
        batch = tokenize_prompt_and_output([record["prompt"]], [record["response"]], tokenizer)
        batch = {k: v.to(policy.device) for k, v in batch.items()}
        with torch.no_grad():
            entropy = get_response_log_probs(policy, batch["input_ids"], batch["labels"], True)[
                "token_entropy"
            ]
        n_tokens = max(batch["response_mask"].sum().item(), 1)
        out.append(
            {
                **record,
                "mean_token_entropy": masked_normalize(
                    entropy, batch["response_mask"], n_tokens
                ).item(),
            }
        )
    return {
        "eval/sample_token_entropy": float(np.mean([r["mean_token_entropy"] for r in out]))
        if out
        else None
    }, out


# --- PLUMBING: run folder, devices, checkpoints, logs, ranks (same in sft.py, expert_iter.py, grpo.py, distill.py) ---

# torchrun's; alone: 0 of 1
RANK, WORLD_SIZE = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
# under torchrun: a gloo group, and how long a rank waits in it for the others (docs/distributed.md)
RANKS = {}
# Arguments a resumed run may change: where it runs and what it logs, not what it computes.
RESUME_MAY_CHANGE = {
    "resume",
    "output_dir",
    "track",
    "wandb_project",
    "policy_device",
    "vllm_device",
    "vllm_gpu_memory_utilization",
    "gradient_checkpointing",
    "keep_checkpoints",
    "reload_tol",
    "rank_timeout_s",
}


def restore_args(args):
    """With --resume: the stopped run's arguments. A non-default one that differs is refused, unless
    it may change."""
    if not args.resume:
        return args
    saved, defaults = json.loads((Path(args.resume) / "args.json").read_text()), type(args)()
    given = {k: v for k, v in asdict(args).items() if v != getattr(defaults, k)}
    conflicts = [
        f"--{k.replace('_', '-')} {v!r} (the run has {saved[k]!r})"
        for k, v in given.items()
        if k in saved and saved[k] != v and k not in RESUME_MAY_CHANGE
    ]
    if conflicts:
        raise ValueError(
            f"--resume {args.resume} continues a run with other arguments: {', '.join(conflicts)}"
        )
    return replace(
        args,
        **{k: v for k, v in saved.items() if k in defaults.__dataclass_fields__ and k not in given},
    )


def make_run_dir(args) -> Path:
    """runs/<exp_name>__<seed>__<unix time> (rank 0's time), or the folder being resumed, with
    args.json in it."""
    name = f"{args.exp_name}__{args.seed}__{int(time.time())}"
    run_dir = Path(args.resume or Path(args.output_dir) / gather([name])[0])
    if RANK == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "args.json").write_text(json.dumps(asdict(args), indent=2))
    return run_dir


def resolve_devices(args) -> tuple[str, str, float, float]:
    """(trainer's device, engine's, the engine's share of its GPU, reload tolerance). The node's
    GPUs are dealt out to its ranks (one process: one rank), k each: with k >= 2 a rank's trainer
    takes its first, its engine the second; with k = 1 they share it; with none, both are on the
    CPU, in float32. "cuda" is "cuda:0", so that they compare."""
    canonical = lambda d: str(
        torch.device(d.type, d.index or 0) if (d := torch.device(d)).type == "cuda" else d
    )
    # torchrun sets LOCAL_*
    k = torch.cuda.device_count() // int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    first = int(os.environ.get("LOCAL_RANK", 0)) * k
    policy_device = canonical(args.policy_device or (f"cuda:{first}" if k else "cpu"))
    vllm_device = canonical(args.vllm_device or (f"cuda:{first + 1}" if k > 1 else policy_device))
    # None: the defaults; 0 is a value
    memory, tol = args.vllm_gpu_memory_utilization, args.reload_tol
    memory = (0.3 if vllm_device == policy_device else 0.85) if memory is None else memory
    return (
        policy_device,
        vllm_device,
        memory,
        (1e-3 if vllm_device == "cpu" else 0.5) if tol is None else tol,
    )


def load_policy(model_path: str, device: str, gradient_checkpointing: bool, seed: int):
    """Seed, make the trainer's GPU current (the engine set its own), load in float32, train mode:
    (model, autocast)."""
    torch.manual_seed(seed)
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    policy = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(device)
    # from_pretrained returns eval mode, in which gradient checkpointing is silently off
    policy.train()
    if gradient_checkpointing:
        policy.gradient_checkpointing_enable()
    return policy, torch.autocast("cuda", torch.bfloat16) if device.startswith(
        "cuda"
    ) else contextlib.nullcontext()


def checkpoints(run_dir: Path) -> list[Path]:
    """A run folder's complete checkpoints, oldest first (step_N.tmp, one being written, is not
    one)."""
    return sorted(
        p for p in (run_dir / "checkpoints").glob("step_*") if not p.name.endswith(".tmp")
    )


def save_checkpoint(
    run_dir: Path, step: int, policy, tokenizer, optimizer, scheduler, keep: int
) -> None:
    """checkpoints/step_N: a Hugging Face model folder and trainer_state.pt (no RNG state: all that
    is random derives from (seed, step)), written as step_N.tmp then renamed: a kill mid-save loses
    nothing. Keeps the newest `keep`."""
    if RANK:  # the ranks' weights are the same
        return
    final = run_dir / "checkpoints" / f"step_{step:06d}"
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    policy.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    state = {"step": step, "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}
    torch.save(state, tmp / "trainer_state.pt")
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    for old in checkpoints(run_dir)[:-keep] if keep else []:
        shutil.rmtree(old)


def resume_from(run_dir: Path, optimizer, scheduler, *record_files: str) -> int:
    """Restore the newest checkpoint's optimizer and scheduler, return its step (0 without one).
    Records written after it are dropped (by rename: a crash leaves the file whole)."""
    if not checkpoints(run_dir):
        return 0
    state = torch.load(checkpoints(run_dir)[-1] / "trainer_state.pt", weights_only=False)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    for path in [run_dir / name for name in ("metrics.jsonl", "generations.jsonl", *record_files)]:
        if path.exists() and RANK == 0:
            kept = [
                line
                for line in path.read_text().splitlines(True)
                if json.loads(line)["step"] <= state["step"]
            ]
            path.with_name(path.name + ".tmp").write_text("".join(kept))
            os.replace(path.with_name(path.name + ".tmp"), path)
    print(f"resumed from {checkpoints(run_dir)[-1]} after step {state['step']}")
    return state["step"]


def append_jsonl(path: Path, records: list[dict], allow_nan: bool = True) -> None:
    # rank 0 writes what every rank gathered
    with open(path if RANK == 0 else os.devnull, "a") as f:
        f.writelines(json.dumps(record, allow_nan=allow_nan) + "\n" for record in records)


def make_logger(run_dir: Path, args):
    """log(metrics, step) appends to metrics.jsonl (NaN as null: strict JSON) and W&B (--track):
    rank 0, for all."""
    if args.track and RANK == 0:
        import wandb

        wandb.init(
            project=args.wandb_project, name=run_dir.name, config=asdict(args), resume="allow"
        )

    def log(metrics: dict, step: int) -> None:
        metrics = {
            k: None if isinstance(v, float) and not math.isfinite(v) else v
            for k, v in metrics.items()
        }
        # a nested NaN: raise
        append_jsonl(run_dir / "metrics.jsonl", [{"step": step, **metrics}], allow_nan=False)
        if args.track and RANK == 0:
            wandb.log(metrics, step=step)

    return log


def init_distributed(timeout_s: float) -> None:
    """Under torchrun: join the ranks (NCCL on GPUs, else gloo) before the engine starts, else it
    makes a world of its own, and make the gloo group now, while all are here (a collective too).
    Rank 0 prints."""
    if WORLD_SIZE > 1:
        timeout = datetime.timedelta(seconds=timeout_s)
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", timeout=timeout)
        RANKS.update(group=dist.new_group(backend="gloo", timeout=timeout), timeout=timeout)
        sys.stdout = sys.stdout if RANK == 0 else open(os.devnull, "w")


def my_share(items: list) -> list:
    """This rank's contiguous share of a list every rank holds."""
    return items[RANK * len(items) // WORLD_SIZE : (RANK + 1) * len(items) // WORLD_SIZE]


def gather(items: list) -> list:
    """Every rank's list, concatenated in rank order, after a monitored_barrier (it names a rank
    that does not come)."""
    if not RANKS:
        return items
    dist.monitored_barrier(RANKS["group"], RANKS["timeout"])
    parts = [None] * WORLD_SIZE
    dist.all_gather_object(parts, items, group=RANKS["group"])
    return [item for part in parts for item in part]


def sum_over_ranks(model, *tensors: torch.Tensor) -> None:
    """Sum the gradients and these tensors over the ranks, in place: DDP's all-reduce by hand
    (docs/distributed.md)."""
    if RANKS:
        dist.monitored_barrier(RANKS["group"], RANKS["timeout"])
        for p in model.parameters():
            # a rank with no rows in this minibatch
            p.grad = torch.zeros_like(p) if p.grad is None else p.grad
        for tensor in [p.grad for p in model.parameters()] + list(tensors):
            dist.all_reduce(tensor)


if __name__ == "__main__":
    main(tyro.cli(Args))
