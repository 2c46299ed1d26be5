"""Your own data: jsonl / json / CSV / parquet files and datasets directories mapped to records by
the column names of DataConfig; every bad file, column or row is one line naming the file, the
line or row and the field; the prompt source renders chat messages as they are and hands reward
functions the row's extra fields."""
import json

import pytest
import torch

from flowrl.data import DataConfig, DataError, PromptSource, load_records
from flowrl.data.files import load_file_records
from flowrl.models import ModelConfig, load_tokenizer

ROWS = [{"prompt": "What is 2 + 3?", "answer": 5, "topic": "add"},
        {"prompt": [{"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "What is 7 - 4?"}], "answer": "3", "topic": "sub"}]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(ModelConfig())


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_parquet(path, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def cfg(path, **kw):
    return DataConfig(path=str(path), ground_truth_key="answer", **kw)


EXPECTED = [{"prompt": "What is 2 + 3?", "question": "What is 2 + 3?", "ground_truth": "5",
             "fields": {"topic": "add"}},
            {"prompt": ROWS[1]["prompt"], "question": "What is 7 - 4?", "ground_truth": "3",
             "fields": {"topic": "sub"}}]


def test_jsonl_json_and_parquet_give_the_same_records(tmp_path):
    jl = write_jsonl(tmp_path / "d.jsonl", ROWS)
    js = tmp_path / "d.json"
    js.write_text(json.dumps(ROWS))
    # parquet needs one type per column: string prompts in one file, chat messages in another
    pq_str = write_parquet(tmp_path / "s.parquet", [{**ROWS[0], "answer": "5"}])
    pq_chat = write_parquet(tmp_path / "c.parquet", [ROWS[1]])
    for path in (jl, js):
        assert list(load_records(cfg(path, extra_keys=["topic"]))) == EXPECTED
    assert list(load_records(cfg(pq_str, extra_keys=["topic"]))) == EXPECTED[:1]
    assert list(load_records(cfg(pq_chat, extra_keys=["topic"]))) == EXPECTED[1:]
    assert list(load_records(cfg(jl), limit=1)) == [{**EXPECTED[0], "fields": {}}]


def test_csv_and_a_datasets_directory_with_splits(tmp_path):
    (tmp_path / "d.csv").write_text("prompt,answer\n\"What is 2 + 3?\",5\nHi,7\n")
    assert [r["ground_truth"] for r in load_records(cfg(tmp_path / "d.csv"))] == ["5", "7"]
    # a directory of split files: datasets names the splits after them
    d = tmp_path / "ds"
    d.mkdir()
    write_jsonl(d / "train.jsonl", [{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": "2"}])
    write_jsonl(d / "test.jsonl", [{"prompt": "c", "answer": "3"}])
    c = cfg(d)
    assert [r["question"] for r in load_records(c, "train")] == ["a", "b"]
    assert [r["question"] for r in load_records(c, "test", for_eval=True)] == ["c"]
    with pytest.raises(DataError, match=r"has the splits \['test', 'train'\], not 'validation': "
                                        r"set trainer.eval.split to one of them"):
        load_records(c, "validation", for_eval=True)
    # save_to_disk output loads too
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:1])}).save_to_disk(tmp_path / "saved")
    assert load_records(cfg(tmp_path / "saved"))[0]["ground_truth"] == "5"


def _bad(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return p


@pytest.mark.parametrize("name, text, kw, message", [
    ("a.jsonl", '{"prompt": "x", "answer": "1"}\n\n{"prompt": "y", "answer": 2,}\n', {},
     "a.jsonl line 3: not valid JSON (Expecting property name enclosed in double quotes at column 29)"),
    ("a.jsonl", '{"prompt": "x", "answer": "1"}\n{"prompt": "b"\n', {},  # unclosed: its end
     "a.jsonl line 2: not valid JSON (Expecting ',' delimiter at column 15)"),
    ("a.jsonl", '["x", 1]\n', {}, "a.jsonl line 1: expected a JSON object, got list"),
    ("a.jsonl", '{"question": "x", "answer": "1"}\n', {},
     "a.jsonl: no column 'prompt' (data.prompt_key); columns: question, answer"),
    ("a.jsonl", '{"prompt": "x", "answer": "1"}\n{"prompt": "y"}\n', {},
     "a.jsonl line 2: no field 'answer'"),
    ("a.jsonl", '{"prompt": "x", "answer": null}\n', {},
     "a.jsonl line 1: field 'answer' (the ground truth) must be a string or a number, got null"),
    ("a.jsonl", '{"prompt": 3, "answer": "1"}\n', {},
     "a.jsonl line 1: field 'prompt' must be a string or a non-empty list of chat messages"),
    ("a.jsonl", '{"prompt": "  ", "answer": "1"}\n', {}, "a.jsonl line 1: field 'prompt' is an empty prompt"),
    ("a.jsonl", '{"prompt": [{"role": "user"}], "answer": "1"}\n', {},
     "a.jsonl line 1: field 'prompt' message 0 must be {'role': str, 'content': str}"),
    ("a.jsonl", '{"prompt": "x", "answer": "1"}\n{"prompt": "y", "answer": "2"}\n',
     {"extra_keys": ["topic"]}, "a.jsonl: no column 'topic' (data.extra_keys); columns: prompt, answer"),
    ("a.jsonl", "\n", {}, "a.jsonl: no rows"),
    ("a.json", '{"prompt": "x"}', {}, "a.json: expected a JSON array of objects (one per prompt), got dict"),
    ("a.json", '[\n{"prompt": "x", "answer": "1"},\n{"prompt": "y" "answer": "2"}\n]', {},
     "a.json line 3: not valid JSON (Expecting ',' delimiter at column 16)"),
    # a key twice: JSON kept the last one silently (a graph file refuses it; fresh-user report)
    ("a.jsonl", '{"prompt": "x", "answer": "1"}\n{"prompt": "y", "answer": 4, "answer": 5}\n', {},
     "a.jsonl line 2: field 'answer' given twice (JSON would keep only the last)"),
    ("a.json", '[{"prompt": "x", "prompt": "y", "answer": "1"}]', {},
     "a.json: field 'prompt' given twice in one object (JSON would keep only the last)"),
    ("a.csv", "prompt,answer\nx,1\ny,2,3\n", {}, "a.csv line 3: 3 cells for 2 header columns"),
    ("a.parquet", "not parquet", {}, "a.parquet: not a readable parquet file"),
])
def test_a_bad_file_is_one_line_naming_file_line_and_field(tmp_path, name, text, kw, message):
    path = _bad(tmp_path, name, text)
    with pytest.raises(DataError) as e:
        load_records(cfg(path, **kw))
    assert str(e.value).startswith(str(path.parent) + "/" + message) and "\n" not in str(e.value)


def test_an_unknown_chat_role_names_file_line_message_and_the_roles(tmp_path):
    """A chat template renders an unknown role as it is (or drops it): `"usr"` reached the model
    unchecked (fresh-user report)."""
    ok = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
          {"role": "assistant", "content": "a"}, {"role": "tool", "content": "t"},
          {"role": "user", "content": "q2"}]
    bad = [{"role": "system", "content": "s"}, {"role": "usr", "content": "q"}]
    jl = write_jsonl(tmp_path / "a.jsonl", [{"prompt": ok, "answer": "1"},
                                            {"prompt": bad, "answer": "2"}])
    with pytest.raises(DataError) as e:
        load_records(cfg(jl))
    assert str(e.value) == (f"{jl} line 2: field 'prompt' message 1 has role 'usr' (did you mean "
                            "'user'?); allowed roles: system, user, assistant, tool")
    pq = write_parquet(tmp_path / "a.parquet", [{"prompt": [{"role": "robot", "content": "q"}],
                                                 "answer": "1"}])
    with pytest.raises(DataError) as e:
        load_records(cfg(pq))
    assert str(e.value) == (f"{pq} row 0: field 'prompt' message 0 has role 'robot'; allowed "
                            "roles: system, user, assistant, tool")
    # every allowed role loads, in order, and the question is the last user turn
    assert list(load_records(cfg(write_jsonl(tmp_path / "b.jsonl",
                                             [{"prompt": ok, "answer": "1"}])))) == \
        [{"prompt": ok, "question": "q2", "ground_truth": "1", "fields": {}}]


def test_bad_rows_in_parquet_and_bad_bytes(tmp_path):
    p = write_parquet(tmp_path / "a.parquet", [{"prompt": "x", "answer": "1"},
                                               {"prompt": None, "answer": "2"}])
    with pytest.raises(DataError, match=r"a.parquet row 1: field 'prompt' must be a string or a "
                                        r"non-empty list of chat messages .*got NoneType"):
        load_records(cfg(p))
    b = tmp_path / "b.jsonl"
    b.write_bytes(b'{"prompt": "\xff", "answer": "1"}\n')
    with pytest.raises(DataError, match=r"b.jsonl: not UTF-8 text \(byte 12\)"):
        load_records(cfg(b))


@pytest.mark.parametrize("kw, message", [
    ({"path": "nope.jsonl"}, "data.path: no file or directory at 'nope.jsonl'"),
    ({"path": "__file__.txt"}, "data.path: '__file__.txt' must end in one of .jsonl, .json, .parquet, .csv"),
    ({"eval_path": "nope.parquet"}, "data.eval_path: no file or directory at 'nope.parquet'"),
    ({"extra_keys": ["topic"]}, "data.extra_keys: the bundled gsm8k has no column(s) ['topic']"),
])
def test_config_names_the_field(tmp_path, monkeypatch, kw, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "__file__.txt").write_text("x")
    with pytest.raises(ValueError) as e:
        DataConfig(**kw)
    assert str(e.value).startswith(message)


def test_a_directory_that_is_no_dataset_is_refused_at_once(tmp_path, monkeypatch):
    # data.path=/tmp took 193 s in datasets.load_dataset (every file under it listed) and then
    # failed vaguely: the config check refuses such a folder without reading it
    from flowrl.data import files

    monkeypatch.setattr(files, "DATASET_DIR_MAX_FILES", 5)
    big = tmp_path / "big"
    (big / "sub").mkdir(parents=True)
    for i in range(3):
        (big / f"a{i}.log").write_text("x")
        (big / "sub" / f"b{i}.jsonl").write_text("{}")
    with pytest.raises(ValueError) as e:
        DataConfig(path=str(big))
    assert str(e.value) == (f"data.path: {str(big)!r} holds more than 5 files, so it is not a dataset "
                            "folder (datasets would read every file under it): name the data file, "
                            "or a folder with only the dataset's files (train.jsonl, test.parquet, ...)")
    # hidden and dunder names are not counted (datasets skips them too)
    for name in ("a0.log", "a1.log"):
        (big / name).rename(big / f".{name}")
    (big / "a2.log").rename(big / "__a2.log")
    assert DataConfig(path=str(big)).path == str(big)
    # no data file at all
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "run.log").write_text("x")
    (logs / ".hidden.jsonl").write_text("{}")
    with pytest.raises(ValueError) as e:
        DataConfig(eval_path=str(logs))
    assert str(e.value) == (f"data.eval_path: the directory {str(logs)!r} holds no data file (.jsonl, "
                            ".json, .parquet, .csv, .arrow, .tsv) and is not a datasets save_to_disk folder")
    # save_to_disk output: not scanned
    (logs / "dataset_dict.json").write_text("{}")
    assert DataConfig(eval_path=str(logs)).eval_path == str(logs)


def test_a_single_file_has_no_heldout_split(tmp_path):
    c = cfg(write_jsonl(tmp_path / "d.jsonl", ROWS))
    with pytest.raises(DataError, match="is a single file, so it has no held-out split to evaluate "
                                        "on: set data.eval_path=FILE"):
        load_records(c, "test", for_eval=True)
    # the file itself as eval_path: the training prompts, chosen explicitly
    same = cfg(tmp_path / "d.jsonl", eval_path=str(tmp_path / "d.jsonl"))
    assert len(load_records(same, "test", for_eval=True)) == 2


def test_locations_name_the_line_of_each_record(tmp_path):
    p = write_jsonl(tmp_path / "d.jsonl", ROWS)
    p.write_text("\n" + p.read_text())  # a blank first line: records start on line 2
    _, where = load_file_records(str(p), "train", prompt_key="prompt", ground_truth_key="answer")
    assert where == (f"{p} line 2", f"{p} line 3")


def test_instruction_is_the_datasets_own(tmp_path):
    from flowrl.data import DEFAULT_INSTRUCTION

    assert DataConfig().instruction == DEFAULT_INSTRUCTION  # bundled GSM8K: the #### line
    assert cfg(write_jsonl(tmp_path / "d.jsonl", ROWS)).instruction == ""  # a file: none
    assert cfg(tmp_path / "d.jsonl", instruction="Answer briefly.").instruction == "Answer briefly."


def test_prompt_source_renders_user_rows(tok, tmp_path):
    c = cfg(write_jsonl(tmp_path / "d.jsonl", ROWS), extra_keys=["topic"], shuffle=False)
    src = PromptSource(c, tok)
    batch = src.sample(2, 2)
    assert batch.ground_truth == ["5", "5", "3", "3"]
    assert batch.prompt_text[0] == tok.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}], tokenize=False, add_generation_prompt=True)
    # chat messages are rendered as they are: their own system turn, no instruction appended
    assert batch.prompt_text[2] == tok.apply_chat_template(ROWS[1]["prompt"], tokenize=False,
                                                          add_generation_prompt=True)
    assert batch.fields[2] == {"question": "What is 7 - 4?", "topic": "sub"}
    assert src.record_for_group(1)["fields"] == {"topic": "sub"}
    assert src.record_for_group(99) is None


def test_reward_functions_get_the_rows_extra_fields(tok, tmp_path):
    from flowrl.ops.context import StageContext
    from flowrl.ops.reward import prompt_fields

    c = cfg(write_jsonl(tmp_path / "d.jsonl", ROWS), extra_keys=["topic"], shuffle=False)
    src = PromptSource(c, tok)
    batch = src.sample(2, 1)
    ctx = StageContext(stage="reward", step=1, resources={"prompts": src, "tokenizer": tok})
    fields = prompt_fields(ctx, batch.ground_truth, batch.prompt_ids, batch.prompt_mask,
                           batch.group_id)
    assert [(f["ground_truth"], f["question"], f["topic"]) for f in fields] == [
        ("5", "What is 2 + 3?", "add"), ("3", "What is 7 - 4?", "sub")]
    assert fields[1]["prompt"] == batch.prompt_text[1]
    # two groups of one prompt: each group keeps its own row (group ids, not prompt text)
    assert torch.equal(batch.group_id, torch.tensor([0, 1]))
