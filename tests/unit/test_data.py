"""GSM8K loading, prompt rendering/collation (case C04), sampler and PromptSource."""
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from flowrl.data import (
    DataConfig,
    PromptSampler,
    PromptSource,
    collate_prompts,
    load_gsm8k,
    parse_ground_truth,
)
from flowrl.data.prompts import load_records, render_prompts
from flowrl.models import ModelConfig, load_tokenizer

ASSISTANT_PREFIX = "<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(ModelConfig())  # bundled SmolLM2 tokenizer, no GGUF parse


# ---------------------------------------------------------------- dataset
def test_load_gsm8k_records():
    train, test = load_gsm8k("train"), load_gsm8k("test")
    assert (len(train), len(test)) == (7473, 1319)
    first = train[0]
    assert set(first) == {"question", "answer", "ground_truth"}
    assert first["question"].startswith("Natalia sold clips to 48 of her friends")
    assert first["answer"].endswith("#### 72")
    assert first["ground_truth"] == "72"
    assert [r["ground_truth"] for r in load_gsm8k("train", limit=3)] == ["72", "10", "5"]


def test_ground_truth_strips_commas_and_requires_marker():
    assert parse_ground_truth("so 1000+500\n#### 1,500") == "1500"
    assert parse_ground_truth("#### 1\n#### -7") == "-7"
    with pytest.raises(ValueError, match="no '#### <number>' line"):
        parse_ground_truth("no marker")
    # every bundled record has a ground truth with no commas or spaces
    assert all("," not in r["ground_truth"] and r["ground_truth"] for r in load_gsm8k("test"))


@pytest.mark.parametrize("kwargs, msg", [
    ({"split": "tran"}, "data.split must be 'train' or 'test', got 'tran'"),
    ({"name": "math"}, "data.name must be one of ('gsm8k', 'arith', 'visual'), got 'math'"),
    ({"limit": 0}, "data.limit must be >= 1 or None, got 0"),
    ({"max_prompt_tokens": 0}, "data.max_prompt_tokens must be >= 1, got 0"),
])
def test_data_config_validation(kwargs, msg):
    with pytest.raises(ValueError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        DataConfig(**kwargs)


# ---------------------------------------------------------------- collation (C04)
def test_collate_c04_pad_equals_eos_inside_prompt():
    # pad = eos = 2; the prompt [11, 2, 12] really contains id 2 -> mask from lengths
    ids, mask = collate_prompts([[11, 2, 12], [7, 8, 9, 10, 2]], pad_id=2)
    assert ids.dtype == torch.int64 and mask.dtype == torch.bool
    assert ids.tolist() == [[2, 2, 11, 2, 12], [7, 8, 9, 10, 2]]
    assert mask.int().tolist() == [[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]


def test_collate_rejects_empty():
    with pytest.raises(ValueError, match="at least one prompt"):
        collate_prompts([], pad_id=0)
    with pytest.raises(ValueError, match="empty prompt at row 1"):
        collate_prompts([[1], []], pad_id=0)


# ---------------------------------------------------------------- chat template
def test_prompt_uses_chat_template(tok):
    src = PromptSource(DataConfig(limit=4, shuffle=False, system_prompt="Be brief."), tok)
    batch = src.sample(num_prompts=1, n=1)
    text = batch.prompt_text[0]
    question = load_gsm8k("train", limit=1)[0]["question"]
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n" + question
                    + "\n" + src.cfg.instruction + "<|im_end|>\n" + ASSISTANT_PREFIX)
    assert text.endswith(ASSISTANT_PREFIX)
    ids = batch.prompt_ids[0][batch.prompt_mask[0]].tolist()
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": question + "\n" + src.cfg.instruction}]
    assert ids == tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    assert ids[-4:] == [1, 520, 9531, 198]  # <|im_start|> assistant \n
    # the instruction asks for the '#### <number>' format
    assert "#### <number>" in src.cfg.instruction


def test_default_system_prompt_comes_from_template(tok):
    src = PromptSource(DataConfig(limit=1, shuffle=False), tok)
    assert src.sample(1, 1).prompt_text[0].startswith(
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM")


def test_overlong_prompts_are_skipped_when_drawn_and_counted(tok, caplog):
    _, tokens = render_prompts([r["question"] for r in load_gsm8k("train", limit=20)], tok,
                               DataConfig())
    lengths = [len(t) for t in tokens]
    cap = sorted(lengths)[9]  # keeps 10 (lengths are distinct enough) or more on ties
    src = PromptSource(DataConfig(limit=20, max_prompt_tokens=cap, shuffle=False), tok)
    kept = [i for i, n in enumerate(lengths) if n <= cap]
    assert (len(src), src.num_skipped) == (20, 0)  # nothing drawn yet
    with caplog.at_level("WARNING", logger="flowrl.data.prompts"):
        batch = src.sample(len(kept), 1)  # one epoch in file order: every over-long one skipped
    assert batch.prompt_mask.sum(1).max().item() <= cap  # never cut, only skipped
    assert batch.prompt_index.tolist() == kept
    assert src.num_skipped == 20 - len(kept) and (src.sampler.epoch, src.sampler.position) == (1, 0)
    assert f"skipped {20 - len(kept)} more gsm8k/train prompts" in caplog.text
    again = src.sample(len(kept), 1)  # the next epoch skips them again, counted again
    assert again.prompt_index.tolist() == kept and src.num_skipped == 2 * (20 - len(kept))
    with pytest.raises(ValueError, match="all 3 prompts of gsm8k/train exceed data.max_prompt_tokens=5"):
        PromptSource(DataConfig(limit=3, max_prompt_tokens=5), tok)


def test_lazy_rendering_matches_eager_render_prompts(tok):
    """Each drawn prompt's text and ids are what rendering the whole split up front gives."""
    cfg = DataConfig(name="arith", limit=300, seed=4, response_prefix="<think>\n")
    src = PromptSource(cfg, tok)
    assert len(src._rendered) == 64  # only the probe before the first draw
    texts, tokens = render_prompts([r["question"] for r in load_records(cfg)], tok, cfg)
    for _ in range(5):
        b = src.sample(7, 2)
        for row, i in enumerate(b.prompt_index.tolist()):
            assert b.prompt_text[row] == texts[i]
            assert b.prompt_ids[row][b.prompt_mask[row]].tolist() == tokens[i]
    assert src.render(299) == (texts[299], tokens[299])


# the order and ids of the up-front-rendering PromptSource (flowrl 1ac4994), pinned: lazy
# rendering must not change what a seed draws
PINNED_ORDER = {
    ("arith", 1, 0): [[3168, 6752, 2371, 2481, 410, 2601, 3171, 2218],
                      [6945, 6845, 732, 7069, 1577, 2026, 6383, 3444],
                      [6423, 4337, 5756, 3253, 6280, 2023, 6859, 7083]],
    ("arith", 2, 1): [[6752, 2481, 2601, 2218, 6845, 7069, 2026, 3444],
                      [4337, 3253, 2023, 7083, 5370, 1994, 1874, 4892],
                      [3684, 471, 3964, 6437, 1901, 4388, 3978, 906]],
    ("gsm8k", 1, 0): [[23, 32, 30, 17, 20, 11], [33, 2, 12, 3, 21, 29], [38, 4, 25, 22, 0, 28]],
    ("gsm8k", 2, 0): [[23, 30, 20, 33, 12, 21], [38, 25, 0, 39, 10, 15], [34, 13, 9, 6, 26, 16]],
}
PINNED_IDS_SHA = {("arith", 1, 0): "11617590902c3f0a", ("arith", 2, 1): "6c17fba682c9268b",
                  ("gsm8k", 1, 0): "746989a2b092b390", ("gsm8k", 2, 0): "6c56706762eb55b0"}


@pytest.mark.parametrize("key", sorted(PINNED_ORDER))
def test_sample_order_and_ids_pinned(tok, key):
    import hashlib

    name, world, rank = key
    cfg = DataConfig(name="arith") if name == "arith" else DataConfig(limit=40, seed=3)
    src = PromptSource(cfg, tok, rank=rank, world_size=world)
    num = 8 if name == "arith" else 6
    out = [src.sample(num, 2) for _ in range(3)]
    assert [b.prompt_index.tolist()[::2] for b in out] == PINNED_ORDER[key]
    digest = hashlib.sha256(b"".join(b.prompt_ids.numpy().tobytes() for b in out)).hexdigest()
    assert digest[:16] == PINNED_IDS_SHA[key]


def test_malformed_row_rejected_before_rendering(tmp_path, tok):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "1+1?", "ground_truth": "2"}\n{"prompt": "2+2?"}\n')
    with pytest.raises(ValueError, match="p.jsonl line 2: no field 'ground_truth'"):
        PromptSource(DataConfig(path=str(path)), tok)


# ---------------------------------------------------------------- sampler
def test_sampler_deterministic_epochs_and_no_repeats():
    a, b = PromptSampler(10, seed=3), PromptSampler(10, seed=3)
    seq_a = [a.next_batch(4) for _ in range(5)]
    assert seq_a == [b.next_batch(4) for _ in range(5)]
    flat = sum(seq_a, [])
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:20]) == list(range(10))
    assert flat[:10] != flat[10:20]  # a new permutation each epoch
    assert (a.epoch, a.position) == (2, 0)
    assert PromptSampler(10, seed=4).next_batch(10) != flat[:10]
    assert PromptSampler(5, shuffle=False).next_batch(7) == [0, 1, 2, 3, 4, 0, 1]


def test_sampler_shards_are_disjoint_and_equal():
    shards = [PromptSampler(11, seed=1, rank=r, world_size=3).next_batch(3) for r in range(3)]
    flat = sum(shards, [])
    assert len(flat) == len(set(flat)) == 9  # 11 // 3 * 3; two items left out this epoch
    assert [len(s) for s in shards] == [3, 3, 3]
    with pytest.raises(ValueError, match=r"sampler.rank must be in \[0, 2\), got 2"):
        PromptSampler(4, rank=2, world_size=2)
    with pytest.raises(ValueError, match="sampler.num_items must be >= world_size"):
        PromptSampler(1, world_size=2)


def test_sampler_resume_continues_exactly():
    ref = PromptSampler(7, seed=5, rank=1, world_size=2)
    expected = [ref.next_batch(2) for _ in range(6)]  # crosses several epochs
    run = PromptSampler(7, seed=5, rank=1, world_size=2)
    got = [run.next_batch(2) for _ in range(2)]
    state = run.state_dict()
    resumed = PromptSampler(7, seed=5, rank=1, world_size=2)
    resumed.load_state_dict(state)
    got += [resumed.next_batch(2) for _ in range(4)]
    assert got == expected
    with pytest.raises(ValueError, match="sampler state seed=5 does not match"):
        PromptSampler(7, seed=6).load_state_dict(state)


# ---------------------------------------------------------------- PromptSource
def test_sample_layout_and_group_ids(tok):
    cfg = DataConfig(limit=16, seed=0)
    srcs = [PromptSource(cfg, tok, rank=r, world_size=2) for r in range(2)]
    seen = []
    for step in range(3):
        for rank, src in enumerate(srcs):
            b = src.sample(num_prompts=2, n=3)
            assert len(b) == 6 and b.prompt_ids.shape[0] == b.prompt_mask.shape[0] == 6
            assert b.group_id.dtype == torch.int64
            base = step * 2 * 2 + rank * 2
            assert b.group_id.tolist() == [base] * 3 + [base + 1] * 3  # tiled per prompt
            idx = b.prompt_index.tolist()
            assert idx[0] == idx[1] == idx[2] and idx[3] == idx[4] == idx[5]
            assert b.ground_truth[:3] == [src.records[idx[0]]["ground_truth"]] * 3
            assert torch.equal(b.prompt_ids[0], b.prompt_ids[2])
            seen += b.group_id.unique().tolist()
    assert seen == list(range(12))  # unique across ranks and steps, monotonic


def test_prompt_source_resume(tok):
    cfg = DataConfig(limit=9, seed=2)
    ref = PromptSource(cfg, tok)
    expected = [ref.sample(4, 2) for _ in range(4)]
    run = PromptSource(cfg, tok)
    run.sample(4, 2)
    run.sample(4, 2)
    resumed = PromptSource(cfg, tok)
    resumed.load_state_dict(run.state_dict())
    for want in expected[2:]:
        got = resumed.sample(4, 2)
        assert torch.equal(got.prompt_ids, want.prompt_ids)
        assert torch.equal(got.group_id, want.group_id)
        assert got.prompt_index.tolist() == want.prompt_index.tolist()
    assert resumed.step == 4


def test_prompt_source_resume_with_skips_and_checks(tok):
    cfg = DataConfig(limit=20, seed=2, max_prompt_tokens=120)
    ref = PromptSource(cfg, tok)
    expected = [ref.sample(4, 1).prompt_index.tolist() for _ in range(8)]
    assert ref.num_skipped > 0  # the cap skips some of these 20
    run = PromptSource(cfg, tok)
    for _ in range(3):
        run.sample(4, 1)
    state = run.state_dict()
    resumed = PromptSource(cfg, tok)
    resumed.load_state_dict(state)
    assert [resumed.sample(4, 1).prompt_index.tolist() for _ in range(5)] == expected[3:]
    assert resumed.num_skipped == ref.num_skipped
    with pytest.raises(ValueError, match="data.max_prompt_tokens=120, this run 121"):
        PromptSource(DataConfig(limit=20, seed=2, max_prompt_tokens=121), tok).load_state_dict(state)
    with pytest.raises(ValueError, match="first prompts render to other token ids here"):
        PromptSource(DataConfig(limit=20, seed=2, max_prompt_tokens=120, system_prompt="Hi."),
                     tok).load_state_dict(state)
    old = {k: state[k] for k in ("sampler", "step", "group_offset")}  # a pre-lazy state
    with pytest.raises(ValueError, match="filtered out 2 over-long prompts"):
        resumed.load_state_dict({**old, "num_skipped": 2})
    resumed.load_state_dict({**old, "num_skipped": 0})  # skipped none: same order, loads


def test_eval_batches_fixed_slice(tok):
    src = PromptSource(DataConfig(limit=8, seed=1), tok)
    src.sample(3, 2)  # training state must not affect evaluation
    batches = list(src.eval_batches(limit=5, batch_size=2, split="test"))
    assert [len(b) for b in batches] == [2, 2, 1]
    assert sum((b.prompt_index.tolist() for b in batches), []) == [0, 1, 2, 3, 4]
    assert sum((b.group_id.tolist() for b in batches), []) == [0, 1, 2, 3, 4]
    test = load_gsm8k("test", limit=5)
    assert sum((b.ground_truth for b in batches), []) == [r["ground_truth"] for r in test]
    again = list(src.eval_batches(limit=5, batch_size=2, split="test"))
    assert all(torch.equal(a.prompt_ids, b.prompt_ids) for a, b in zip(batches, again))
    shard1 = PromptSource(DataConfig(limit=8), tok, rank=1, world_size=2)
    assert [b.prompt_index.tolist() for b in shard1.eval_batches(5, 8, "test")] == [[1, 3]]
    # evaluate_greedy runs on one rank: it reads the whole slice whatever the rank
    assert [b.prompt_index.tolist() for b in shard1.eval_batches(5, 8, "test", shard=False)] == \
        [[0, 1, 2, 3, 4]]
