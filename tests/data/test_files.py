import json

import datasets
import pytest

from mcore_rl.data.files import BadRowError, RowErrors, RowLocation, iter_rows, resolve_files


def test_resolve_files_expands_folders_sorted_and_keeps_order(tmp_path):
    folder = tmp_path / "shards"
    folder.mkdir()
    for name in ["b.jsonl", "a.parquet", "c.json", "notes.txt"]:
        (folder / name).write_text("")
    single = tmp_path / "z.jsonl"
    single.write_text("")
    files = resolve_files([str(single), str(folder)])
    assert [f.name for f in files] == ["z.jsonl", "a.parquet", "b.jsonl", "c.json"]


def test_resolve_files_errors(tmp_path):
    (tmp_path / "data.csv").write_text("")
    (tmp_path / "empty").mkdir()
    for name, message in [
        ("missing.jsonl", "does not exist"),
        ("data.csv", "unsupported file type '.csv'"),
        ("empty", "holds no .jsonl/.json/.parquet files"),
    ]:
        with pytest.raises(ValueError) as e:
            resolve_files([str(tmp_path / name)])
        assert message in str(e.value) and str(tmp_path / name) in str(e.value)


def test_jsonl_rows_carry_line_numbers_and_blank_lines_count(tmp_path, write_lines):
    path = write_lines(tmp_path / "d.jsonl", [{"a": 1}, "", "   ", {"a": 2}, '{"a": ', "[1, 2]"])
    rows = list(iter_rows(path))
    assert [(w.number, w.kind) for w, _ in rows] == [(1, "line"), (4, "line"), (5, "line"), (6, "line")]
    assert rows[0][1] == {"a": 1} and rows[1][1] == {"a": 2}
    assert rows[2][1].startswith("invalid JSON (Expecting value at column 7)")
    assert rows[3][1] == "expected a JSON object, got list"
    assert str(rows[2][0]) == f"{path}, line 5"


def test_json_file_is_a_list_of_objects(tmp_path):
    path = tmp_path / "d.json"
    path.write_text(json.dumps([{"a": 1}, 3, {"a": 2}]))
    rows = list(iter_rows(path))
    assert [(str(w), r) for w, r in rows] == [
        (f"{path}, row 1", {"a": 1}),
        (f"{path}, row 2", "expected a JSON object, got int"),
        (f"{path}, row 3", {"a": 2}),
    ]
    path.write_text(json.dumps({"a": 1}))
    with pytest.raises(ValueError, match="must hold a list of objects, got dict; for one object per line use .jsonl"):
        list(iter_rows(path))
    path.write_text('[{"a": 1},\n {"a": }]')
    with pytest.raises(ValueError, match=r"d.json: invalid JSON \(Expecting value at line 2, column 8\)"):
        list(iter_rows(path))


def test_parquet_rows_read_through_datasets(tmp_path):
    path = tmp_path / "d.parquet"
    datasets.Dataset.from_list([{"prompt": "p1", "answer": "1"}, {"prompt": "p2", "answer": None}]).to_parquet(path)
    rows = list(iter_rows(path, cache_dir=str(tmp_path / "cache")))
    assert [(str(w), r) for w, r in rows] == [
        (f"{path}, row 1", {"prompt": "p1", "answer": "1"}),
        (f"{path}, row 2", {"prompt": "p2", "answer": None}),
    ]


def test_row_errors_raise_or_count():
    where = RowLocation("f.jsonl", 3, "line")
    with pytest.raises(BadRowError, match=r"^f.jsonl, line 3: missing key 'prompt'; fix the row, or set "
                       r"on_bad_row=skip to skip bad rows$"):
        RowErrors("error").add(where, "missing key 'prompt'")
    skip = RowErrors("skip", max_examples=1)
    skip.add(where, "one")
    skip.add(where, "two")
    assert skip.num_bad_rows == 2 and skip.examples == ["f.jsonl, line 3: one"]
