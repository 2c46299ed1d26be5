"""The critic: a scalar value head on the actor's base model, trained by :class:`ValueTrainEngine`.

Why ``AutoModelForTokenClassification(num_labels=1)``: for every decoder transformers ships
(Llama, Qwen2, Mistral, GPT-2, ...) it is the base model (same ``base_model_prefix`` and parameter
names as the causal LM's ``.model``/``.transformer``) plus a dropout and a ``Linear(hidden, 1)`` on
the last hidden state — exactly the PPO value head (Ouyang et al. 2022 §3.5; OpenRLHF/verl critics).
Its base loads the actor's base weights with a *strict* ``load_state_dict`` (a mismatch raises,
never silently re-initialises), only the 1-output head is new, and it keeps HF features (SDPA,
gradient checkpointing) with no home-made wrapper.
"""
from __future__ import annotations

import copy
from typing import Mapping, Optional

import torch
from torch import Tensor, nn

from flowrl.algorithms.masks import left_align, position_ids_from_mask, response_attention_mask
from flowrl.engines.train.local import LocalTrainEngine, _slice_batch


def value_model_from_causal_lm(lm: nn.Module) -> nn.Module:
    """A value model whose base model is a copy of ``lm``'s, with a fresh scalar head.

    Args:
        lm: a transformers causal LM (``lm.config``, ``lm.base_model``). It is not modified.
    Returns:
        ``AutoModelForTokenClassification`` with ``num_labels=1`` on ``lm``'s device and dtype; the
        head is initialised by transformers (normal(0, initializer_range) weight, zero bias).
    Raises:
        ValueError: ``lm`` is not a transformers model, or no token-classification class exists
            for its architecture, or its base weights do not load strictly.
    """
    from transformers import AutoModelForTokenClassification, PreTrainedModel

    if not isinstance(lm, PreTrainedModel):
        raise ValueError(f"critic: expected a transformers causal LM, got {type(lm).__name__}")
    cfg = copy.deepcopy(lm.config)
    cfg.num_labels = 1
    param = next(lm.parameters())
    try:
        critic = AutoModelForTokenClassification.from_config(cfg, dtype=param.dtype)
    except ValueError as e:
        raise ValueError(f"critic: no value-head model for model_type={cfg.model_type!r}: {e}") from e
    try:
        critic.base_model.load_state_dict(lm.base_model.state_dict(), strict=True)
    except RuntimeError as e:
        raise ValueError(f"critic: the actor's base weights do not fit the value model: {e}") from e
    return critic.to(param.device)


class ValueTrainEngine(LocalTrainEngine):
    """:class:`LocalTrainEngine` for the critic: same optimizer, micro-batching, NaN-skip,
    offload/onload and DCP state; its differentiable forward returns values instead of logprobs,
    so ``train_step(batch, loss_fn, ...)`` calls ``loss_fn(micro_batch, values (b, R), None)``.

    Args:
        model: a value model (:func:`value_model_from_causal_lm`) whose output ``.logits`` is
            (B, L, 1).
        cfg / trainable: as :class:`LocalTrainEngine`.
    """

    def _values(self, mb: Mapping[str, Tensor]) -> Tensor:
        """(b, R) float32 values, 0 at masked positions. Value t is the head's output at the
        position *before* response token t (the state in which token t is chosen) — the same
        shift as logprobs (case C08), so V_t pairs with the action y_t in GAE."""
        p_ids, p_mask = mb["prompt_ids"], mb["prompt_mask"].bool()
        r_ids, r_mask = mb["response_ids"], mb["response_mask"].bool()
        P, R = p_ids.shape[1], r_ids.shape[1]
        ids = torch.cat([p_ids, r_ids], dim=1).to(self.device)
        # environment tokens between policy turns (mask False) are context: attended
        attn = torch.cat([p_mask, response_attention_mask(r_mask)], dim=1).to(self.device)
        # left padding moved to the row's end: no query attends to nothing (masks.left_align)
        shift = self._left_pad(p_mask).to(self.device)
        ids, attn = left_align(ids, attn, shift)
        out = self._forward(dict(input_ids=ids, attention_mask=attn.long(),
                                 position_ids=position_ids_from_mask(attn)), None).logits
        if out.dim() != 3 or out.shape[-1] != 1:
            raise ValueError(f"critic model must output (B, L, 1) values, got {tuple(out.shape)}")
        idx = torch.arange(P - 1, P + R - 1, device=out.device)[None, :] - shift[:, None]
        v = out[..., 0].gather(1, idx).float()
        return torch.where(r_mask.to(v.device), v, torch.zeros((), device=v.device))

    def _logprobs(self, mb: Mapping[str, Tensor], temperature: float,
                  with_entropy: bool, entropy_grad: bool = True) -> tuple[Tensor, Optional[Tensor]]:
        # the forward LocalTrainEngine.train_step differentiates: for a critic, the values
        return self._values(mb), None

    def values(self, batch: Mapping[str, Tensor]) -> Tensor:
        """V(state before each response token), without grad, in eval mode (dropout off).

        Args: batch with ``prompt_ids``/``prompt_mask`` (B, P) left-padded and ``response_ids``/
            ``response_mask`` (B, R) right-padded.
        Returns: (B, R) float32, 0 where ``response_mask`` is False, on the model's device;
            computed in micro-batches of ``cfg.micro_batch_size``.
        """
        B = batch["response_ids"].shape[0]
        mbs = self.cfg.micro_batch_size
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                parts = [self._values(_slice_batch(batch, s, s + mbs, B)) for s in range(0, B, mbs)]
        finally:
            self.model.train(was_training)
            self._end_pass()
        return torch.cat(parts)

    def logprobs(self, batch, temperature, with_entropy=False):
        raise TypeError("the critic has no token distribution: use ValueTrainEngine.values()")
