"""Your own prompts: a local jsonl / json / parquet / CSV file, or a directory that ``datasets``
can load (``save_to_disk`` output, or data files whose names give the splits: ``train.jsonl``,
``test.parquet``, ...), turned into flowrl's records by the column names of ``DataConfig``.

A record (one prompt) is a dict::

    {"prompt": str | list[{"role", "content"}],   # a user turn, or chat messages used as they are
     "question": str,                             # the prompt text (chat: the last user turn)
     "ground_truth": str,                         # "" when data.ground_truth_key is null
     "fields": {key: value}}                      # data.extra_keys, handed to reward functions

Every problem is one :class:`DataError` line naming the file, where in it and the field:
``line N`` (1-based, as an editor shows it) in jsonl and CSV files, ``row N`` (0-based, as
``pandas``/``datasets`` index it) in parquet, JSON arrays and ``datasets`` directories.
``flowrl train`` reads and checks the data before any model loads.
"""
from __future__ import annotations

import csv
import functools
import json
import os
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")
# the roles of a chat message in a prompt (``tool``: a tool call's result, as the multi-turn
# environments write them)
CHAT_ROLES = ("system", "user", "assistant", "tool")
_MISSING = object()


class DataError(ValueError):
    """A data file, column or row flowrl cannot use; the message names the file, the line or row
    and the field, in one line. ``problems``: ``(row index, message)`` of every row found wrong,
    in the file's (split's) row order, when it is about rows (a caller checking something else
    of each row merges its own: :func:`problems_line`)."""

    def __init__(self, message: str, problems: Sequence[tuple[int, str]] = ()):
        super().__init__(message)
        self.problems = list(problems)


SHOWN_PROBLEMS = 3  # rows a one-line data error names; the rest are counted


def problems_line(problems: Sequence[tuple[int, str]], label: str) -> str:
    """One line for the rows of one file found wrong (``(row index, message)``, each message
    starting with ``label``): the first :data:`SHOWN_PROBLEMS` in file order, the later ones
    without the repeated file name, then how many more (a user fixed one row a run: a file of
    bad rows took a run per row).

    >>> problems_line([(3, "d.jsonl line 4: no field 'a'"), (1, "d.jsonl line 2: no field 'p'")], "d.jsonl")
    "d.jsonl line 2: no field 'p'; line 4: no field 'a'"
    """
    ordered = [m for _, m in sorted(problems, key=lambda p: p[0])]
    short = [ordered[0]] + [m[len(label) + 1:] if m.startswith(label + " ") else m
                            for m in ordered[1:SHOWN_PROBLEMS]]
    more = len(ordered) - len(short)
    return "; ".join(short) + (f" (and {more} more row{'s' * (more > 1)} with problems)" if more else "")


def is_single_file(path: str) -> bool:
    """True for a data file (one split), False for a ``datasets`` directory (named splits)."""
    return not Path(path).expanduser().is_dir()


def check_path(path: str, field: str) -> None:
    """``data.path`` / ``data.eval_path`` must name an existing data file or directory.

    Raises:
        ValueError: missing, or a file whose suffix is none of :data:`FILE_SUFFIXES`.
    """
    p = Path(path).expanduser()
    if not p.exists():
        raise ValueError(f"{field}: no file or directory at {path!r} (relative paths start in "
                         f"{Path.cwd()})")
    if p.is_file() and p.suffix.lower() not in FILE_SUFFIXES:
        raise ValueError(f"{field}: {path!r} must end in one of {', '.join(FILE_SUFFIXES)} (or be a "
                         "directory datasets can load)")
    if p.is_dir():
        _check_dataset_dir(p, path, field)


# a ``datasets`` directory of data files holds a few split files (or shards of them); more than
# this many files under it is a folder that is not one (``data.path=/tmp``): ``load_dataset``
# would list and type every file under it first (193 s for /tmp on a dev box, then a vague error)
DATASET_DIR_MAX_FILES = 1000
# what ``datasets.load_dataset`` can build a dataset from (its packaged builders) that has columns
_DATASET_DIR_SUFFIXES = (*FILE_SUFFIXES, ".arrow", ".tsv")
# ``save_to_disk`` output: loaded with ``load_from_disk``, no scan
_SAVED_DATASET_MARKERS = ("dataset_dict.json", "state.json")


def _check_dataset_dir(p: Path, path: str, field: str) -> None:
    """A directory as ``data.path``: ``save_to_disk`` output, or at most
    :data:`DATASET_DIR_MAX_FILES` files under it (``datasets`` skips names starting with ``.``
    or ``__``, and so does this count), some of them data files.

    Raises:
        ValueError: naming ``field``, the directory and what it holds.
    """
    if any((p / m).is_file() for m in _SAVED_DATASET_MARKERS):
        return
    seen, data_files = 0, 0
    for _root, dirs, files in os.walk(p):
        dirs[:] = [d for d in dirs if not d.startswith((".", "__"))]
        for f in files:
            if f.startswith((".", "__")):
                continue
            seen += 1
            data_files += Path(f).suffix.lower() in _DATASET_DIR_SUFFIXES
            if seen > DATASET_DIR_MAX_FILES:
                raise ValueError(
                    f"{field}: {path!r} holds more than {DATASET_DIR_MAX_FILES:,} files, so it is not "
                    "a dataset folder (datasets would read every file under it): name the data file, "
                    "or a folder with only the dataset's files (train.jsonl, test.parquet, ...)")
    if data_files == 0:
        raise ValueError(
            f"{field}: the directory {path!r} holds no data file "
            f"({', '.join(_DATASET_DIR_SUFFIXES)}) and is not a datasets save_to_disk folder")


# ----------------------------------------------------------------------------- reading rows
class _DuplicateKey(Exception):
    pass


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict:
    """``json.loads``'s object hook: a key given twice in one object is refused (JSON keeps the
    last one silently: ``{"answer": 4, "answer": 5}`` trained on 5; a graph file refuses it)."""
    out: dict = {}
    for k, v in pairs:
        if k in out:
            raise _DuplicateKey(k)
        out[k] = v
    return out


def _read_jsonl(path: Path) -> tuple[list[dict], Callable[[int], str]]:
    rows, lines = [], []
    with path.open("r", encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:  # without its newline: an unclosed object is reported at the line's end, not
                # at "line 2, column 1" of the one-line string (the column the message gives)
                row = json.loads(line.rstrip("\r\n"), object_pairs_hook=_unique_keys)
            except json.JSONDecodeError as e:
                raise DataError(f"{path} line {lineno}: not valid JSON ({e.msg} at column "
                                f"{e.colno})") from None
            except _DuplicateKey as e:
                raise DataError(f"{path} line {lineno}: field {e.args[0]!r} given twice (JSON "
                                "would keep only the last)") from None
            if not isinstance(row, dict):
                raise DataError(f"{path} line {lineno}: expected a JSON object, got "
                                f"{type(row).__name__}")
            rows.append(row)
            lines.append(lineno)
    return rows, lambda i: f"line {lines[i]}"


def _read_json(path: Path) -> tuple[list[dict], Callable[[int], str]]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"), object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as e:
        raise DataError(f"{path} line {e.lineno}: not valid JSON ({e.msg} at column "
                        f"{e.colno})") from None
    except _DuplicateKey as e:
        raise DataError(f"{path}: field {e.args[0]!r} given twice in one object (JSON would keep "
                        "only the last)") from None
    if not isinstance(data, list):
        raise DataError(f"{path}: expected a JSON array of objects (one per prompt), got "
                        f"{type(data).__name__} (a file of one object per line must end in .jsonl)")
    for i, row in enumerate(data):
        if not isinstance(row, dict):
            raise DataError(f"{path} row {i}: expected a JSON object, got {type(row).__name__}")
    return data, lambda i: f"row {i}"


def _read_csv(path: Path) -> tuple[list[dict], Callable[[int], str]]:
    rows, lines = [], []
    with path.open("r", encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f)
        for row in reader:
            if None in row:  # more cells than header columns
                raise DataError(f"{path} line {reader.line_num}: {len(row) - 1 + len(row[None])} "
                                f"cells for {len(reader.fieldnames or [])} header columns")
            rows.append(row)
            lines.append(reader.line_num)
    return rows, lambda i: f"line {lines[i]}"


def _read_parquet(path: Path) -> tuple[list[dict], Callable[[int], str]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        rows = pq.read_table(path).to_pylist()
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: not a readable parquet file ({_first_line(e)})") from None
    return rows, lambda i: f"row {i}"


def _read_dataset_dir(path: Path, split: str, split_field: str
                      ) -> tuple[list[dict], Callable[[int], str], str]:
    import datasets

    datasets.disable_progress_bars()
    try:
        if (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
            ds = datasets.load_from_disk(str(path))
        else:
            ds = datasets.load_dataset(str(path))
    except Exception as e:  # datasets raises many types; the user needs the first line only
        raise DataError(f"{path}: datasets cannot load this directory ({_first_line(e)})") from None
    if isinstance(ds, (datasets.DatasetDict, datasets.IterableDatasetDict)):
        if split not in ds:
            raise DataError(f"{path} has the splits {sorted(ds)}, not {split!r}: set "
                            f"{split_field} to one of them")
        ds, label = ds[split], f"{path} split {split!r}"
    else:
        label = str(path)
    return ds.to_list(), lambda i: f"row {i}", label


_READERS = {".jsonl": _read_jsonl, ".json": _read_json, ".csv": _read_csv,
            ".parquet": _read_parquet}


def _first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0]


def read_rows(path: str, split: str, split_field: str = "data.split"
              ) -> tuple[list[dict], Callable[[int], str], str]:
    """The raw rows of a data file (``split`` unused: a file is one split) or of split ``split``
    of a ``datasets`` directory.

    Returns:
        ``(rows, where, label)``: rows as dicts, ``where(i)`` = ``"line 7"`` / ``"row 6"`` for
        messages, ``label`` = the file (and split) for messages.

    Raises:
        DataError: unreadable file, malformed line, no such split.
    """
    p = Path(path).expanduser()
    if p.is_dir():
        return _read_dataset_dir(p, split, split_field)
    try:
        rows, where = _READERS[p.suffix.lower()](p)
    except UnicodeDecodeError as e:
        raise DataError(f"{p}: not UTF-8 text (byte {e.start})") from None
    return rows, where, str(p)


# ----------------------------------------------------------------------------- rows -> records
def _text_of(messages: list[dict]) -> str:
    users = [m["content"] for m in messages if m["role"] == "user"]
    return users[-1] if users else messages[-1]["content"]


def _prompt(value: Any, at: str, key: str) -> tuple[Any, str]:
    """(prompt, question) of a row's prompt value; raises DataError naming ``at`` and ``key``."""
    if isinstance(value, str):
        if not value.strip():
            raise DataError(f"{at}: field {key!r} is an empty prompt")
        return value, value
    if isinstance(value, (list, tuple)) and value:
        messages = []
        for j, m in enumerate(value):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                    and isinstance(m.get("content"), str)):
                raise DataError(f"{at}: field {key!r} message {j} must be "
                                f"{{'role': str, 'content': str}}, got {m!r:.80}")
            if m["role"] not in CHAT_ROLES:  # a chat template renders an unknown role silently
                import difflib

                close = difflib.get_close_matches(m["role"], CHAT_ROLES, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise DataError(f"{at}: field {key!r} message {j} has role {m['role']!r}{hint}; "
                                f"allowed roles: {', '.join(CHAT_ROLES)}")
            messages.append({"role": m["role"], "content": m["content"]})
        return messages, _text_of(messages)
    raise DataError(f"{at}: field {key!r} must be a string or a non-empty list of chat messages "
                    f"({{'role', 'content'}}), got {type(value).__name__}")


def _ground_truth(value: Any, at: str, key: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    got = "null" if value is None else type(value).__name__
    raise DataError(f"{at}: field {key!r} (the ground truth) must be a string or a number, got {got}")


def to_records(rows: list[dict], where: Callable[[int], str], label: str, *, prompt_key: str,
               ground_truth_key: Optional[str], extra_keys: tuple[str, ...],
               key_fields: tuple[str, str, str] = ("data.prompt_key", "data.ground_truth_key",
                                                   "data.extra_keys"),
               image_key: Optional[str] = None, image_base: Optional[Path] = None) -> list[dict]:
    """Map raw rows to records (module docstring), checking every row.

    ``image_key`` (``data.image_column``): the column of each row's image(s); every one is opened
    and decoded here (``flowrl.data.images.check_images``, relative paths from ``image_base``)
    and the record gets ``"images"``: its list of sources.

    Raises:
        DataError: no rows; a column missing from the data (named with the config field that
            chose it and the columns there are); a row missing a field or holding a wrong type.
    """
    if not rows:
        raise DataError(f"{label}: no rows")
    wanted = [(prompt_key, key_fields[0])]
    if ground_truth_key is not None:
        wanted.append((ground_truth_key, key_fields[1]))
    wanted += [(k, key_fields[2]) for k in extra_keys]
    if image_key is not None:
        wanted.append((image_key, "data.image_column"))
    for key, field in wanted:  # a wrong column name shows in the first row
        if key not in rows[0]:
            raise DataError(f"{label}: no column {key!r} ({field}); columns: "
                            f"{', '.join(map(str, rows[0])) or 'none'}")
    records: list[dict] = []
    problems: list[tuple[int, str]] = []  # every row's first problem: all said in one go
    for i, row in enumerate(rows):
        try:
            records.append(_record(row, f"{label} {where(i)}", wanted, prompt_key,
                                   ground_truth_key, extra_keys, image_key, image_base))
        except DataError as e:
            problems.append((i, str(e)))
    if problems:
        raise DataError(problems_line(problems, label), problems)
    return records


def _record(row: dict, at: str, wanted: list[tuple[str, str]], prompt_key: str,
            ground_truth_key: Optional[str], extra_keys: tuple[str, ...],
            image_key: Optional[str], image_base: Optional[Path]) -> dict:
    """One row's record (:func:`to_records`); ``at`` names the row in messages."""
    values = {}
    for key, _ in wanted:
        v = row.get(key, _MISSING)
        if v is _MISSING:
            raise DataError(f"{at}: no field {key!r}")
        values[key] = v
    prompt, question = _prompt(values[prompt_key], at, prompt_key)
    truth = "" if ground_truth_key is None else \
        _ground_truth(values[ground_truth_key], at, ground_truth_key)
    record = {"prompt": prompt, "question": question, "ground_truth": truth,
              "fields": {k: values[k] for k in extra_keys}}
    if image_key is not None:
        from flowrl.data.images import ImageError, check_images

        try:
            record["images"] = check_images(values[image_key], at, image_key, image_base)
        except ImageError as e:
            raise DataError(str(e)) from None
    return record


@functools.lru_cache(maxsize=8)
def _cached_records(path: str, stamp: tuple, split: str, split_field: str, prompt_key: str,
                    ground_truth_key: Optional[str], extra_keys: tuple[str, ...],
                    image_key: Optional[str] = None
                    ) -> tuple[tuple[dict, ...], tuple[str, ...]]:
    rows, where, label = read_rows(path, split, split_field)
    base = Path(path) if Path(path).is_dir() else Path(path).parent
    records = to_records(rows, where, label, prompt_key=prompt_key,
                         ground_truth_key=ground_truth_key, extra_keys=extra_keys,
                         image_key=image_key, image_base=base)
    return tuple(records), tuple(f"{label} {where(i)}" for i in range(len(records)))


def load_file_records(path: str, split: str, *, prompt_key: str, ground_truth_key: Optional[str],
                      extra_keys: tuple[str, ...] = (), split_field: str = "data.split",
                      image_key: Optional[str] = None
                      ) -> tuple[tuple[dict, ...], tuple[str, ...]]:
    """Records of a data file or of a split of a ``datasets`` directory, read once per process
    (cached on the path, its modification time and the mapping; do not mutate them).

    Returns:
        ``(records, locations)``: ``locations[i]`` names where record ``i`` came from
        (``"/data/x.jsonl line 7"``) for later messages about it.

    Raises:
        DataError: see :func:`read_rows` and :func:`to_records`.
    """
    p = Path(path).expanduser().resolve()
    st = p.stat()
    return _cached_records(str(p), (st.st_mtime_ns, st.st_size), split, split_field, prompt_key,
                           ground_truth_key, tuple(extra_keys), image_key)
