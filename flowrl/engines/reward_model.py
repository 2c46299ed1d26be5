"""Classifier reward model (role ``reward_model``): a sequence-classification model with one
output (``num_labels=1``) scoring prompt + response, the Bradley-Terry RM of InstructGPT
(Ouyang et al. 2022, eq. 1) and of every RLHF framework.
"""
from __future__ import annotations

import time

import torch
from torch import Tensor
from transformers import AutoModelForSequenceClassification, PreTrainedModel

from flowrl.models.loading import ModelConfig, build_tiny


def load_reward_model(cfg: ModelConfig) -> PreTrainedModel:
    """A ``num_labels=1`` sequence-classification model on CPU in ``cfg.dtype``, eval mode.

    Tiny configs get the bundled tokenizer's vocabulary and pad id; a directory is loaded with
    ``from_pretrained(num_labels=1)``.
    """
    dtype = cfg.torch_dtype
    if cfg.tiny is not None:
        model = build_tiny(cfg, dtype, AutoModelForSequenceClassification, num_labels=1)
    else:
        model = AutoModelForSequenceClassification.from_pretrained(
            cfg.path, num_labels=1, dtype=dtype, attn_implementation=cfg.attn)
    return model.eval()


def join_left_padded(prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor,
                     response_mask: Tensor, pad_id: int) -> tuple[Tensor, Tensor]:
    """Prompt + response of every row as one LEFT-padded sequence, so the last column is always
    the last real token (the pooled position), whatever the token ids are (pad may equal EOS,
    case C04).

    Returns: ids (B, L) int64 and mask (B, L) bool, L = the longest prompt + response.
    """
    rows = [torch.cat([p[pm.bool()], r[rm.bool()]]) for p, pm, r, rm
            in zip(prompt_ids, prompt_mask, response_ids, response_mask)]
    width = max(len(x) for x in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, x in enumerate(rows):
        ids[i, width - len(x):] = x
        mask[i, width - len(x):] = True
    return ids, mask


class RewardModelEngine:
    """Batched scoring with a sequence-classification model (frozen).

    Args:
        model: from :func:`load_reward_model` (any ``*ForSequenceClassification`` with one label).
        pad_token_id: id used for left padding (its value never decides the pooled position).
        batch_size: rows per forward pass.
    """

    def __init__(self, model: PreTrainedModel, *, pad_token_id: int, batch_size: int = 8):
        self.model = model.eval()
        self.pad_token_id = int(pad_token_id)
        self.batch_size = batch_size
        self.device = next(model.parameters()).device
        self.last_timings: dict[str, float] = {}

    @torch.inference_mode()
    def score(self, prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor,
              response_mask: Tensor) -> Tensor:
        """Reward of every (prompt, response) row.

        transformers pools a classifier at "the last token that is not the pad id", a comparison
        of VALUES that skips a real final EOS when pad == EOS. We pass ``inputs_embeds`` (then
        it pools the last column) of left-padded rows, with position ids from the mask (absolute
        position embeddings see the same positions as an unpadded run).

        Args:
            prompt_ids/prompt_mask: (B, P) left-padded. response_ids/response_mask: (B, R)
                right-padded.

        Returns:
            (B,) float32 scalar rewards (the head's raw logit), on CPU.
        """
        t0 = time.perf_counter()
        ids, mask = join_left_padded(prompt_ids, prompt_mask, response_ids, response_mask,
                                     self.pad_token_id)
        embed = self.model.get_input_embeddings()
        out = []
        for s in range(0, ids.shape[0], self.batch_size):
            b_ids = ids[s:s + self.batch_size].to(self.device)
            b_mask = mask[s:s + self.batch_size].to(self.device)
            pos = (b_mask.long().cumsum(-1) - 1).clamp(min=0)
            logits = self.model(inputs_embeds=embed(b_ids), attention_mask=b_mask.long(),
                                position_ids=pos).logits
            out.append(logits[:, 0].float().cpu())
        self.last_timings = {"score_s": time.perf_counter() - t0}
        return torch.cat(out)

    def offload(self, keep_weights: bool = False) -> None:
        """Give device memory back (colocated plans); a timed no-op on CPU. ``keep_weights``:
        the weights stay (only the CUDA cache is emptied)."""
        t0 = time.perf_counter()
        if self.device.type == "cuda":
            if not keep_weights:
                self.model.to("cpu")
            torch.cuda.empty_cache()
        self.last_timings = {"offload_s": time.perf_counter() - t0}

    def onload(self) -> None:
        """Inverse of :meth:`offload`."""
        t0 = time.perf_counter()
        if self.device.type == "cuda":
            self.model.to(self.device)
        self.last_timings = {"onload_s": time.perf_counter() - t0}

    def close(self) -> None:
        """Nothing to release: the module goes with the engine."""
