"""export_key (the content address of a policy's vLLM export): stable, and sensitive to every
weight byte, also with the tensors hashed in a thread pool."""
import os

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from flowrl.engines.rollout.vllm import export_key, host_tensors


class _Tokenizer:
    """What export_key reads of a tokenizer (loading SmolLM2's costs seconds here)."""

    eos_token_id, pad_token_id, chat_template = 2, 2, "{{ messages }}"

    def __len__(self) -> int:
        return 3

    def get_vocab(self) -> dict[str, int]:
        return {"a": 0, "b": 1, "</s>": 2}


def _tiny():
    from transformers import PretrainedConfig

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(3, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 3))
    model.config = PretrainedConfig(architectures=["Tiny"])
    return model


def test_export_key_stable_and_weight_sensitive():
    tok = _Tokenizer()
    model = _tiny()
    key = export_key(model, tok, host_tensors(model))
    assert len(key) == 32 and key == export_key(model, tok, host_tensors(model))
    assert key == export_key(_tiny(), tok, host_tensors(_tiny()))  # same weights, same key
    tensors = host_tensors(model)
    last = list(tensors)[-1]
    tensors[last] = tensors[last].clone()
    tensors[last].view(-1)[-1] += 1.0  # one element of the last tensor
    assert export_key(model, tok, tensors) != key
    swapped = dict(reversed(list(host_tensors(model).items())))  # order is part of the key
    assert export_key(model, tok, swapped) != key
