"""get_response_log_probs without the full-vocabulary copy: the output layer runs on chunks of
positions, each under checkpoint. Its numbers are the plain computation's (log_softmax of the
whole (B, T, V) logits) to rounding, its gradients too, and autograd keeps no (B, T, V) tensor."""

import importlib
import math
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config

SCRIPTS = ["sft", "expert_iter", "grpo", "distill"]


class HandModel(torch.nn.Module):
    """A model whose hidden state is the token's one-hot vector and whose output layer is a
    matrix of log-weights: token i's next-token logits are row i of `logits`."""

    def __init__(self, logits: torch.Tensor):
        super().__init__()
        n = logits.shape[0]
        self.embed = torch.nn.Embedding.from_pretrained(torch.eye(n))
        self.head = torch.nn.Linear(n, logits.shape[1], bias=False)
        self.head.weight.data = logits.T.clone()

    def base_model(self, input_ids, use_cache=False):
        return SimpleNamespace(last_hidden_state=self.embed(input_ids))

    def get_output_embeddings(self):
        return self.head


@pytest.mark.parametrize("script", SCRIPTS)
def test_log_probs_and_entropy_by_hand(script):
    module = importlib.import_module(script)
    # after token 0: weights 1, 3, 1 (p = 1/5, 3/5, 1/5); after token 1: uniform over 3
    logits = torch.tensor([[0.0, math.log(3), 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    model = HandModel(logits)
    input_ids = torch.tensor([[0, 1, 0]])  # (B, T)
    labels = torch.tensor([[1, 2, 0]])
    out = module.get_response_log_probs(model, input_ids, labels, True, chunk_size=2)
    expected = [math.log(3 / 5), math.log(1 / 3), math.log(1 / 5)]
    torch.testing.assert_close(out["log_probs"], torch.tensor([expected]))
    skewed = -(0.2 * math.log(0.2) * 2 + 0.6 * math.log(0.6))
    entropies = [skewed, math.log(3), skewed]
    torch.testing.assert_close(out["token_entropy"], torch.tensor([entropies]))
    # at temperature 2 the logits halve: weights 1, sqrt(3), 1
    out = module.get_response_log_probs(model, input_ids[:, :1], labels[:, :1], temperature=2.0)
    expected = math.log(math.sqrt(3) / (2 + math.sqrt(3)))
    torch.testing.assert_close(out["log_probs"], torch.tensor([[expected]]))


def tiny_qwen3(vocab_size: int = 300):
    torch.manual_seed(0)
    config = Qwen3Config(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        intermediate_size=96,
        vocab_size=vocab_size,
        tie_word_embeddings=True,
    )
    return AutoModelForCausalLM.from_config(config)


def plain_log_probs(model, input_ids, labels, temperature):
    """The computation chunking replaces: log_softmax over the whole (B, T, V) logits."""
    logits = model(input_ids).logits.float() / temperature  # (B, T, V)
    log_probs = torch.log_softmax(logits, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    probs = torch.softmax(logits.detach(), dim=-1)
    entropy = -(probs * torch.log_softmax(logits.detach(), dim=-1)).sum(-1)
    return log_probs, entropy


@pytest.mark.parametrize("chunk_size", [1, 7, 1000])
def test_chunked_log_probs_and_gradients_equal_the_plain_computation(chunk_size):
    import grpo

    model = tiny_qwen3()
    input_ids = torch.randint(0, 300, (3, 20))  # (B, T)
    labels = torch.randint(0, 300, (3, 20))
    weights = torch.randn(3, 20)
    log_probs, entropy = plain_log_probs(model, input_ids, labels, 0.7)
    (weights * log_probs).sum().backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    out = grpo.get_response_log_probs(model, input_ids, labels, True, 0.7, chunk_size)
    (weights * out["log_probs"]).sum().backward()
    torch.testing.assert_close(out["log_probs"], log_probs, rtol=0, atol=1e-5)
    torch.testing.assert_close(out["token_entropy"], entropy, rtol=0, atol=1e-5)
    assert not out["token_entropy"].requires_grad
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], rtol=1e-4, atol=1e-6, msg=name)


def largest_saved_for_backward(function) -> int:
    """The most elements of one tensor that autograd keeps for the backward while `function`
    runs (checkpoint's recomputed tensors are not kept)."""
    sizes = [0]

    def pack(tensor):
        sizes.append(tensor.numel())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        function()
    return max(sizes)


def test_autograd_keeps_no_tensor_of_the_full_vocabulary():
    import grpo

    vocab_size = 5000
    model = tiny_qwen3(vocab_size)
    input_ids = torch.randint(0, vocab_size, (2, 64))  # (B, T)
    labels = torch.randint(0, vocab_size, (2, 64))
    full = 2 * 64 * vocab_size
    plain = largest_saved_for_backward(lambda: plain_log_probs(model, input_ids, labels, 1.0))
    # the check can fail: the plain computation keeps its (B, T, V) log_softmax
    assert plain >= full
    chunked = largest_saved_for_backward(
        lambda: grpo.get_response_log_probs(model, input_ids, labels, True, chunk_size=16)
    )
    # the largest is the output layer's weight, (V, H), which the model holds anyway
    assert chunked <= vocab_size * model.config.hidden_size < full
