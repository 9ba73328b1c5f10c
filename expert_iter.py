"""Expert iteration: sample answers from the policy, keep those the verifier accepts, fine-tune on them, repeat.

Each expert-iteration (EI) step draws `n_questions` training questions, samples `group_size` responses to each
from a vLLM engine that holds the trainer's current weights, scores every response with verifiers.score, keeps
the correct ones (each distinct response once per question), and runs `n_sft_epochs` passes of SFT over them:
the same loss as sft.py. The policy is its own "expert", the verifier the filter: rejection sampling plus maximum
likelihood, no advantage, no ratio, no KL. Known as STaR, rejection-sampling fine-tuning and ReST-EM (README:
"Background and citations"); this file follows CS336 assignment 5's version: start from an SFT checkpoint
(sft.py), and study questions per step, group size and SFT epochs per step. As in sft.py, the trainer copies its
weights into the engine before every sampling phase and evaluation, and a probe proves the engine follows them.

Deliberate simplifications:
1. Each step fine-tunes the current policy on this step's kept responses only, as CS336 does. STaR and ReST-EM
   restart from the base model every iteration and train on everything gathered so far (a fork of phase 4).
2. The filter is binary (reward == 1) and only removes exact duplicates: no cap on responses per question
   (ReST-EM keeps at most 10), no STaR "rationalization" (hinting the answer for questions never solved).
3. One AdamW and one learning-rate schedule for the whole run, as in CS336 (a fresh optimizer per step is one line:
   build it inside the loop). Constant after the warmup: the number of optimizer steps per EI step depends on how
   many responses pass, so a decay would have no known end.
4. Every kept response is trained on in every epoch: the last batch of an epoch is usually short (unlike sft.py's).
5. A response is trained on as text, the engine's text plus EOS, re-tokenized as sft.py does. One that stopped at a
   stop string ("</answer>") learns to end there; one cut off by max_tokens is kept if correct.
6. One trainer process, no data or model parallelism (as sft.py).

Outputs besides metrics.jsonl and checkpoints: kept.jsonl, every response trained on, by step (a valid --sft-file
for sft.py), and generations.jsonl, a few evaluation responses per evaluation.

Usage:
    python expert_iter.py --model runs/sft__1__1763700000/checkpoints/step_000200    # GSM8K, r1_zero, 2 GPUs
    python expert_iter.py --model runs/sft__1__1763700000/checkpoints/step_000200 --dataset synthetic \\
        --n-ei-steps 3 --n-questions 64 --group-size 4 --max-tokens 64 --eval-max-tokens 64 --n-eval 64 \\
        --batch-size 16 --microbatch-size 8 --lr 1e-4 --warmup-steps 0 --max-seq-len 256   # CPU, tiny model
    python expert_iter.py --resume runs/expert_iter__1__1763700000        # continue a stopped run where it stopped
    python expert_iter.py --dataset gsm8k:0.25,math:0.25,mbpp:0.25,ifeval:0.25 --data-dir ../shared/data \
        --dataset-templates ifeval=question                                # a mixture of tasks: README "Mixtures"
The CPU line starts from the tiny model fine-tuned by `python sft.py --model runs/tiny-qwen3 --dataset synthetic
--batch-size 16 --microbatch-size 8 --lr 1e-3 --n-examples 3200 --max-seq-len 256` (about 3% accuracy, so EI keeps
only a few responses a step: it shows the loop, not learning); about 1.5 minutes on 2 cores.
"""

import contextlib
import json
import math
import os
import random
import shutil
import time
import warnings
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
import tyro
from transformers import AutoModelForCausalLM, AutoTokenizer, get_constant_schedule_with_warmup
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

import data
import verifiers


@dataclass
class Args:
    # --- run ---
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """name of this experiment; the run folder is runs/<exp_name>__<seed>__<unix time>"""
    seed: int = 1
    """seed for the questions and sampling seeds of each step, the SFT data order and the engine"""
    output_dir: str = "runs"
    """where run folders are made"""
    resume: str | None = None
    """a run folder to continue from its last checkpoint (the other arguments should match the original run's)"""
    track: bool = False
    """also log to Weights & Biases (pip install wandb)"""
    wandb_project: str = "rlvr-expert-iter"
    """the W&B project, with --track"""

    # --- model ---
    model: str = "Qwen/Qwen3-1.7B-Base"
    """Hugging Face model name or local model folder to start from (usually an sft.py checkpoint)"""
    policy_device: str | None = None
    """device of the trainer; None: cuda:0 if there is a GPU, else cpu"""
    vllm_device: str | None = None
    """device of the vLLM engine; None: cuda:1 with two GPUs, else the policy's device"""
    vllm_gpu_memory_utilization: float | None = None
    """fraction of the engine GPU's memory vLLM may take; None: 0.85 alone on its GPU, 0.3 beside the trainer"""
    gradient_checkpointing: bool = False
    """recompute activations in the backward pass: less memory, about 30% more time"""

    # --- data ---
    dataset: str = "gsm8k"
    """gsm8k | math | mbpp | ifeval | synthetic, or a mixture with weights, gsm8k:0.25,math:0.25,mbpp:0.25,ifeval:0.25:
    each question's dataset is drawn by weight; questions come from the train splits, evaluation from --eval-split"""
    data_dir: str | None = None
    """data root with one folder per dataset (e.g. ../shared/data: gsm8k/, math/, ...); None: the Hugging Face hub"""
    template: str = "r1_zero"
    """prompt template from data.py (r1_zero | question | chat) for sampling and evaluation"""
    dataset_templates: list[str] = field(default_factory=list)
    """a template for some datasets of the mixture instead of --template, e.g. ifeval=question"""
    curriculum: list[str] = field(default_factory=list)
    """order files (one example id a line) for some datasets, e.g. mbpp=order.txt: their questions come in that order"""
    max_seq_len: int = 1536
    """longest prompt + response trained on, in tokens; longer ones are cut at the end"""

    # --- expert iteration ---
    n_ei_steps: int = 5
    """expert-iteration steps: each samples, filters and fine-tunes once"""
    n_questions: int = 512
    """training questions sampled per step (without replacement within a step)"""
    group_size: int = 8
    """responses sampled per question"""
    n_sft_epochs: int = 1
    """passes over each step's kept responses"""
    temperature: float = 1.0
    """sampling temperature (0 would make the group_size responses one response)"""
    top_p: float = 1.0
    """nucleus sampling: keep the smallest set of tokens with this much probability"""
    max_tokens: int = 1024
    """max new tokens per sampled response"""

    # --- optim ---
    lr: float = 2e-5
    """learning rate of AdamW after warmup (constant)"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    warmup_steps: int = 10
    """optimizer steps (counted over the whole run) of linear warmup from 0 to --lr"""
    batch_size: int = 32
    """kept responses per optimizer step (the last batch of an epoch may be smaller)"""
    microbatch_size: int = 2
    """responses per forward/backward pass; the passes of a batch accumulate gradients"""
    max_grad_norm: float = 1.0
    """clip the gradient's global L2 norm to this"""

    # --- eval ---
    eval_split: str = "val"
    """split each dataset is evaluated on; val falls back to test where a dataset has none (MATH, IFEval)"""
    n_eval: int = 256
    """problems evaluated per dataset, greedy, from the start of its eval split"""
    eval_every: int = 1
    """evaluate every this many EI steps (and at the start and the end)"""
    eval_max_tokens: int = 1024
    """max new tokens per evaluation response"""
    n_log_generations: int = 4
    """evaluation responses written to generations.jsonl (with entropy and length) at each evaluation"""
    save_every: int = 1
    """checkpoint every this many EI steps (and at the end); --resume restarts after the last saved step"""
    keep_checkpoints: int = 2
    """keep only the newest this many checkpoints (Qwen3-1.7B: ~20.6 GB each); 0 keeps all"""
    reload_tol: float | None = None
    """largest mean |log-prob gap| between engine and trainer allowed after a reload; None: 1e-3 in float32 (CPU),
    in bfloat16 4 x the gap measured at the start (at least 0.05); README: Your first GPU run"""


# --- ALGORITHM, CS336 vocabulary: tokenizing and log-probs (same in sft.py, expert_iter.py and grpo.py) ---


def tokenize_prompt_and_output(prompt_strs: list[str], output_strs: list[str], tokenizer) -> dict[str, torch.Tensor]:
    """Tokenize prompts and outputs separately, concatenate, pad, and shift for next-token prediction: input_ids,
    labels and response_mask, each (B, max_len - 1); response_mask is 1 exactly where the label is an output token.
    Built from lengths, never by comparing ids with the pad id: when pad == EOS (Qwen3 base models), that would hide
    the EOS the model must learn to emit."""
    prompt_ids = tokenizer(prompt_strs, add_special_tokens=False)["input_ids"]
    output_ids = tokenizer(output_strs, add_special_tokens=False)["input_ids"]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    pad_id = pad_id if pad_id is not None else 0
    max_len = max(len(p) + len(o) for p, o in zip(prompt_ids, output_ids, strict=True))
    full = torch.full((len(prompt_ids), max_len), pad_id, dtype=torch.long)  # (B, L)
    is_output = torch.zeros((len(prompt_ids), max_len), dtype=torch.bool)  # (B, L)
    for i, (p, o) in enumerate(zip(prompt_ids, output_ids, strict=True)):
        full[i, : len(p) + len(o)] = torch.tensor(p + o, dtype=torch.long)
        is_output[i, len(p) : len(p) + len(o)] = True
    return {"input_ids": full[:, :-1], "labels": full[:, 1:], "response_mask": is_output[:, 1:]}


def compute_entropy(logits: torch.Tensor, chunk_size: int = 1024) -> torch.Tensor:
    """Entropy of the next-token distribution at each position: (B, T, V) logits -> (B, T).
    H = -sum p log p = logsumexp(z) - sum softmax(z) z, which never takes the log of an underflowed probability.
    chunk_size positions at a time: softmax(z) and softmax(z) z of all B T positions at once would be two more
    (B, T, V) float32 tensors at the peak (1.2 GiB each for 2 x 1,024 positions of Qwen3's 151,936 tokens)."""
    flat = logits.reshape(-1, logits.shape[-1])  # (B T, V)
    chunks = [torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(dim=-1) for z in flat.split(chunk_size)]
    return torch.cat(chunks).reshape(logits.shape[:-1])


def get_response_log_probs(
    model, input_ids: torch.Tensor, labels: torch.Tensor, return_token_entropy: bool = False, temperature: float = 1.0
) -> dict[str, torch.Tensor]:
    """log p(labels[t] | input_ids[:t+1]) for every position: (B, T) ids -> {"log_probs": (B, T)}, and with
    return_token_entropy "token_entropy" (B, T). The logits are divided by `temperature` first, as the engine does
    when it samples, so the log-probs are of the distribution sampled from (grpo.py needs this; SFT uses 1)."""
    logits = model(input_ids).logits.float()  # (B, T, V); float32 even under bf16 autocast
    if temperature != 1.0:  # not at T = 1: another (B, T, V) float32 copy, for nothing
        logits = logits / temperature
    log_probs = torch.log_softmax(logits, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)  # (B, T)
    out = {"log_probs": log_probs}
    if return_token_entropy:
        with torch.no_grad():
            out["token_entropy"] = compute_entropy(logits)
    return out


def masked_normalize(
    tensor: torch.Tensor, mask: torch.Tensor, normalize_constant: float, dim: int | None = None
) -> torch.Tensor:
    """Sum of `tensor` where mask is 1, over `dim` (all dims if None), divided by normalize_constant."""
    masked = tensor * mask
    total = masked.sum() if dim is None else masked.sum(dim=dim)
    return total / normalize_constant


# --- ALGORITHM: the SFT loss (same in sft.py and expert_iter.py) ---


def sft_microbatch_train_step(
    policy_log_probs: torch.Tensor, response_mask: torch.Tensor, gradient_accumulation_steps: int,
    normalize_constant: float = 1.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:  # fmt: skip
    """Masked NLL of one microbatch, scaled for gradient accumulation; calls backward(). With policy_log_probs and
    response_mask (B, T): loss = mean_i(-sum_t log p_it mask_it / normalize_constant) / gradient_accumulation_steps."""
    nll_per_sequence = -masked_normalize(policy_log_probs, response_mask, normalize_constant, dim=-1)  # (B,)
    loss = nll_per_sequence.mean() / gradient_accumulation_steps
    loss.backward()
    return loss, {"nll_per_sequence": nll_per_sequence.detach()}


def sft_batch_train_step(
    policy, tokenizer, batch: list[dict], microbatch_size: int, max_seq_len: int, autocast, entropy: bool = False
) -> dict:
    """Accumulate the gradient of one batch's loss, the mean NLL per response token, over its microbatches (the last
    may be short); the caller steps the optimizer. batch: {"prompt", "response"} dicts, each response ending in EOS.
    Returns "loss", "n_response_tokens" and, with entropy, "entropy_sum" (the summed next-token entropy)."""
    tokenized = tokenize_prompt_and_output([p["prompt"] for p in batch], [p["response"] for p in batch], tokenizer)
    tokenized = {k: v[:, : max_seq_len - 1] for k, v in tokenized.items()}  # (B, T), over-long examples cut
    n_response_tokens = tokenized["response_mask"].sum().item()
    device = next(policy.parameters()).device
    loss_sum, entropy_sum = 0.0, 0.0
    for start in range(0, len(batch), microbatch_size):
        micro = {k: v[start : start + microbatch_size].to(device) for k, v in tokenized.items()}
        with autocast:
            out = get_response_log_probs(policy, micro["input_ids"], micro["labels"], return_token_entropy=entropy)
        # (response tokens / sequences) of the batch, and its share of the batch: every response token of the batch
        # weighs 1 / n_response_tokens, whatever microbatch it falls in.
        normalize_constant, accumulation = n_response_tokens / len(batch), len(batch) / len(micro["labels"])
        loss, _ = sft_microbatch_train_step(out["log_probs"], micro["response_mask"], accumulation, normalize_constant)
        loss_sum += loss.item()
        if entropy:
            entropy_sum += masked_normalize(out["token_entropy"], micro["response_mask"], 1.0).item()
    result = {"loss": loss_sum, "n_response_tokens": n_response_tokens}
    return {**result, "entropy_sum": entropy_sum} if entropy else result


# --- ALGORITHM: the expert-iteration filter ---


def select_correct(
    examples: list[dict], prompts: list[str], responses: list[list[str]], rewards: list[list[float]]
) -> list[dict]:
    """The SFT data of one EI step: the responses the verifier accepted (reward == 1), each distinct text once per
    question, as {"prompt", "response", "example"} dicts (sft.py's pairs), in question order, then sample order.
    examples, prompts: Q questions; responses, rewards: Q lists of G. Deduplicated, or a question the policy always
    answers the same way would weigh G times as much as a hard one solved once, pushing toward what it already does."""
    kept = []
    for example, prompt, group, group_rewards in zip(examples, prompts, responses, rewards, strict=True):
        seen = set()
        for response, reward in zip(group, group_rewards, strict=True):
            if reward == 1.0 and response not in seen:
                seen.add(response)
                kept.append({"prompt": prompt, "response": response, "example": example})
    return kept


# --- ALGORITHM: the questions of a step (same in expert_iter.py and grpo.py) ---


def step_questions_and_seeds(sizes: list[int], weights: list[float], orders: list, n_prompts: int, group_size: int,
                             seed: int, step: int) -> tuple[list[int], list[int]]:  # fmt: skip
    """The questions of step `step` (indices into the train examples of all datasets, one dataset after another) and
    the engine's sampling seed for each: data.mixture_questions_and_seeds, each question's dataset drawn by weight.
    Derived from (seed, step) alone, so a resumed run draws and samples exactly what an uninterrupted run would.
    vLLM gives the n samples of a request the seeds s, s + 1, ..., s + n - 1: requests are spaced group_size apart,
    or two questions would share a random stream."""
    picks, seeds = data.mixture_questions_and_seeds(sizes, weights, n_prompts, group_size, seed, step, orders)
    starts = np.cumsum([0, *sizes]).tolist()  # where each dataset's examples begin
    return [starts[d] + i for d, i in picks], seeds


def rollout_metrics_by_dataset(names: list[str], examples: list[dict], rewards: list[list[float]]) -> dict:
    """Per task: rollout/<dataset>/count (questions drawn this step) and rollout/<dataset>/reward_mean (over their
    responses; NaN, logged as null, when none was drawn). examples: Q questions, rewards: Q lists of G."""
    metrics = {}
    for name in names:
        drawn = [group for ex, group in zip(examples, rewards, strict=True) if ex["dataset"] == name]
        metrics[f"rollout/{name}/count"] = len(drawn)
        metrics[f"rollout/{name}/reward_mean"] = float(np.mean(drawn)) if drawn else math.nan
    return metrics


# --- PLUMBING: the vLLM engine and its weight reloads (same in sft.py, expert_iter.py and grpo.py) ---


def engine_device(device: str):
    """Run engine calls with the engine's GPU as the current CUDA device (vLLM uses the ambient device)."""
    return torch.cuda.device(device) if device.startswith("cuda") else contextlib.nullcontext()


def init_vllm(model: str, device: str, seed: int, gpu_memory_utilization: float, max_model_len: int) -> LLM:
    """Start a vLLM engine inside this process (reload_weights then gets the trainer's tensors directly), on `device`
    ("cpu" or "cuda:N"). It reseeds every RNG: seed after. Prefix caching: a prompt's n samples share its KV cache."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    common = dict(model=model, seed=seed, max_model_len=max_model_len, enable_prefix_caching=True)
    # Sampled tokens' log-probs after temperature/top-p (vLLM's Sampler.sample), the distribution sampled from, not
    # the raw logits' (the default). Per-request seeds keep vLLM 0.32 on its native sampler, which supports this mode.
    common["logprobs_mode"] = "processed_logprobs"
    if device == "cpu":
        # float32: log-probs match the trainer's; eager: no ~40 s compile; a 1 GiB KV cache, not half the RAM. No
        # chunked prefill: vLLM then rewinds seeded generators, which fails on CPU ("CPU Generator does not use offset")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        return LLM(**common, dtype="float32", enforce_eager=True, enable_chunked_prefill=False)
    # vLLM 0.32 places an engine with device_ids; gpu_memory_utilization is a fraction of that GPU's whole memory.
    gpu = torch.device(device).index or 0
    return LLM(**common, dtype="bfloat16", device_ids=[gpu], gpu_memory_utilization=gpu_memory_utilization)


def policy_weights(policy, dtype: torch.dtype) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs a reload sends, cast to the engine's dtype. state_dict(), not named_parameters(): the
    latter drops the tied lm_head.weight, and the engine would keep part of its old weights."""
    return [(name, tensor.detach().to(dtype)) for name, tensor in policy.state_dict().items()]


def load_policy_into_vllm(policy, llm: LLM, device: str) -> None:
    """Copy the trainer's weights into the running engine, in place (vLLM 0.32's reload_weights runs the model's own
    loaders), and drop its prefix cache, or it would reuse keys and values computed with the OLD weights."""
    with engine_device(device):
        weights = policy_weights(policy, llm.llm_engine.model_config.dtype)
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})  # vLLM Worker.reload_weights
        if not llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache after a weight reload")


def make_probe_prompts(tokenizer, texts: list[str], min_tokens: int = 400) -> list[list[int]]:
    """Two fixed token sequences for the reload check, each min_tokens long. Long on purpose: a prefix cache reuses
    only full blocks (128 tokens on CPU, 16 on GPU), so only a prompt of several blocks can reveal stale entries."""
    ids = tokenizer("\n\n".join(texts), add_special_tokens=False)["input_ids"]
    while len(ids) < 2 * min_tokens:
        ids = ids + ids
    return [ids[:min_tokens], ids[min_tokens : 2 * min_tokens]]


# vLLM fuses these projections into one weight, the parts stacked along rows (Qwen3's packed_modules_mapping).
FUSED = [("self_attn", "qkv_proj", ("q_proj", "k_proj", "v_proj")), ("mlp", "gate_up_proj", ("gate_proj", "up_proj"))]


def weights_that_differ(policy, llm: LLM, device: str) -> list[str]:
    """Read small slices of the engine's weights back (3 rows of the embedding and of each part of the fused
    projections, whole norm weights; layers 0 and last) and compare them with the trainer's tensors cast to the
    engine's dtype, bit for bit: the names that differ. Exact in bf16 too, where a log-prob probe drowns in noise."""
    state, dtype, last = policy.state_dict(), llm.llm_engine.model_config.dtype, policy.config.num_hidden_layers - 1
    parts = {name: [name] for name in ("model.embed_tokens.weight", "model.norm.weight")}  # engine name -> trainer's
    for prefix in sorted({f"model.layers.{i}." for i in (0, last)}):
        parts[prefix + "input_layernorm.weight"] = [prefix + "input_layernorm.weight"]
        for module, fused, names in FUSED:
            parts[f"{prefix}{module}.{fused}.weight"] = [f"{prefix}{module}.{n}.weight" for n in names]
    expected, rows = {}, {}
    for name, names in parts.items():
        offset, rows[name], pieces = 0, [], []
        for tensor in (state[n] for n in names):
            if tensor.dim() == 1:  # a norm weight: all of it
                rows[name], pieces = slice(None), [tensor]
                break
            picked = [0, len(tensor) // 2, len(tensor) - 1]
            rows[name] += [offset + r for r in picked]  # the part's rows inside the fused weight
            pieces.append(tensor[picked])
            offset += len(tensor)
        expected[name] = torch.cat(pieces).to(dtype).cpu()

    def read(model):  # runs inside the engine's worker: vLLM's LLM.apply_model
        params = dict(model.named_parameters())
        # On CPU, vLLM's dispatch_cpu_unquantized_gemm(remove_weight=True) packs linear weights into oneDNN and leaves
        # empty parameters: those are skipped; embeddings and norms stay readable.
        return {n: params[n].detach()[r].cpu() for n, r in rows.items() if n in params and params[n].numel()}

    with engine_device(device):
        (engine,) = llm.apply_model(read)
    if not {"model.embed_tokens.weight", "model.norm.weight"} <= set(engine):
        raise RuntimeError(f"could not read the engine's embedding and final norm back; read {sorted(engine)}")
    return [name for name, tensor in engine.items() if not torch.equal(tensor, expected[name])]


def probe_gap(policy, llm: LLM, probe_prompts: list[list[int]], device: str) -> float:
    """The engine continues each probe prompt greedily, the trainer scores the same tokens: the worse of the two mean
    |log-prob differences|. Generated, not teacher-forced: vLLM skips the prefix cache for prompt log-probs
    (SamplingParams.skip_reading_prefix_cache), and stale cache entries are one thing this must catch."""
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=0, ignore_eos=True)
    with engine_device(device):
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in probe_prompts], params, use_tqdm=False)
    gaps, policy_device = [], next(policy.parameters()).device
    for prompt, output in zip(probe_prompts, outputs, strict=True):
        completion = output.outputs[0]
        token_ids = list(completion.token_ids)
        engine_log_probs = torch.tensor([lp[t].logprob for lp, t in zip(completion.logprobs, token_ids, strict=True)])
        full = torch.tensor([prompt + token_ids], device=policy_device)  # (1, L)
        with torch.no_grad():
            log_probs = get_response_log_probs(policy, full[:, :-1], full[:, 1:])["log_probs"]  # (1, L - 1)
        gaps.append((engine_log_probs - log_probs[0, -len(token_ids) :].float().cpu()).abs().mean().item())
    return max(gaps)


def check_vllm_follows_policy(policy, llm: LLM, probe_prompts: list[list[int]], device: str, tol: float) -> float:
    """Prove the engine samples from the trainer's current weights, or raise: the read-back weight slices must equal
    the trainer's exactly (a skipped or partial reload), and the probe's log-prob gap must stay within tol (stale
    prefix cache, a wrong dtype or kernel; in float32 the honest gap is ~1e-6). Returns the gap."""
    differ, gap = weights_that_differ(policy, llm, device), probe_gap(policy, llm, probe_prompts, device)
    if differ or not gap <= tol:
        raise RuntimeError(f"vLLM does not follow the trainer after a weight reload: engine weights that differ "
                           f"{differ}, mean |log-prob gap| {gap:.3g} (stop above {tol:.3g})")  # fmt: skip
    return gap


def check_reload_at_start(
    policy, llm: LLM, probe_prompts: list[list[int]], device: str, tol: float | None
) -> tuple[float, float]:
    """Once, before training. The probe gap now, with the same weights on both sides, is the engine's own noise: the
    baseline. Then zero the engine's weights and reload: a tensor the reload misses stays zero and the check trips.
    Returns the tolerance for every later check (tol, or with tol None (bf16) max(4 x baseline, 0.05)) and the gap
    after the reload: the engine now follows the policy, and step 0 needs no other reload."""
    baseline = probe_gap(policy, llm, probe_prompts, device)
    tol = max(4 * baseline, 0.05) if tol is None else tol
    with engine_device(device):
        llm.collective_rpc("reset_weights")  # vLLM Worker.reset_weights: zero_weights(model), every named parameter
        weights = policy_weights(policy, llm.llm_engine.model_config.dtype)
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        llm.reset_prefix_cache()  # the baseline probe cached keys and values that would hide a missed tensor
    gap = check_vllm_follows_policy(policy, llm, probe_prompts, device, tol)
    print(f"reload check: baseline gap {baseline:.2g}, after zeroing and reloading {gap:.2g}; stops above {tol:.2g}")
    return tol, gap


def reload_and_check(policy, llm: LLM, probe_prompts: list[list[int]], device: str, tol: float) -> float:
    """Copy the trainer's weights into the engine and prove it follows them; returns the probe's log-prob gap."""
    load_policy_into_vllm(policy, llm, device)
    return check_vllm_follows_policy(policy, llm, probe_prompts, device, tol)


# --- PLUMBING: evaluation (same in sft.py, expert_iter.py and grpo.py) ---


def evaluate(llm: LLM, examples: list[dict], prompts: list[str], template: str, max_tokens: int, device: str):
    """Greedy responses from the engine, scored by verifiers.score_batch: (metrics, one record per problem)."""
    stop = data.stop_strings(template) or None  # kept in the output (include_stop_str...): the verifier needs it
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, stop=stop, include_stop_str_in_output=True)
    with engine_device(device):
        outputs = llm.generate(prompts, params, use_tqdm=True)
    completions = [output.outputs[0] for output in outputs]
    rewards = verifiers.score_batch([c.text for c in completions], examples)  # code: programs run in a pool
    records = []
    for example, prompt, completion, reward in zip(examples, prompts, completions, rewards, strict=True):
        records.append(
            {"id": example["id"], "prompt": prompt, "response": completion.text, "answer": example["answer"],
             "reward": reward, "n_tokens": len(completion.token_ids), "truncated": completion.finish_reason == "length"}
        )  # fmt: skip
    return eval_metrics(records), records


def eval_metrics(records: list[dict]) -> dict:
    """The evaluation's means over evaluate's records (of one dataset, or of all the datasets of a mixture)."""
    return {
        "eval/accuracy": float(np.mean([r["reward"]["reward"] for r in records])),
        "eval/format_rate": float(np.mean([r["reward"]["format_reward"] for r in records])),
        "eval/response_length": float(np.mean([r["n_tokens"] for r in records])),
        "eval/truncation_rate": float(np.mean([r["truncated"] for r in records])),
    }


def log_generations(policy, tokenizer, records: list[dict], policy_device: str) -> tuple[dict, list[dict]]:
    """For a few evaluation records: the trainer's mean token entropy over each response, and length statistics.
    Returns metrics and the records with "mean_token_entropy" added, for generations.jsonl."""
    out = []
    for record in records:
        batch = tokenize_prompt_and_output([record["prompt"]], [record["response"]], tokenizer)
        batch = {k: v.to(policy_device) for k, v in batch.items()}
        with torch.no_grad():
            entropy = get_response_log_probs(policy, batch["input_ids"], batch["labels"], True)["token_entropy"]
        mask = batch["response_mask"]
        mean_entropy = masked_normalize(entropy, mask, max(mask.sum().item(), 1)).item()
        out.append({**record, "mean_token_entropy": mean_entropy})
    length = lambda correct: mean_or_none([r["n_tokens"] for r in out if (r["reward"]["reward"] == 1) == correct])
    mean_or_none = lambda xs: float(np.mean(xs)) if xs else None  # None, not NaN: metrics.jsonl stays strict JSON
    metrics = {
        "eval/sample_token_entropy": mean_or_none([r["mean_token_entropy"] for r in out]),
        "eval/sample_length": mean_or_none([r["n_tokens"] for r in out]),
        "eval/sample_length_correct": length(True),
        "eval/sample_length_incorrect": length(False),
    }
    return metrics, out


# --- PLUMBING: run folder, devices, policy, checkpoints, logging (same in sft.py, expert_iter.py and grpo.py) ---


# Arguments a resumed run may change: where it runs and what it logs, not what it computes.
RESUME_MAY_CHANGE = {"resume", "output_dir", "track", "wandb_project", "policy_device", "vllm_device",
                     "vllm_gpu_memory_utilization", "gradient_checkpointing", "keep_checkpoints",
                     "reload_tol"}  # fmt: skip


def restore_args(args):
    """With --resume: the stopped run's arguments from its args.json. An argument given a non-default value that
    differs from the run's is refused (ValueError naming it), unless RESUME_MAY_CHANGE lists it."""
    if not args.resume:
        return args
    saved, defaults = json.loads((Path(args.resume) / "args.json").read_text()), type(args)()
    given = {k: v for k, v in asdict(args).items() if v != getattr(defaults, k)}
    conflicts = [f"--{k.replace('_', '-')} {v!r} (the run has {saved[k]!r})" for k, v in given.items()
                 if k in saved and saved[k] != v and k not in RESUME_MAY_CHANGE]  # fmt: skip
    if conflicts:
        raise ValueError(f"--resume {args.resume} continues a run with other arguments: {', '.join(conflicts)}")
    kept = {k: v for k, v in saved.items() if k in defaults.__dataclass_fields__ and k not in given}
    return replace(args, **kept)


def make_run_dir(output_dir: str, exp_name: str, seed: int, resume: str | None, config: dict) -> Path:
    """runs/<exp_name>__<seed>__<unix time>, or the folder being resumed; args.json is written into it."""
    run_dir = Path(resume) if resume else Path(output_dir) / f"{exp_name}__{seed}__{int(time.time())}"
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "args.json").write_text(json.dumps(config, indent=2))
    return run_dir


def resolve_devices(policy_device, vllm_device, memory_fraction, reload_tol) -> tuple[str, str, float, float | None]:
    """The defaults. Two GPUs: trainer on one, engine on the other. One GPU: the engine gets a bounded share. No GPU:
    both on the CPU in float32, with a fixed reload tolerance; in bf16 None: check_reload_at_start calibrates it.
    Devices compare as torch.devices with "cuda" read as "cuda:0": as strings, "cuda" != "cuda:0"."""
    canonical = lambda d: str(torch.device(d.type, d.index or 0) if (d := torch.device(d)).type == "cuda" else d)
    policy_device = canonical(policy_device or ("cuda:0" if torch.cuda.is_available() else "cpu"))
    vllm_device = canonical(vllm_device or ("cuda:1" if torch.cuda.device_count() > 1 else policy_device))
    memory_fraction = (0.3 if vllm_device == policy_device else 0.85) if memory_fraction is None else memory_fraction
    reload_tol = (1e-3 if vllm_device == "cpu" else None) if reload_tol is None else reload_tol
    return policy_device, vllm_device, memory_fraction, reload_tol


def seed_and_load_policy(model_path: str, device: str, gradient_checkpointing: bool, seed: int):
    """Seed Python, NumPy and torch (after the engine started: it reseeds them), then load the trainer's model in
    float32 and train mode. Returns it and the context to run it in: bfloat16 autocast on a GPU."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    policy = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(device)
    policy.train()  # from_pretrained returns eval mode, in which gradient checkpointing is silently off
    if gradient_checkpointing:
        policy.gradient_checkpointing_enable()
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.startswith("cuda") else contextlib.nullcontext()
    return policy, autocast


def save_checkpoint(run_dir: Path, step: int, policy, tokenizer, optimizer, scheduler, keep: int) -> Path:
    """checkpoints/step_N: a plain Hugging Face model folder plus trainer_state.pt (optimizer, scheduler, RNGs, step)
    for --resume, written to a temporary folder then renamed: a run killed mid-save leaves the last one intact. Then
    the older ones beyond the newest `keep` (0: none) are deleted; the first one written prints its size."""
    final = run_dir / "checkpoints" / f"step_{step:06d}"
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    policy.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    rng = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    state = {"step": step, "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "rng": rng}
    torch.save(state, tmp / "trainer_state.pt")
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    done = complete_checkpoints(run_dir)
    if len(done) == 1:
        size = sum(f.stat().st_size for f in final.rglob("*") if f.is_file()) / 1e9
        print(f"checkpoint {final}: {size:.3g} GB; up to {keep or 'all'} are kept (--keep-checkpoints)")
    for old in done[:-keep] if keep else []:  # only after the new one is complete; the newest always stays
        shutil.rmtree(old)
    return final


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """A run folder's complete checkpoints, oldest first (unfinished .tmp folders are left out)."""
    return sorted(p for p in (run_dir / "checkpoints").glob("step_*") if not p.name.endswith(".tmp"))


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint of a run folder, or None."""
    done = complete_checkpoints(run_dir)
    return done[-1] if done else None


def resume_from(checkpoint: Path | None, optimizer, scheduler, run_dir: Path, *record_files: str) -> int:
    """Restore a checkpoint's optimizer, scheduler and RNG states and return its step (0 without one). The records the
    stopped run wrote after it are dropped (by rename: a crash leaves the file whole), to be rewritten."""
    if checkpoint is None:
        return 0
    state = torch.load(checkpoint / "trainer_state.pt", weights_only=False)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    rng = state["rng"]
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])
    for gpu, cuda_state in enumerate(cuda_rng_states_to_restore(rng.get("cuda", []), torch.cuda.device_count())):
        torch.cuda.set_rng_state(cuda_state, gpu)
    names = ("metrics.jsonl", "generations.jsonl", *record_files)
    for path in [run_dir / name for name in names if (run_dir / name).exists()]:
        kept = [
            line for line in path.read_text().splitlines(keepends=True) if json.loads(line)["step"] <= state["step"]
        ]
        path.with_name(path.name + ".tmp").write_text("".join(kept))
        os.replace(path.with_name(path.name + ".tmp"), path)
    print(f"resumed from {checkpoint} after step {state['step']}")
    return state["step"]


def cuda_rng_states_to_restore(saved: list, n_gpus: int) -> list:
    """The saved per-GPU RNG states for the GPUs this machine has (set_rng_state_all fails when the count changed)."""
    if len(saved) != n_gpus:
        warnings.warn(f"the checkpoint has RNG states of {len(saved)} GPUs, this machine {n_gpus}: restoring "
                      f"{min(len(saved), n_gpus)}; sampling on the others will not replay", stacklevel=2)  # fmt: skip
    return saved[:n_gpus]


def append_jsonl(path: Path, records: list[dict]) -> None:
    with open(path, "a") as f:
        f.writelines(json.dumps(record) + "\n" for record in records)


def make_logger(run_dir: Path, track: bool, wandb_project: str, config: dict):
    """log(metrics, step) appends a line to metrics.jsonl and, with track, sends it to W&B. A NaN (the mean of
    nothing, a diverged reward) is written as null: metrics.jsonl stays strict JSON."""
    metrics_file = open(run_dir / "metrics.jsonl", "a")
    tracker = None
    if track:
        import wandb

        tracker = wandb.init(project=wandb_project, name=run_dir.name, config=config, resume="allow")

    def log(metrics: dict, step: int) -> None:
        metrics = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in metrics.items()}
        metrics_file.write(json.dumps({"step": step, **metrics}, allow_nan=False) + "\n")
        metrics_file.flush()
        if tracker is not None:
            tracker.log(metrics, step=step)

    return log


def main(args: Args) -> Path:
    args = restore_args(args)  # --resume: the stopped run's arguments
    if args.group_size > 1 and args.temperature == 0:
        raise ValueError(f"group_size={args.group_size} greedy samples would be one response; set --temperature")
    mixture = data.parse_mixture(args.dataset)  # a bad spec stops here, before the engine starts
    names, weights = [name for name, _ in mixture], [weight for _, weight in mixture]
    templates = data.dataset_templates(names, args.template, args.dataset_templates)
    order_files = data.parse_per_dataset(args.curriculum, names, "--curriculum")
    # All datasets' train examples, one dataset after another; each names its dataset (ex["dataset"]).
    train_examples, sizes, orders = data.load_mixture(names, "train", args.data_dir, order_files)
    for name, size, weight in zip(names, sizes, weights, strict=True):  # a step draws n_questions w / sum(w) on average
        if args.n_questions * weight / sum(weights) > size:
            raise ValueError(f"n_questions={args.n_questions}, {weight / sum(weights):.0%} from {name}, but its train "
                             f"split has {size}")  # fmt: skip
    # --- PLUMBING: run folder, devices, engine, seeds, policy (the same steps in every script) ---
    run_dir = make_run_dir(args.output_dir, args.exp_name, args.seed, args.resume, asdict(args))
    policy_device, vllm_device, memory_fraction, reload_tol = resolve_devices(
        args.policy_device, args.vllm_device, args.vllm_gpu_memory_utilization, args.reload_tol
    )
    checkpoint = latest_checkpoint(run_dir) if args.resume else None
    model_path = str(checkpoint) if checkpoint else args.model
    print(f"run folder {run_dir}; trainer on {policy_device}, vLLM on {vllm_device}; starting from {model_path}")
    # The engine's context must hold a prompt and its response, and the 400-token reload probes.
    max_model_len = max(args.max_seq_len, 512) + max(args.max_tokens, args.eval_max_tokens)
    # The engine first, while the GPU is empty: vLLM's request_memory refuses to start unless gpu_memory_utilization
    # x the GPU's memory is free, then keeps it; the trainer (which allocates as it goes) gets the rest.
    llm = init_vllm(model_path, vllm_device, args.seed, memory_fraction, max_model_len)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    policy, autocast = seed_and_load_policy(model_path, policy_device, args.gradient_checkpointing, args.seed)

    # --- Data, optimizer, resume ---
    eval_examples = {name: data.load(name, data.eval_split(name, args.eval_split), args.data_dir)[: args.n_eval]
                     for name in names}  # fmt: skip
    eval_prompts = {name: [data.render_prompt(ex, templates[name], tokenizer) for ex in examples]
                    for name, examples in eval_examples.items()}  # fmt: skip
    template_of = lambda ex: templates[ex["dataset"]]
    render = lambda ex: data.render_prompt(ex, template_of(ex), tokenizer) + data.render_response(ex, template_of(ex))
    probe_prompts = make_probe_prompts(tokenizer, [render(ex) for ex in train_examples[:8]])
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    scheduler = get_constant_schedule_with_warmup(optimizer, args.warmup_steps)
    start_step = resume_from(checkpoint, optimizer, scheduler, run_dir, "kept.jsonl")
    log = make_logger(run_dir, args.track, args.wandb_project, asdict(args))
    reload_tol, start_gap = check_reload_at_start(policy, llm, probe_prompts, vllm_device, reload_tol)
    sampling = dict(n=args.group_size, temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens,
                    include_stop_str_in_output=True)  # fmt: skip
    stops = {name: data.stop_strings(template) or None for name, template in templates.items()}  # each template's

    def evaluate_policy(step: int) -> dict:
        """Greedy evaluation through the engine (which follows the policy: checked at every reload), each dataset on
        its own eval split with its own template: eval/<dataset>/accuracy, and the totals over all of them."""
        t0 = time.time()
        metrics, records = {}, []
        for name, examples in eval_examples.items():
            part, part_records = evaluate(
                llm, examples, eval_prompts[name], templates[name], args.eval_max_tokens, vllm_device
            )
            metrics[f"eval/{name}/accuracy"] = part["eval/accuracy"]
            records += part_records
        metrics.update(eval_metrics(records))
        sample_metrics, samples = log_generations(policy, tokenizer, records[: args.n_log_generations], policy_device)
        append_jsonl(run_dir / "generations.jsonl", [{"step": step, **sample} for sample in samples])
        print(f"step {step:5d} | eval accuracy {metrics['eval/accuracy']:.3f} format {metrics['eval/format_rate']:.3f}")
        return {**metrics, **sample_metrics, "time/eval": time.time() - t0}

    if start_step == 0:
        log({**evaluate_policy(0), "reload/eval_logprob_gap": start_gap}, 0)

    # --- ALGORITHM: the EI loop, one step = reload, sample, filter, fine-tune, (evaluate), save ---
    for step in range(start_step, args.n_ei_steps):
        step_done = step + 1
        t_step = time.time()
        # 1. Put the trainer's current weights into the engine: the samples must come from the policy being trained.
        gap = reload_and_check(policy, llm, probe_prompts, vllm_device, reload_tol)
        time_reload = time.time() - t_step

        # 2. Sample group_size responses to each of this step's questions.
        t0 = time.time()
        indices, seeds = step_questions_and_seeds(
            sizes, weights, orders, args.n_questions, args.group_size, args.seed, step
        )
        examples = [train_examples[i] for i in indices]
        prompts = [data.render_prompt(ex, template_of(ex), tokenizer) for ex in examples]
        params = [SamplingParams(**sampling, stop=stops[ex["dataset"]], seed=seed)
                  for ex, seed in zip(examples, seeds, strict=True)]  # fmt: skip
        with engine_device(vllm_device):
            completions = [output.outputs for output in llm.generate(prompts, params, use_tqdm=True)]  # Q lists of G
        time_generate = time.time() - t0

        # 3. Score every response and keep the correct ones, each distinct response once per question.
        t0 = time.time()
        responses = [[c.text for c in group] for group in completions]  # (Q, G)
        # One batch through score_batch: code examples run their programs in a pool of processes, one per core.
        flat = iter(
            verifiers.score_batch(
                [text for group in responses for text in group],
                [ex for ex, group in zip(examples, responses, strict=True) for _ in group],
            )
        )
        scores = [[next(flat) for _ in group] for group in responses]  # (Q, G) reward dicts
        rewards = [[s["reward"] for s in group] for group in scores]  # (Q, G)
        kept = select_correct(examples, prompts, responses, rewards)
        append_jsonl(run_dir / "kept.jsonl", [
            {"step": step_done, "dataset": p["example"]["dataset"], "id": p["example"]["id"], "prompt": p["prompt"],
             "response": p["response"],
             "answer": p["example"]["answer"], "verifier": p["example"]["verifier"]} for p in kept
        ])  # fmt: skip
        # Lengths as generated (EOS excluded), looked up by question and text.
        n_tokens = {(examples[q]["id"], c.text): len(c.token_ids) for q, group in enumerate(completions) for c in group}
        kept_lengths = [n_tokens[p["example"]["id"], p["response"]] for p in kept]
        metrics = {
            "rollout/frac_solved": float(np.mean([max(group) == 1.0 for group in rewards])),
            "rollout/accuracy": float(np.mean(rewards)),
            "rollout/format_rate": float(np.mean([[s["format_reward"] for s in group] for group in scores])),
            "rollout/response_length": float(np.mean([[len(c.token_ids) for c in group] for group in completions])),
            "rollout/truncation_rate": float(np.mean([[c.finish_reason == "length" for c in g] for g in completions])),
            "rollout/n_correct": int(np.sum(rewards)),
            "rollout/n_kept": len(kept),
            "rollout/kept_length": float(np.mean(kept_lengths or np.nan)),
            "reload/logprob_gap": gap,
            "time/score": time.time() - t0,
            **rollout_metrics_by_dataset(names, examples, rewards),
        }

        # 4. Fine-tune on the kept responses: n_sft_epochs passes, a fresh order per (seed, step, epoch).
        t0 = time.time()
        pairs = [{**p, "response": p["response"] + tokenizer.eos_token} for p in kept]  # the model must learn to stop
        losses, grad_norms, entropy_sum, n_response_tokens = [], [], 0.0, 0
        for epoch in range(args.n_sft_epochs if pairs else 0):
            order = np.random.default_rng([args.seed, step, epoch]).permutation(len(pairs))
            for start in range(0, len(pairs), args.batch_size):
                batch = [pairs[i] for i in order[start : start + args.batch_size]]
                # Entropy in the first epoch only: each kept response is seen exactly once there.
                out = sft_batch_train_step(
                    policy, tokenizer, batch, args.microbatch_size, args.max_seq_len, autocast, entropy=epoch == 0
                )
                grad_norms.append(torch.nn.utils.clip_grad_norm_(policy.parameters(), args.max_grad_norm).item())
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                losses.append(out["loss"])
                entropy_sum += out.get("entropy_sum", 0.0)
                n_response_tokens += out["n_response_tokens"] if epoch == 0 else 0
        metrics.update({
            "train/loss": float(np.mean(losses or math.nan)),  # mean of the batches' mean NLL per response token
            "train/entropy": entropy_sum / n_response_tokens if n_response_tokens else math.nan,
            "train/grad_norm": float(np.mean(grad_norms or math.nan)),
            "train/lr": scheduler.get_last_lr()[0],
            "train/n_updates": len(losses),
            "train/response_tokens": n_response_tokens,  # per epoch, EOS included
            "time/reload": time_reload,
            "time/generate": time_generate,
            "time/train": time.time() - t0,
        })  # fmt: skip

        # 5. Evaluate (reloading first: the engine still holds the weights from before this step's updates).
        if step_done % args.eval_every == 0 or step_done == args.n_ei_steps:
            eval_gap = reload_and_check(policy, llm, probe_prompts, vllm_device, reload_tol)
            metrics.update({**evaluate_policy(step_done), "reload/eval_logprob_gap": eval_gap})

        # 6. Log and save.
        metrics["time/step"] = time.time() - t_step
        log(metrics, step_done)
        print(f"ei step {step_done:3d}/{args.n_ei_steps} | solved {metrics['rollout/frac_solved']:.3f} | "
              f"kept {len(kept)} | loss {metrics['train/loss']:.4f} | entropy {metrics['train/entropy']:.3f} | "
              f"kept length {metrics['rollout/kept_length']:.0f} | reload gap {gap:.1e} | "
              f"generate {time_generate:.1f} s train {metrics['time/train']:.1f} s")  # fmt: skip
        if not kept:
            print(f"  step {step_done}: no response passed the verifier, nothing to train on. Does the model write the "
                  "answer format (rollout/format_rate) within max_tokens (rollout/truncation_rate)?")  # fmt: skip
        if step_done % args.save_every == 0 or step_done == args.n_ei_steps:
            save_checkpoint(run_dir, step_done, policy, tokenizer, optimizer, scheduler, args.keep_checkpoints)
    return run_dir


if __name__ == "__main__":
    main(tyro.cli(Args))
