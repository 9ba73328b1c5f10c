"""Build a tiny Qwen3-architecture model and a tokenizer trained here, with no download.

Tests and CPU demos need a model that transformers and vLLM both load, and none can be downloaded
on a machine without internet. This script makes one from a config: the same architecture as
Qwen3-1.7B-Base (RMSNorm, rotary attention with grouped KV heads and q/k norms, SwiGLU MLP), a
byte-level BPE tokenizer trained on the synthetic task's text, the same special tokens as the Qwen3
base models (`<|endoftext|>` is both EOS and pad, which is exactly the case where a careless
response mask hides the EOS token), and a ChatML chat template. The weights are random: the point is
a model that *can* learn, not one that already has.

Sizes: head_dim must be >= 32 (vLLM's CPU attention kernel refuses 16). The defaults give about
0.5M parameters; the CPU ladder uses a larger one.

Usage:
    python tiny_model.py --out runs/tiny-qwen3
    python tiny_model.py --out runs/tiny-qwen3-4l --n-layers 4 --hidden-size 256
"""

from dataclasses import dataclass
from pathlib import Path

import torch
import tyro
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

import data

EOS = "<|endoftext|>"
SPECIAL_TOKENS = [EOS, "<|im_start|>", "<|im_end|>"]

# Qwen2/Qwen3's pre-tokenizer split: every digit is its own piece, so numbers are read digit by
# digit, which is what lets a small model learn arithmetic.
QWEN_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclass
class Args:
    out: str = "runs/tiny-qwen3"
    """folder to write the model and tokenizer to (a normal Hugging Face model folder)"""
    vocab_size: int = 1024
    """BPE vocabulary size, special tokens and the 256 byte tokens included"""
    hidden_size: int = 128
    """width of the residual stream"""
    n_layers: int = 2
    """number of transformer blocks"""
    n_heads: int = 4
    """attention (query) heads"""
    n_kv_heads: int = 2
    """key/value heads (grouped-query attention, as in Qwen3)"""
    head_dim: int = 32
    """per-head width; vLLM's CPU kernel needs >= 32"""
    intermediate_size: int = 384
    """SwiGLU hidden width"""
    max_position_embeddings: int = 2048
    """longest sequence the model accepts (prompt + response), in tokens"""
    seed: int = 0
    """seed for the random weights"""


def tokenizer_corpus() -> list[str]:
    """Text to train the BPE merges on: the synthetic task in every prompt template, plus the
    template words."""
    texts = []
    for example in data.load("synthetic", "train")[:5000]:
        texts.append(
            data.render_prompt(example, "r1_zero") + data.render_response(example, "r1_zero")
        )
        texts.append(
            data.render_prompt(example, "question") + data.render_response(example, "question")
        )
    return texts


def build_tokenizer(corpus: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE (any UTF-8 text can be encoded), Qwen's digit-by-digit split, Qwen's special
    tokens."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=EOS,
        pad_token=EOS,
        additional_special_tokens=SPECIAL_TOKENS[1:],
        chat_template=CHAT_TEMPLATE,
        model_max_length=2048,
    )


def build_model(args: Args, tokenizer: PreTrainedTokenizerFast) -> Qwen3ForCausalLM:
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden_size,
        num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads,
        num_key_value_heads=args.n_kv_heads,
        head_dim=args.head_dim,
        intermediate_size=args.intermediate_size,
        max_position_embeddings=args.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    torch.manual_seed(args.seed)
    return Qwen3ForCausalLM(config)


def main(args: Args) -> Path:
    out = Path(args.out)
    tokenizer = build_tokenizer(tokenizer_corpus(), args.vocab_size)
    model = build_model(args, tokenizer)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    n_params = sum(p.numel() for p in model.parameters())
    shape = f"{args.n_layers} layers x {args.hidden_size}"
    print(f"wrote {out}: Qwen3, {shape}, {n_params / 1e6:.2f}M parameters, vocab {len(tokenizer)}")
    return out


if __name__ == "__main__":
    main(tyro.cli(Args))
