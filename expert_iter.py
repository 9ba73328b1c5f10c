"""Expert iteration: sample answers from the policy, keep those the verifier accepts, fine-tune on
them, repeat.

Each expert-iteration (EI) step draws `n_questions` training questions, samples `group_size`
responses to each from a vLLM engine holding the trainer's current weights, keeps those
verifiers.score accepts (each distinct response once per question), and runs `n_sft_epochs` passes
of SFT over them: sft.py's loss. The policy is its own "expert", the verifier the filter: rejection
sampling plus maximum likelihood, no advantage, no ratio, no KL. Known as STaR, rejection-sampling
fine-tuning and ReST-EM (docs/background.md); this follows CS336 assignment 5's version, from an SFT
checkpoint. Writes kept.jsonl (every response trained on: an sft.py --sft-file) beside
metrics.jsonl.

Deliberate simplifications: (1) each step fine-tunes the current policy on this step's kept
responses only, as CS336 does (STaR and ReST-EM restart from the base model and train on everything
gathered so far: a fork of phase 4); (2) the filter is binary (reward == 1) and removes exact
duplicates only: no cap per question, no STaR "rationalization" (hinting the answer of a question
never solved); (3) one AdamW for the whole run, its learning rate constant after the warmup: the
optimizer steps per EI step depend on how many responses pass, so a decay would have no known end;
(4) every kept response is trained on in every epoch: an epoch's last batch is usually short (unlike
sft.py's); (5) a response is trained on as text, the engine's plus EOS, re-tokenized as sft.py does;
(6) more GPUs means data parallel, as in sft.py (torchrun: each rank a whole model, an engine, a
share of the questions and of each batch).

Usage:
    python expert_iter.py --model runs/sft__1__1763700000/checkpoints/step_000200    # GSM8K, r1_zero, 2 GPUs
    python expert_iter.py --resume runs/expert_iter__1__1763700000        # continue a stopped run where it stopped
    python expert_iter.py --dataset gsm8k:0.25,math:0.25,mbpp:0.25,ifeval:0.25 --data-dir ../shared/data \\
        --dataset-templates ifeval=question                                # a mixture of tasks: docs/tasks.md
  No GPU: ladder.py runs tiny model -> SFT -> expert iteration; its expert-iteration stage alone
  (~15 s a step):
    python expert_iter.py --model runs/ladder__1__*/sft__*/checkpoints/step_000625 --dataset synthetic \\
        --template question --n-ei-steps 10 --n-questions 256 --group-size 4 --max-tokens 64
        --eval-max-tokens 64 \\ --lr 1e-4 --warmup-steps 5 --batch-size 32 --microbatch-size 32
        --max-seq-len 160 --n-eval 256
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
    # seed for the questions and sampling seeds of each step, the SFT data order and the engine
    seed: int = 1
    output_dir: str = "runs"  # where run folders are made
    resume: str | None = None  # a run folder to continue from its last checkpoint
    track: bool = False  # also log to Weights & Biases (pip install wandb)
    wandb_project: str = "rlvr-expert-iter"  # the W&B project, with --track
    # --- model ---
    model: str = "Qwen/Qwen3-1.7B-Base"  # Hugging Face name or folder (an sft.py checkpoint)
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
    # prompt template from data.py (r1_zero | question | chat) for sampling and evaluation
    template: str = "r1_zero"
    # e.g. ifeval=question: another template for a dataset
    dataset_templates: list[str] = field(default_factory=list)
    # e.g. mbpp=order.txt: a dataset's questions in a file's order
    curriculum: list[str] = field(default_factory=list)
    # longest prompt + response trained on, in tokens; longer ones are cut at the end
    max_seq_len: int = 1536
    # --- expert iteration ---
    n_ei_steps: int = 5  # expert-iteration steps: each samples, filters and fine-tunes once
    # training questions sampled per step (without replacement within a step)
    n_questions: int = 512
    group_size: int = 8  # responses sampled per question
    n_sft_epochs: int = 1  # passes over each step's kept responses
    # sampling temperature (0 would make the group_size responses one response)
    temperature: float = 1.0
    # nucleus sampling: keep the smallest set of tokens with this much probability
    top_p: float = 1.0
    max_tokens: int = 1024  # max new tokens per sampled response
    # --- optim ---
    lr: float = 2e-5  # learning rate of AdamW after warmup (constant)
    weight_decay: float = 0.0  # AdamW weight decay
    # optimizer steps (counted over the whole run) of linear warmup from 0 to --lr
    warmup_steps: int = 10
    # kept responses per optimizer step (the last batch of an epoch may be smaller)
    batch_size: int = 32
    # responses per forward/backward pass; the passes of a batch accumulate gradients
    microbatch_size: int = 2
    max_grad_norm: float = 1.0  # clip the gradient's global L2 norm to this
    # --- eval ---
    eval_split: str = "val"  # val (or test where there is none) | test
    n_eval: int = 256  # problems evaluated per dataset, greedy, from the start of its eval split
    eval_every: int = 1  # evaluate every this many EI steps (and at the start and the end)
    eval_max_tokens: int = 1024  # max new tokens per evaluation response
    n_log_generations: int = 4  # evaluation responses to generations.jsonl
    save_every: int = 1  # checkpoint every this many EI steps (and at the end)
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


# --- ALGORITHM: the expert-iteration filter ---


def select_correct(
    examples: list[dict], prompts: list[str], responses: list[list[str]], rewards: list[list[float]]
) -> list[dict]:
    """The SFT data of one EI step: the responses the verifier accepted (reward == 1), each distinct
    text once per question, as {"prompt", "response", "example"} dicts (sft.py's pairs), in question
    order, then sample order. examples, prompts: Q questions; responses, rewards: Q lists of G.
    Deduplicated, or a question the policy always answers the same way would weigh G times as much
    as a hard one solved once, pushing toward what it already does."""
    kept = []
    for example, prompt, group, group_rewards in zip(
        examples, prompts, responses, rewards, strict=True
    ):
        correct = [
            response for response, reward in zip(group, group_rewards, strict=True) if reward == 1.0
        ]
        kept += [
            {"prompt": prompt, "response": response, "example": example}
            for response in dict.fromkeys(correct)
        ]
    return kept


def main(args: Args) -> Path:
    args = restore_args(args)  # --resume: the stopped run's arguments
    if args.group_size > 1 and args.temperature == 0:
        raise ValueError(
            f"group_size={args.group_size} greedy samples would be one response; set --temperature"
        )
    # a bad spec stops here, before the engine starts
    task = data.load_task(args, n_questions=args.n_questions)
    # --- PLUMBING: ranks, run folder, devices, engine, seeds, policy (the same steps in every script) ---
    # under torchrun: every rank an engine, a trainer, a share of the questions
    init_distributed(args.rank_timeout_s)
    run_dir = make_run_dir(args)
    policy_device, vllm_device, memory_fraction, reload_tol = resolve_devices(args)
    model_path = str(checkpoints(run_dir)[-1]) if checkpoints(run_dir) else args.model
    print(
        f"run folder {run_dir}; trainer on {policy_device}, vLLM on {vllm_device}; starting from {model_path}"
    )
    # The engine's context must hold a prompt and its response, and the 400-token reload probes.
    max_model_len = max(args.max_seq_len, 512) + max(args.max_tokens, args.eval_max_tokens)
    llm = init_vllm(model_path, vllm_device, args.seed, memory_fraction, max_model_len)
    task.tokenizer = tokenizer = AutoTokenizer.from_pretrained(model_path)
    policy, autocast = load_policy(
        model_path, policy_device, args.gradient_checkpointing, args.seed
    )

    # --- Optimizer, resume ---
    probe_prompts = make_probe_prompts(
        tokenizer, [task.prompt(ex) + task.response(ex) for ex in task.train[:8]]
    )
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    scheduler = get_constant_schedule_with_warmup(optimizer, args.warmup_steps)
    start_step = resume_from(run_dir, optimizer, scheduler, "kept.jsonl")
    log = make_logger(run_dir, args)
    # the engine follows from step 0 on
    gap = reload_and_check(policy, llm, probe_prompts, vllm_device, reload_tol)
    if start_step == 0:
        log(
            evaluate(llm, policy, tokenizer, task, args, vllm_device, run_dir, 0)
            | {"reload/eval_logprob_gap": gap},
            0,
        )

    # --- ALGORITHM: the EI loop, one step = reload, sample, filter, fine-tune, (evaluate), save ---
    for step in range(start_step, args.n_ei_steps):
        step_done, t_step = step + 1, time.time()
        # 1. Put the trainer's current weights into the engine: the samples must come from the
        # policy being trained.
        gap = reload_and_check(policy, llm, probe_prompts, vllm_device, reload_tol)
        time_reload, t0 = time.time() - t_step, time.time()

        # 2. Sample group_size responses to each of this step's questions.
        examples, seeds = task.questions(args.n_questions, args.group_size, args.seed, step)
        prompts = [task.prompt(ex) for ex in examples]
        params = [
            SamplingParams(
                n=args.group_size,
                temperature=args.temperature,
                top_p=args.top_p,
                seed=seed,
                max_tokens=args.max_tokens,
                stop=task.stop(ex),
                include_stop_str_in_output=True,
            )
            for ex, seed in zip(examples, seeds, strict=True)
        ]
        # each rank its share of the questions; all are gathered below
        with engine_device(vllm_device):
            mine = [
                output.outputs
                for output in llm.generate(my_share(prompts), my_share(params), use_tqdm=True)
            ]
        time_generate, t0 = time.time() - t0, time.time()

        # 3. Score every response in one batch (code runs in a pool of processes, one per core),
        # keep the correct ones.
        texts = [c.text for group in mine for c in group]
        flat = iter(
            verifiers.score_batch(
                texts, [ex for ex in my_share(examples) for _ in range(args.group_size)]
            )
        )
        scores = gather([[next(flat) for _ in group] for group in mine])  # (Q, G) reward dicts
        completions = gather(mine)  # Q lists of G, every rank all of them
        rewards = [[s["reward"] for s in group] for group in scores]  # (Q, G)
        kept = select_correct(
            examples, prompts, [[c.text for c in group] for group in completions], rewards
        )
        # --sft-file
        append_jsonl(
            run_dir / "kept.jsonl", [{"step": step_done, **data.sft_row(**p)} for p in kept]
        )
        n_tokens = {
            (examples[q]["id"], c.text): len(c.token_ids)
            for q, group in enumerate(completions)
            for c in group
        }
        # as generated, EOS excluded
        kept_lengths = [n_tokens[p["example"]["id"], p["response"]] for p in kept]
        samples = [c for group in completions for c in group]  # (Q G,)
        metrics = {
            "rollout/frac_solved": float(np.mean([max(group) == 1.0 for group in rewards])),
            "rollout/accuracy": float(np.mean(rewards)),
            "rollout/n_correct": int(np.sum(rewards)),
            "rollout/format_rate": float(
                np.mean([[s["format_reward"] for s in group] for group in scores])
            ),
            "rollout/response_length": float(np.mean([len(c.token_ids) for c in samples])),
            "rollout/truncation_rate": float(
                np.mean([c.finish_reason == "length" for c in samples])
            ),
            "rollout/n_kept": len(kept),
            "rollout/kept_length": float(np.mean(kept_lengths or np.nan)),
            "reload/logprob_gap": gap,
            "time/reload": time_reload,
            "time/generate": time_generate,
            "time/score": time.time() - t0,
            **task.rollout_metrics(examples, rewards),
        }

        # 4. Fine-tune on the kept responses: n_sft_epochs passes, a fresh order per (seed, step,
        # epoch).
        t0 = time.time()
        # the model must learn to stop
        pairs = [{**p, "response": p["response"] + tokenizer.eos_token} for p in kept]
        losses, grad_norms, entropy_sum, n_response_tokens = [], [], 0.0, 0
        for epoch in range(args.n_sft_epochs):
            order = np.random.default_rng([args.seed, step, epoch]).permutation(len(pairs))
            for start in range(0, len(pairs), args.batch_size):
                batch = [pairs[i] for i in order[start : start + args.batch_size]]
                # Entropy in the first epoch only: each kept response is seen exactly once there.
                out = sft_batch_train_step(
                    policy,
                    tokenizer,
                    batch,
                    args.microbatch_size,
                    args.max_seq_len,
                    autocast,
                    entropy=epoch == 0,
                )
                grad_norms.append(
                    torch.nn.utils.clip_grad_norm_(policy.parameters(), args.max_grad_norm).item()
                )
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                losses.append(out["loss"])
                entropy_sum += out["entropy_sum"]
                n_response_tokens += out["n_response_tokens"] if epoch == 0 else 0
        # the mean of the batches' mean NLL per token
        metrics |= {
            "train/loss": float(np.mean(losses or math.nan)),
            "train/entropy": entropy_sum / n_response_tokens if n_response_tokens else math.nan,
            "train/grad_norm": float(np.mean(grad_norms or math.nan)),
            "train/lr": scheduler.get_last_lr()[0],
            # an epoch's, EOS too
            "train/n_updates": len(losses),
            "train/response_tokens": n_response_tokens,
            "time/train": time.time() - t0,
        }

        # 5. Evaluate (reloading first: the engine still holds the weights from before this step's
        # updates), log, save.
        if step_done % args.eval_every == 0 or step_done == args.n_ei_steps:
            metrics["reload/eval_logprob_gap"] = reload_and_check(
                policy, llm, probe_prompts, vllm_device, reload_tol
            )
            metrics |= evaluate(llm, policy, tokenizer, task, args, vllm_device, run_dir, step_done)
        log({**metrics, "time/step": time.time() - t_step}, step_done)
        print(
            f"ei step {step_done:3d}/{args.n_ei_steps} | solved {metrics['rollout/frac_solved']:.3f} | "
            f"kept {len(kept)} | loss {metrics['train/loss']:.4f} | entropy {metrics['train/entropy']:.3f} | "
            f"kept length {metrics['rollout/kept_length']:.0f} | reload gap {gap:.1e} | "
            f"generate {time_generate:.1f} s train {metrics['time/train']:.1f} s"
        )
        if not kept:
            print(
                f"  step {step_done}: no response passed the verifier, nothing to train on. Does the model write the "
                "answer format (rollout/format_rate) within max_tokens (rollout/truncation_rate)?"
            )
        if step_done % args.save_every == 0 or step_done == args.n_ei_steps:
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
