"""Rollout engine on transformers' ``generate`` (the embedded default; vLLM is the production one).

The engine either *shares* the actor's ``nn.Module`` (colocated, zero-copy: ``load_weights`` finds
the same storage and copies nothing) or holds its own copy (``load_weights`` copies in place).

Rollout logprobs are recorded *while* generating by a logits processor placed before the
temperature/top-k/top-p warpers, so memory is one (B, V) row per step instead of the (steps, B, V)
that ``output_logits=True`` keeps for the whole call.
"""
from __future__ import annotations

import contextlib
import time
from typing import Any, Iterable, Mapping, Optional, cast

import torch
from torch import Tensor, nn
from transformers import (
    GenerationConfig,
    GenerationMixin,
    LogitsProcessor,
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from flowrl.algorithms.masks import response_mask
from flowrl.engines.base import RolloutBatch, SamplingConfig
from flowrl.engines.config import HF_CACHE_BUCKET, HFRolloutConfig
from flowrl.models.attention import sdpa_without_cudnn
from flowrl.models.kernels import eager_kernels


class _LogprobRecorder(LogitsProcessor):
    """Scores each sampled token under the distribution of the step that sampled it.

    A logits processor sees step t's scores before the token is drawn; the token itself shows up as
    the last column of ``input_ids`` at step t+1 (or of the final sequences, see :meth:`finish`).
    """

    def __init__(self, temperature: float) -> None:
        self.temperature = temperature
        # previous step: (B, V) fp32 scores / T and their (B,) logsumexp
        self.pending: Optional[tuple[Tensor, Tensor]] = None
        self.logprobs: list[Tensor] = []

    def _score(self, tokens: Tensor) -> None:
        if self.pending is not None:
            x, lse = self.pending
            self.logprobs.append(x.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - lse)

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        self._score(input_ids[:, -1])
        # token_logprobs' arithmetic (scores / T, then picked - logsumexp), split over two steps.
        # The division makes a tensor this recorder owns, so later (possibly in-place)
        # processors cannot change it: no defensive copy of the (B, V) scores per step
        t = self.temperature if self.temperature > 0 else 1.0
        x = scores.detach().float() / t
        self.pending = (x, torch.logsumexp(x, dim=-1))
        return scores

    def finish(self, sequences: Tensor) -> Tensor:
        """(B, R) float32 logprobs of the R generated tokens; sequences is generate's output."""
        self._score(sequences[:, -1])
        self.pending = None
        return torch.stack(self.logprobs, dim=1)


def pad_to_cache_bucket(ids: Tensor, mask: Tensor, max_new_tokens: int, pad_token_id: int,
                        bucket: int = HF_CACHE_BUCKET) -> tuple[Tensor, Tensor]:
    """Left-pad a chunk's prompts so that prompt length + ``max_new_tokens`` is a multiple of
    ``bucket``: the static KV cache transformers sizes to that sum then has one length for every
    call of a job, and the compiled decode step (whose graph is specialised to it) is reused
    instead of recompiled. Pad positions are masked out, and transformers derives the position
    ids from the mask, so the generated tokens do not change.

    Args:
        ids: (B, P) int64 left-padded prompt ids. mask: (B, P) bool, True on real tokens.
        max_new_tokens: the call's ``max_new_tokens``. pad_token_id: the id written in the pads.
        bucket: tokens (``HF_CACHE_BUCKET``).

    Returns:
        (ids, mask) of shape (B, P') on their device, P' >= P the smallest with
        (P' + max_new_tokens) % bucket == 0; the inputs themselves when P' == P.
    """
    extra = -(ids.shape[1] + max_new_tokens) % bucket
    if extra == 0:
        return ids, mask
    return (torch.nn.functional.pad(ids, (extra, 0), value=pad_token_id),
            torch.nn.functional.pad(mask, (extra, 0), value=False))


def _module_device(model: nn.Module) -> torch.device:
    for t in model.parameters():
        return t.device
    return torch.device("cpu")


class HFRolloutEngine:
    """:class:`flowrl.engines.base.RolloutEngine` on ``transformers`` ``generate``.

    Args:
        model: a causal LM (``PreTrainedModel`` with ``generate``). Pass the actor's module itself to
            share weights (set ``shared=True``), or a separate copy.
        tokenizer: gives ``eos_token_id`` (always a stop id) and ``pad_token_id`` (falls back to EOS).
        cfg: engine configuration.
        shared: True when ``model`` is the actor train engine's module. Then ``offload``/``onload``
            leave its placement to the train engine's ``offload``/``onload`` and only free the cache.

    Attributes:
        last_timings: seconds of the last ``generate``/``load_weights``/``offload``/``onload``
            call, keyed ``generate_s``, ``load_weights_s``, ``offload_s``, ``onload_s``.
        last_load_counts: ``{"copied": n, "shared": m}`` tensors of the last ``load_weights``;
            ``shared`` counts tensors that already were this module's storage (zero-copy).
        last_prefix_cache: ``{"prompt_tokens": n, "cached_tokens": 0}`` of the last ``generate``
            (transformers' ``generate`` keeps no cache across calls).
    """

    def __init__(self, model: nn.Module, tokenizer, cfg: HFRolloutConfig | None = None, *,
                 shared: bool = False) -> None:
        self.cfg = cfg or HFRolloutConfig()
        if not shared and self.cfg.dtype != "auto":  # its own copy: cast it (a shared module is
            model = model.to(getattr(torch, self.cfg.dtype))  # the trainer's and keeps its dtype)
        self.model = model
        self.shared = shared
        self.eos_token_id = int(tokenizer.eos_token_id)
        pad = tokenizer.pad_token_id
        self.pad_token_id = int(pad) if pad is not None else self.eos_token_id
        self.device = _module_device(model)
        self.last_timings: dict[str, float] = {}
        self.last_load_counts: dict[str, int] = {"copied": 0, "shared": 0}
        self.last_prefix_cache: dict[str, int] = {"prompt_tokens": 0, "cached_tokens": 0}

    # ------------------------------------------------------------------ generate
    def generate(self, prompt_ids: Tensor, prompt_mask: Tensor, params: SamplingConfig,
                 generator: torch.Generator | None = None,
                 images: Mapping[str, Tensor] | None = None) -> RolloutBatch:
        """Sample one response per prompt.

        Args:
            prompt_ids: (B, P) int64, left-padded.
            prompt_mask: (B, P) bool (or 0/1), the tokenizer's attention mask; each row must be
                left-padded (no real token after a pad) and hold at least one real token.
            params: sampling parameters; ``temperature == 0`` is greedy.
            generator: source of the sampling seed. One 63-bit seed is drawn from it per call and the
                whole call runs under ``torch.random.fork_rng`` seeded with it (transformers samples
                from the global RNG), so the global RNG is left untouched and the same generator
                state, inputs and ``cfg.batch_size`` give the same samples on the same device. With
                ``None`` the global RNG is used (and advanced).
            images: a vision-language model's ``pixel_values`` (B, N, D) and ``image_grid_thw``
                (B, K, 3) (``flowrl.data.images``), handed to ``generate`` chunk by chunk; the
                model computes its M-RoPE positions from them and the mask.

        Returns:
            :class:`RolloutBatch` on ``prompt_ids.device``; R = the longest response generated.
            ``response_ids`` are right-padded with the pad id. A row's length is the position of its
            first stop id (tokenizer EOS or ``params.stop_token_ids``) plus one, else R: exactly
            the rule of transformers' EOS stopping criterion, which is what ends a row; ids are never
            compared with the pad id (pad may equal EOS, case C04). ``truncated`` = no stop id
            within ``max_new_tokens``. ``rollout_logprobs`` (0 where the mask is False):

            - ``logprobs_mode="tempered"``: log softmax(logits / T)[token] over the full vocabulary
              (T = 1 for greedy), with the arithmetic of the trainer's ``token_logprobs``. With
              top_p = 1 and top_k = 0 this is exactly the sampling distribution and equals the
              trainer's recomputation up to kernel noise. With top-p/top-k the token was drawn from
              the truncated, renormalised distribution; its true sampler logprob is this value minus
              log(probability mass kept), i.e. higher; the tempered value is what stays comparable
              with the trainer.
            - ``logprobs_mode="processed"``: log softmax of the warped scores, the truncated,
              renormalised sampler distribution (not reproducible by the trainer when truncating).

            NaN where the mask is True when ``params.logprobs`` is ``none``.

        Raises:
            ValueError: shape mismatch, or a prompt row that is empty or not left-padded.
        """
        if prompt_ids.dim() != 2 or prompt_ids.shape != prompt_mask.shape:
            raise ValueError(f"prompt_ids {tuple(prompt_ids.shape)} and prompt_mask "
                             f"{tuple(prompt_mask.shape)} must both be (B, P)")
        mask = prompt_mask.bool()
        if not mask.any(dim=1).all():
            raise ValueError("every prompt row needs at least one real token (prompt_mask row all False)")
        # left-padded ⇔ once a row turns True it stays True
        if (mask[:, :-1] & ~mask[:, 1:]).any():
            raise ValueError("prompt_mask must be left-padded: a pad follows a real token")

        t0 = time.perf_counter()
        stops = [self.eos_token_id] + [int(s) for s in params.stop_token_ids if s != self.eos_token_id]
        seed = None
        if generator is not None:
            seed = int(torch.randint(0, 2**63 - 1, (1,), generator=generator).item())
        out_device = prompt_ids.device
        B = prompt_ids.shape[0]
        chunks = []
        was_training = self.model.training
        self.model.eval()
        try:
            with self._rng(seed), torch.inference_mode():
                for s in range(0, B, self.cfg.batch_size):
                    e = s + self.cfg.batch_size
                    vis = None if images is None else {k: v[s:e] for k, v in images.items()}
                    chunks.append(self._generate_chunk(prompt_ids[s:e], mask[s:e], params, stops,
                                                       vis))
        finally:
            self.model.train(was_training)

        R = max(ids.shape[1] for ids, _ in chunks)
        ids = torch.full((B, R), self.pad_token_id, dtype=torch.long)
        lps = torch.zeros(B, R, dtype=torch.float32)
        row = 0
        for c_ids, c_lps in chunks:
            n, r = c_ids.shape
            ids[row:row + n, :r] = c_ids.cpu()
            lps[row:row + n, :r] = c_lps.cpu()
            row += n
        is_stop = torch.isin(ids, torch.tensor(stops))
        pos = torch.arange(R).expand(B, R)
        lengths = torch.where(is_stop, pos + 1, torch.full_like(pos, R)).min(dim=1).values
        resp_mask = response_mask(ids, lengths, stops)
        truncated = ~is_stop.any(dim=1)
        lps = torch.where(resp_mask, lps, torch.zeros_like(lps))
        if params.logprobs == "none":  # not measured: NaN, as from the vLLM engine (here they
            # cost nothing, but both backends keep one contract)
            lps = torch.where(resp_mask, torch.full_like(lps, float("nan")), lps)
        self.last_timings = {"generate_s": time.perf_counter() - t0}
        self.last_prefix_cache = {"prompt_tokens": int(mask.sum()), "cached_tokens": 0}
        return RolloutBatch(response_ids=ids.to(out_device), response_mask=resp_mask.to(out_device),
                            rollout_logprobs=lps.to(out_device), truncated=truncated.to(out_device))

    def _rng(self, seed: Optional[int]):
        if seed is None:
            return contextlib.nullcontext()
        devices = [self.device] if self.device.type == "cuda" else []

        @contextlib.contextmanager
        def forked():
            with torch.random.fork_rng(devices=devices):
                torch.manual_seed(seed)
                yield
        return forked()

    def _generate_chunk(self, ids: Tensor, mask: Tensor, params: SamplingConfig,
                        stops: list[int], images: Mapping[str, Tensor] | None = None
                        ) -> tuple[Tensor, Tensor]:
        # columns that are padding in every row of this chunk only cost compute
        first = int(mask.any(dim=0).long().argmax())
        ids, mask = ids[:, first:], mask[:, first:]
        rows = ids.shape[0]
        if self.cfg.compile:
            ids, mask = pad_to_cache_bucket(ids, mask, params.max_new_tokens, self.pad_token_id)
            if images is None and rows < self.cfg.batch_size:
                # the compiled step is specialised to the batch size too: a short last chunk (an
                # eval's remainder) runs at full size with copies of its first row, discarded
                extra_rows = self.cfg.batch_size - rows
                ids = torch.cat([ids, ids[:1].expand(extra_rows, -1)])
                mask = torch.cat([mask, mask[:1].expand(extra_rows, -1)])
        ids, mask = ids.to(self.device), mask.to(self.device)
        sample = params.temperature > 0
        recorder = _LogprobRecorder(params.temperature if sample else 1.0)
        processors = LogitsProcessorList([recorder] if self.cfg.logprobs_mode == "tempered" else [])
        if sample:
            # our own warpers (transformers' classes, its order) so the recorder can sit before them
            if params.temperature != 1.0:
                processors.append(TemperatureLogitsWarper(params.temperature))
            if params.top_k > 0:
                processors.append(TopKLogitsWarper(params.top_k))
            if params.top_p < 1.0:
                processors.append(TopPLogitsWarper(params.top_p))
        if self.cfg.logprobs_mode == "processed":
            recorder.temperature = 1.0  # the warpers already divided by T
            processors.append(recorder)
        gen_cfg = self._generation_config(params, stops, sample)
        # the model's own generation_config (e.g. a checkpoint's repetition_penalty or top_k=50
        # fallback) would silently change the sampler and break rollout == trainer logprobs
        lm = cast(GenerationMixin, self.model)  # a causal LM: nn.Module + GenerationMixin
        saved = lm.generation_config
        lm.generation_config = GenerationConfig()
        extra: dict[str, Tensor] = {}
        if images is not None:
            from flowrl.data.images import vision_kwargs

            extra = vision_kwargs(self.model, images["pixel_values"], images["image_grid_thw"],
                                  ids, self.device)
        try:
            # no cuDNN attention: a graph per new shape, and every decode step is one. Eager
            # kernels: liger's cost more host time than they save at 1 token a row, and under
            # rollout.hf.compile dynamo cannot trace their Triton kernels (7 graph breaks; the
            # compiled decode ran slower than eager: benchmarks/results/hf_generate_compile_h100.md)
            with sdpa_without_cudnn(self.device, self.cfg.cudnn_attention), \
                    eager_kernels(self.model):
                seqs = lm.generate(input_ids=ids, attention_mask=mask.long(),
                                   generation_config=gen_cfg, logits_processor=processors, **extra)
        finally:
            lm.generation_config = saved
        if isinstance(seqs, Tensor):
            sequences = seqs
        else:
            sequences = seqs.sequences
        return sequences[:rows, ids.shape[1]:], recorder.finish(sequences)[:rows]

    def _generation_config(self, params: SamplingConfig, stops: list[int], sample: bool
                           ) -> GenerationConfig:
        # sampling: neutral warper values so transformers adds none (ours sit in logits_processor);
        # greedy: unset, since transformers warns about sampling flags when do_sample=False
        neutral = dict(temperature=1.0, top_k=0, top_p=1.0) if sample else {}
        kwargs: dict[str, Any] = dict(
            do_sample=sample, **neutral, min_p=None, typical_p=1.0, repetition_penalty=1.0, no_repeat_ngram_size=0, num_beams=1, num_return_sequences=1,
            max_new_tokens=params.max_new_tokens, min_new_tokens=0,
            eos_token_id=stops, pad_token_id=self.pad_token_id, use_cache=True,
            return_dict_in_generate=False, output_scores=False, output_logits=False,
            disable_compile=not self.cfg.compile,  # None (no job to size it for): off
        )
        if self.cfg.cache_implementation is not None:
            kwargs["cache_implementation"] = self.cfg.cache_implementation
        return GenerationConfig(**kwargs)

    # ------------------------------------------------------------------ weights / memory
    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        """Copy full tensors in place by name (parameters and buffers; may be called per bucket).

        A tensor that already *is* this module's storage (same ``data_ptr``, the colocated shared
        module) is skipped: nothing is copied. Dtype/device are converted by ``copy_``.

        Raises:
            KeyError: a name this module does not have. ValueError: a shape mismatch.
        """
        t0 = time.perf_counter()
        own: dict[str, Tensor] = dict(self.model.named_parameters())
        own.update(self.model.named_buffers())
        copied = shared = 0
        for name, src in named_tensors:
            if name not in own:
                raise KeyError(f"load_weights: rollout model has no tensor named {name!r}")
            dst = own[name]
            if dst.shape != src.shape:
                raise ValueError(f"load_weights: {name} has shape {tuple(src.shape)}, "
                                 f"expected {tuple(dst.shape)}")
            if dst.data_ptr() == src.data_ptr() and dst.device == src.device:
                shared += 1
                continue
            dst.copy_(src)
            copied += 1
        self.last_load_counts = {"copied": copied, "shared": shared}
        self.last_timings = {"load_weights_s": time.perf_counter() - t0}

    @torch.no_grad()
    def weight_samples(self, index: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """``engines.base.WeightReadback``: the values at ``index[name]`` of each named
        parameter or buffer (its dtype, on CPU)."""
        own: dict[str, Tensor] = dict(self.model.named_parameters())
        own.update(self.model.named_buffers())
        return {name: own[name].reshape(-1)[idx.to(own[name].device)].cpu()
                for name, idx in index.items() if name in own}

    def offload(self, keep_weights: bool = False) -> None:
        """Give device memory back: move a non-shared module to CPU and empty the CUDA cache.

        On CPU (and for a shared module's weights, whose placement is the train engine's) nothing
        moves; the call is still timed. ``keep_weights``: leave a non-shared module on the device
        too (only the cache is emptied).
        """
        t0 = time.perf_counter()
        if self.device.type == "cuda":
            if not self.shared and not keep_weights:
                self.model.to("cpu")
            torch.cuda.empty_cache()
        self.last_timings = {"offload_s": time.perf_counter() - t0}

    def onload(self) -> None:
        """Inverse of :meth:`offload`: put a non-shared module back on its device."""
        t0 = time.perf_counter()
        if self.device.type == "cuda" and not self.shared:
            self.model.to(self.device)
        self.last_timings = {"onload_s": time.perf_counter() - t0}

    def close(self) -> None:
        """Nothing to release: the module goes with the engine (no processes, no pools)."""
