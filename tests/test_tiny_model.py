"""The tiny model loads in transformers and in a real vLLM engine, and both generate the same greedy
tokens."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import data

PROMPTS = [
    data.render_prompt(data.load("synthetic", "test")[0], "r1_zero"),
    "Tom has 12 apples. He buys 30 more. How many apples does he have now?",
    "Ünïcödé and emoji 🙂 still encode: the tokenizer is byte-level.",
]


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir), AutoModelForCausalLM.from_pretrained(
        tiny_model_dir
    )


def test_model_shape_and_special_tokens(hf):
    tokenizer, model = hf
    n_params = sum(p.numel() for p in model.parameters())
    assert 1e5 < n_params < 5e6, n_params
    assert model.config.model_type == "qwen3"
    assert model.config.head_dim >= 32  # vLLM's CPU attention refuses 16
    # As in Qwen3-Base: one token is both EOS and pad.
    assert tokenizer.eos_token == tokenizer.pad_token == "<|endoftext|>"
    assert model.config.eos_token_id == tokenizer.eos_token_id


def test_tokenizer_round_trips_and_splits_digits(hf):
    tokenizer, _ = hf
    for text in PROMPTS:
        ids = tokenizer(text, add_special_tokens=False).input_ids
        assert tokenizer.decode(ids) == text
    pieces = tokenizer.convert_ids_to_tokens(tokenizer("12345", add_special_tokens=False).input_ids)
    assert pieces == ["1", "2", "3", "4", "5"]


def test_chat_template(hf):
    tokenizer, _ = hf
    messages = [{"role": "user", "content": "hi"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_vllm_greedy_equals_transformers_greedy(tiny_model_dir, hf):
    from vllm import LLM, SamplingParams

    tokenizer, model = hf
    llm = LLM(
        model=str(tiny_model_dir),
        dtype="float32",
        seed=0,
        enforce_eager=True,
        gpu_memory_utilization=0.5,
    )
    params = SamplingParams(temperature=0.0, max_tokens=24)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        vllm_ids = list(out.outputs[0].token_ids)
        assert len(vllm_ids) >= 1
        input_ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            hf_ids = model.generate(input_ids, max_new_tokens=24, do_sample=False)[
                0, input_ids.shape[1] :
            ].tolist()
        assert vllm_ids == hf_ids, prompt
