"""On-policy distillation (Agarwal et al. 2024, arXiv:2306.13649; Qwen3's small models), grpo.py
with another advantage: the student lowers its reverse KL(p || q) to a teacher q on its own samples,
with no verifier needed. Each step:
  1. sample `rollout_batch_size / group_size` questions and let the engine write `group_size`
  responses to each;
  2. the teacher grades every sampled token o_t: log q(o_t | prompt, o_<t), one forward pass per
  response;
  3. per-token advantage A_t = -(log p(o_t) - log q(o_t)), detached: minus the sampled reverse-KL
  estimate (what the
     teacher likes more than the student is pushed up); --reward-weight w adds w x grpo.py's
     advantage;
  4. minimise -A_t log p(o_t), one mean over the batch's tokens: as E_p[grad log p] = 0, its
  gradient is the reverse
     KL's, E_p[(log p - log q) grad log p]; one optimizer step per rollout batch (no ratio, no
     clipping);
  5. copy the new weights into the engine and *prove* it now samples from them (reload_and_check).
Simplifications: generation and training take turns (more GPUs: docs/distributed.md); the KL is
estimated on the sampled token, not over the vocabulary, at each position alone (no credit to later
tokens); one tokenizer for both.

Usage:
    python distill.py --model runs/sft__1__<time>/checkpoints/step_000217 --teacher Qwen/Qwen3-8B   # 2 GPUs
    python distill.py --model ... --teacher ... --reward-weight 1.0      # the teacher's grades plus the verifier's
"""

import contextlib
import datetime
import json
import math
import os
import shutil
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field, replace
from itertools import pairwise
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import tyro
from transformers import AutoModelForCausalLM, AutoTokenizer, get_constant_schedule_with_warmup
from vllm import LLM, SamplingParams

import data
import verifiers


@dataclass
class Args:
    # --- run ---
    # runs/<exp_name>__<seed>__<unix time>
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    seed: int = 1  # seed for the questions drawn and the engine's sampling
    output_dir: str = "runs"  # where run folders are made
    # a run folder to continue from its last checkpoint, with its own arguments
    resume: str | None = None
    track: bool = False  # also log to Weights & Biases (pip install wandb)
    wandb_project: str = "rlvr-distill"  # the W&B project, with --track
    # --- model ---
    # the student: Hugging Face name or folder (an SFT checkpoint)
    model: str = "Qwen/Qwen3-1.7B-Base"
    teacher: str = "Qwen/Qwen3-8B"  # the teacher: any causal LM with the student's tokenizer
    # device of the trainer; None: this rank's first GPU, else cpu (resolve_devices)
    policy_device: str | None = None
    # device of the vLLM engine; None: this rank's second GPU, else the trainer's
    vllm_device: str | None = None
    # the engine's share of its GPU; None: 0.85 alone, 0.3 shared
    vllm_gpu_memory_utilization: float | None = None
    # recompute activations in the backward pass: less memory, about 30% more time
    gradient_checkpointing: bool = False
    # --- data ---
    # gsm8k | math | mbpp | ifeval | synthetic, or a mixture: gsm8k:0.5,math:0.5
    dataset: str = "gsm8k"
    data_dir: str | None = None  # data root, one folder per dataset (../shared/data); None: the hub
    template: str = "r1_zero"  # r1_zero | question | chat (data.py)
    # e.g. ifeval=question: another template for a dataset
    dataset_templates: list[str] = field(default_factory=list)
    # steps; each one generates a rollout batch, trains on it and reloads the engine
    n_distill_steps: int = 200
    rollout_batch_size: int = 256  # responses per step: / group_size questions
    # responses per question (at least 2 with --reward-weight: the group is the baseline)
    group_size: int = 4
    # sampling temperature; student and teacher divide their logits by it alike
    temperature: float = 1.0
    max_tokens: int = 1024  # max new tokens per response
    # --- optim ---
    lr: float = 1e-5  # peak learning rate of AdamW (reached after the warmup)
    # AdamW weight decay (torch's default, 0.01, would pull even a perfect student away)
    weight_decay: float = 0.0
    warmup_steps: int = 0  # steps over which the learning rate rises linearly from 0, then stays
    microbatch_size: int = 2  # examples per forward/backward pass (gradients accumulate)
    max_grad_norm: float = 1.0  # clip the gradient's global L2 norm to this
    # w: add w x the verifier's group-normalised reward to every token's advantage
    reward_weight: float = 0.0
    # --- eval ---
    eval_split: str = "val"  # val (or test where there is none) | test
    n_eval: int = 512  # problems evaluated per dataset, greedy, from the start of its eval split
    eval_every: int = 10  # evaluate every this many steps (and at the start and the end)
    eval_max_tokens: int = 1024  # max new tokens per evaluation response
    n_log_generations: int = 4  # evaluation responses to generations.jsonl
    save_every: int = 50  # checkpoint every this many steps (and at the end)
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


# --- ALGORITHM: the advantage and loss (pure: tests/test_distill.py checks them by hand), the update, the teacher ---


def group_normalized_rewards(
    raw_rewards: torch.Tensor, group_size: int, eps: float = 1e-6
) -> torch.Tensor:
    """(r - mean(group)) / (std(group) + eps) of each response's reward, groups of group_size in a
    row: (B,) -> (B,)."""
    grouped = raw_rewards.view(-1, group_size)  # (n_groups, G)
    return (
        (grouped - grouped.mean(dim=1, keepdim=True)) / (grouped.std(dim=1, keepdim=True) + eps)
    ).reshape(-1)


def compute_distill_advantages(
    policy_log_probs: torch.Tensor,
    teacher_log_probs: torch.Tensor,
    reward_advantages: torch.Tensor | None = None,
    reward_weight: float = 0.0,
):
    """A_t = -(log p(o_t) - log q(o_t)) + reward_weight A_reward, detached: the sampled tokens'
    log-probs (B, T) under student p and teacher q, reward_advantages (B,) -> (B, T). The first
    term: minus the sampled reverse KL."""
    reward_term = reward_weight * reward_advantages.reshape(-1, 1) if reward_weight else 0.0
    return -(policy_log_probs - teacher_log_probs).detach() + reward_term


def distill_microbatch_train_step(
    policy_log_probs: torch.Tensor,
    teacher_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    n_batch_tokens: int,
    reward_advantages: torch.Tensor | None = None,
    reward_weight: float = 0.0,
) -> tuple:
    """This microbatch's share of the batch loss sum_t -A_t log p(o_t) / n_batch_tokens (one mean
    over the batch's response tokens, however split); calls backward(). (B, T) in; the loss and log
    p - log q (B, T) out."""
    advantages = compute_distill_advantages(
        policy_log_probs, teacher_log_probs, reward_advantages, reward_weight
    )
    loss = masked_normalize(-advantages * policy_log_probs, response_mask, n_batch_tokens)
    loss.backward()
    return loss.detach(), (policy_log_probs - teacher_log_probs).detach()


def microbatches(tensors: dict, rows: list[int], lengths: list[int], size: int, device: str):
    """Yields (rows, their tensors on `device`) in microbatches of `size`, by length: each cut to
    its longest row."""
    rows = sorted(rows, key=lambda i: lengths[i])
    for chunk in (rows[i : i + size] for i in range(0, len(rows), size)):
        width = max(lengths[i] for i in chunk)
        yield chunk, {k: v[torch.tensor(chunk), :width].to(device) for k, v in tensors.items()}


def frozen_log_probs(
    model,
    batch: dict,
    lengths: list[int],
    rows: list[int],
    microbatch_size: int,
    temperature: float,
) -> torch.Tensor:
    """log p of each label in these rows of a padded batch (n, T) under a frozen model; the other
    rows' stay 0."""
    device = next(model.parameters()).device
    autocast = (
        torch.autocast("cuda", dtype=torch.bfloat16)
        if device.type == "cuda"
        else contextlib.nullcontext()
    )
    log_probs = torch.zeros(batch["labels"].shape, device=device)  # (n, T)
    for chunk, micro in microbatches(batch, rows, lengths, microbatch_size, str(device)):
        with torch.no_grad(), autocast:
            out = get_response_log_probs(
                model, micro["input_ids"], micro["labels"], False, temperature
            )
        log_probs[chunk, : micro["labels"].shape[1]] = out["log_probs"].float()
    return log_probs


def update_student(
    policy,
    teacher,
    optimizer,
    scheduler,
    batch: dict,
    lengths: list[int],
    args: Args,
    step: int,
    autocast,
) -> dict:
    """One optimizer step on a rollout batch (input_ids, labels, response_mask (n, T);
    reward_advantages (n,)): each rank its rows, the gradients summed over ranks; a non-finite
    update is skipped. Returns the update's metrics."""
    # (n,); the rest of the batch is (n, T)
    reward_advantages = batch.pop("reward_advantages").to(policy.device)
    # this rank's rows, by length
    mine = sorted(range(len(lengths)), key=lambda i: lengths[i])[RANK::WORLD_SIZE]
    # The teacher's grade log q of this rank's sampled tokens, once, before the update.  (n, T); 0
    # in the other rows
    batch["graded"] = frozen_log_probs(
        teacher, batch, lengths, mine, args.microbatch_size, args.temperature
    )
    # all ranks' tokens
    n_tokens, sums = int(batch["response_mask"].sum()), torch.zeros(3, device=policy.device)
    for rows, micro in microbatches(batch, mine, lengths, args.microbatch_size, str(policy.device)):
        with autocast:
            out = get_response_log_probs(
                policy, micro["input_ids"], micro["labels"], True, args.temperature
            )
        mask = micro["response_mask"]  # on the device: no host sync per microbatch
        loss, reverse_kl = distill_microbatch_train_step(
            out["log_probs"],
            micro["graded"],
            mask,
            n_tokens,
            reward_advantages[rows],
            args.reward_weight,
        )
        # over tokens
        sums += torch.stack([loss, (reverse_kl * mask).sum(), (out["token_entropy"] * mask).sum()])
    sum_over_ranks(policy, sums)
    grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), args.max_grad_norm)
    # the update's one sync
    loss, reverse_kl, entropy, grad_norm = torch.cat([sums, grad_norm.reshape(1)]).tolist()
    if updated := math.isfinite(loss) and math.isfinite(grad_norm):
        optimizer.step()
    else:
        warnings.warn(
            f"step {step + 1}: loss {loss} or gradient norm {grad_norm} is not finite; skipped",
            stacklevel=2,
        )
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return {
        "train/loss": loss,
        "train/grad_norm": grad_norm,
        "train/entropy": entropy / n_tokens,
        "rollout/reverse_kl": reverse_kl / n_tokens,
        "train/updated": updated,
    }


def check_student_and_teacher(args: Args) -> None:
    """Refuse inconsistent arguments, a missing teacher, or one whose vocabulary is not the
    student's, before anything loads: a grade of token id k means something only if both models mean
    the same token by k."""
    if args.rollout_batch_size % args.group_size or (args.reward_weight and args.group_size < 2):
        raise ValueError(
            "rollout_batch_size must be a multiple of group_size, and --reward-weight needs groups of 2+"
        )
    looks_local = args.teacher.startswith((".", "/", "~")) or args.teacher.count("/") > 1
    if looks_local and not (Path(args.teacher).expanduser() / "config.json").is_file():
        raise ValueError(f"--teacher {args.teacher}: no model folder there (no config.json)")
    student, teacher = (
        AutoTokenizer.from_pretrained(args.model),
        AutoTokenizer.from_pretrained(args.teacher),
    )
    if student.get_vocab() != teacher.get_vocab():
        raise ValueError(
            f"--teacher {args.teacher} has another vocabulary ({len(teacher)} tokens) than {args.model} "
            f"({len(student)}): a grade per token needs the same tokens"
        )


def held_out_reverse_kl(
    llm: LLM, policy, teacher, task: data.Task, args: Args, vllm_device: str
) -> dict:
    """Reverse KL(student || teacher) per token on the eval prompts, a response each sampled as in
    training (unbiased; greedy is not) with the same seed each time: a change is the student's.
    Whole on every rank: the same number."""
    examples = [ex for name in task.names for ex in task.evals[name]]
    params = [
        SamplingParams(
            temperature=args.temperature,
            max_tokens=args.eval_max_tokens,
            stop=task.stop(ex),
            include_stop_str_in_output=True,
            seed=args.seed,
        )
        for ex in examples
    ]
    with engine_device(vllm_device):
        outputs = llm.generate([task.prompt(ex) for ex in examples], params, use_tqdm=False)
    batch = collate_token_ids(
        [o.prompt_token_ids for o in outputs], [o.outputs[0].token_ids for o in outputs], 0
    )
    lengths = [len(o.prompt_token_ids) + len(o.outputs[0].token_ids) - 1 for o in outputs]
    log_p, log_q = (
        frozen_log_probs(
            m, batch, lengths, [*range(len(lengths))], args.microbatch_size, args.temperature
        )
        for m in (policy, teacher)
    )
    mask = batch["response_mask"].to(log_p.device)
    return {
        "eval/reverse_kl": masked_normalize(log_p - log_q, mask, max(mask.sum().item(), 1)).item()
    }


def main(args: Args) -> Path:
    args = restore_args(args)  # --resume: the stopped run's arguments
    check_student_and_teacher(args)
    n_prompts = args.rollout_batch_size // args.group_size
    # a bad spec stops here, before the engine starts
    task = data.load_task(args, n_questions=n_prompts)
    # --- PLUMBING: ranks, run folder, devices, engine, seeds, policy (the same steps in every script) ---
    # under torchrun: every rank an engine, a trainer, a share of the questions
    init_distributed(args.rank_timeout_s)
    run_dir = make_run_dir(args)
    policy_device, vllm_device, memory_fraction, reload_tol = resolve_devices(args)
    model_path = str(checkpoints(run_dir)[-1]) if checkpoints(run_dir) else args.model
    print(
        f"run folder {run_dir}; trainer on {policy_device}, vLLM on {vllm_device}; starting from {model_path}"
    )
    task.tokenizer = tokenizer = AutoTokenizer.from_pretrained(model_path)
    # The engine's context must hold a prompt and its response, and the 400-token reload probes plus
    # 16 tokens.
    max_model_len = max(task.longest_prompt(), 400) + max(args.max_tokens, args.eval_max_tokens, 16)
    llm = init_vllm(model_path, vllm_device, args.seed, memory_fraction, max_model_len)
    policy, autocast = load_policy(
        model_path, policy_device, args.gradient_checkpointing, args.seed
    )
    # The teacher beside the student, frozen, bf16 on a GPU: a grade is one forward pass (a second
    # engine: more memory)
    dtype = torch.bfloat16 if policy_device.startswith("cuda") else torch.float32
    teacher = (
        AutoModelForCausalLM.from_pretrained(args.teacher, dtype=dtype)
        .to(policy_device)
        .requires_grad_(False)
    )
    sampling = dict(
        n=args.group_size,
        temperature=args.temperature,
        max_tokens=args.max_tokens,
        include_stop_str_in_output=True,
    )
    probe_prompts = make_probe_prompts(
        tokenizer, [task.prompt(ex) + ex["solution"] for ex in task.train[:8]]
    )

    # --- Optimizer and resume ---
    optimizer = torch.optim.AdamW(
        policy.parameters(), lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.95)
    )
    scheduler = get_constant_schedule_with_warmup(optimizer, args.warmup_steps)
    start_step = resume_from(run_dir, optimizer, scheduler)
    log = make_logger(run_dir, args)
    # the engine follows from step 0 on
    gap = reload_and_check(policy, llm, probe_prompts, vllm_device, reload_tol)
    if start_step == 0:
        log(
            {
                **evaluate(llm, policy, tokenizer, task, args, vllm_device, run_dir, 0),
                "reload/logprob_gap": gap,
                **held_out_reverse_kl(llm, policy, teacher, task, args, vllm_device),
            },
            0,
        )

    # --- ALGORITHM: the distillation loop ---
    for step in range(start_step, args.n_distill_steps):
        # when each phase ended: time/<phase> is the time from the previous end
        ends = {"start": time.time()}
        # --- 1. Generate and score (the reward: logged; in the advantage with --reward-weight); each rank its share ---
        examples, seeds = task.questions(n_prompts, args.group_size, args.seed, step)
        params = [
            SamplingParams(**sampling, stop=task.stop(ex), seed=s)
            for ex, s in zip(examples, seeds, strict=True)
        ]
        with engine_device(vllm_device):
            outputs = llm.generate(
                my_share([task.prompt(ex) for ex in examples]), my_share(params), use_tqdm=False
            )
        ends["generate"], truths = (
            time.time(),
            [ex for ex in my_share(examples) for _ in range(args.group_size)],
        )
        scores = gather(
            verifiers.score_batch([c.text for output in outputs for c in output.outputs], truths)
        )
        outputs = gather(outputs)
        # Flattened, group by group: responses j * G ... j * G + G - 1 answer question j.  (B,)
        # lists, B = n_prompts G
        completions = [c for output in outputs for c in output.outputs]
        prompt_ids = [list(output.prompt_token_ids) for output in outputs for _ in output.outputs]
        raw_rewards = torch.tensor([s["reward"] for s in scores], dtype=torch.float32)  # (B,)
        ends["score"] = time.time()

        # --- 2. Update: the teacher grades every sampled token, then one optimizer step toward it ---
        # the pad is masked out
        batch = collate_token_ids(prompt_ids, [c.token_ids for c in completions], 0)
        batch["reward_advantages"] = group_normalized_rewards(raw_rewards, args.group_size)  # (B,)
        # unpadded
        lengths = [
            len(p) + len(c.token_ids) - 1 for p, c in zip(prompt_ids, completions, strict=True)
        ]
        metrics = update_student(
            policy, teacher, optimizer, scheduler, batch, lengths, args, step, autocast
        )
        ends["train"] = time.time()

        # --- 3. Reload the new weights into the engine, and prove it follows them (also after a skipped update) ---
        metrics["reload/logprob_gap"] = reload_and_check(
            policy, llm, probe_prompts, vllm_device, reload_tol
        )
        ends["reload"] = time.time()

        # --- 4. Log, evaluate, save ---
        step_done = step + 1
        metrics.update(
            {
                "rollout/reward_mean": raw_rewards.mean().item(),
                "train/lr": scheduler.get_last_lr()[0],
                "rollout/response_length": float(np.mean([len(c.token_ids) for c in completions])),
                "rollout/truncation_rate": float(
                    np.mean([c.finish_reason == "length" for c in completions])
                ),
                **{f"time/{phase}": ends[phase] - ends[prev] for prev, phase in pairwise(ends)},
            }
        )
        metrics.update(
            task.rollout_metrics(examples, raw_rewards.view(-1, args.group_size).tolist())
        )
        if step_done % args.eval_every == 0 or step_done == args.n_distill_steps:
            metrics.update(
                evaluate(llm, policy, tokenizer, task, args, vllm_device, run_dir, step_done)
            )
            metrics.update(held_out_reverse_kl(llm, policy, teacher, task, args, vllm_device))
        metrics["time/step"] = time.time() - ends["start"]
        log(metrics, step_done)
        print(
            f"step {step_done:5d}/{args.n_distill_steps} | reverse KL {metrics['rollout/reverse_kl']:.4f} | "
            f"reward {metrics['rollout/reward_mean']:.3f} | {metrics['time/step']:.1f} s"
        )
        if step_done % args.save_every == 0 or step_done == args.n_distill_steps:
            save_checkpoint(
                run_dir, step_done, policy, tokenizer, optimizer, scheduler, args.keep_checkpoints
            )
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
