import json
import logging

import datasets
import pytest

from mcore_rl.config.data import DataConfig
from mcore_rl.data import BadRowError, load_prompt_dataset

ROWS = [
    {"prompt": "What is 1 + 1?", "answer": "2"},
    {"prompt": "What is 12 + 7?", "answer": 19, "source": "synthetic"},
    {
        "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 3 * 4?"}],
        "answer": "12",
    },
]

FIX = "; fix the row, or set on_bad_row=skip to skip bad rows"  # what every bad-row error ends with


def load(tmp_path, write_lines, tokenizer, rows=ROWS, **cfg):
    path = write_lines(tmp_path / "train.jsonl", rows)
    return load_prompt_dataset(DataConfig(train_files=[str(path)], **cfg), tokenizer), path


def test_chat_template_is_applied_with_generation_prompt(tmp_path, write_lines, tokenizer):
    dataset, path = load(tmp_path, write_lines, tokenizer)
    assert len(dataset) == 3
    # The template, written out by hand: <|role|>content<|end|> per message, then the assistant marker.
    assert [item.prompt_text for item in dataset] == [
        "<|user|>What is 1 + 1?<|end|><|assistant|>",
        "<|user|>What is 12 + 7?<|end|><|assistant|>",
        "<|system|>Be brief.<|end|><|user|>What is 3 * 4?<|end|><|assistant|>",
    ]
    for item in dataset:
        assert item.prompt_ids == tokenizer(item.prompt_text, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(item.prompt_ids) == item.prompt_text
    assert dataset[0].prompt_ids[0] == tokenizer.convert_tokens_to_ids("<|user|>")
    assert dataset[0].prompt_ids[-1] == tokenizer.convert_tokens_to_ids("<|assistant|>")
    assert [item.index for item in dataset] == [0, 1, 2]
    assert dataset[1].source == f"{path}, line 2"


def test_meta_holds_answer_as_string_messages_and_extra_keys(tmp_path, write_lines, tokenizer):
    rows = [{**row, "source": f"s{i}"} for i, row in enumerate(ROWS)]
    dataset, _ = load(tmp_path, write_lines, tokenizer, rows=rows, meta_keys=["source"])
    assert dataset[1].meta == {
        "answer": "19",
        "source": "s1",
        "messages": [{"role": "user", "content": "What is 12 + 7?"}],
    }
    assert dataset[2].meta["messages"][0] == {"role": "system", "content": "Be brief."}


def test_system_prompt_is_prepended_unless_the_row_has_one(tmp_path, write_lines, tokenizer):
    dataset, _ = load(tmp_path, write_lines, tokenizer, system_prompt="Think step by step.")
    assert dataset[0].prompt_text == "<|system|>Think step by step.<|end|><|user|>What is 1 + 1?<|end|><|assistant|>"
    assert dataset[2].prompt_text.startswith("<|system|>Be brief.<|end|><|user|>")


def test_raw_prompts_without_chat_template(tmp_path, write_lines, plain_tokenizer):
    rows = ROWS[:2]
    dataset, _ = load(tmp_path, write_lines, plain_tokenizer, rows=rows, apply_chat_template=False, system_prompt="Hi.")
    assert dataset[0].prompt_text == "Hi.\n\nWhat is 1 + 1?"
    assert dataset[0].prompt_ids == plain_tokenizer("Hi.\n\nWhat is 1 + 1?")["input_ids"]
    assert "messages" not in dataset[0].meta


def test_missing_chat_template_is_a_clear_error(tmp_path, write_lines, plain_tokenizer):
    with pytest.raises(ValueError, match="has no chat_template; set apply_chat_template=false"):
        load(tmp_path, write_lines, plain_tokenizer)


def test_no_answer_column(tmp_path, write_lines, tokenizer):
    dataset, _ = load(tmp_path, write_lines, tokenizer, rows=[{"prompt": "hello"}], answer_key=None)
    assert dataset[0].meta == {"messages": [{"role": "user", "content": "hello"}]}


@pytest.mark.parametrize(
    "bad_line, problem",
    [
        ({"answer": "1"}, "missing key 'prompt' (row has ['answer'])"),
        ({"prompt": "   ", "answer": "1"}, "'prompt' is empty"),
        ({"prompt": 5, "answer": "1"}, "'prompt' must be a string or a list of chat messages, got int"),
        ({"prompt": None, "answer": "1"}, "'prompt' is null"),
        ({"prompt": [], "answer": "1"}, "'prompt' is an empty list of messages"),
        (
            {"prompt": [{"role": "user"}], "answer": "1"},
            "'prompt' message 0 must be an object with string 'role' and 'content', got {'role': 'user'}",
        ),
        ({"prompt": "q"}, "missing key 'answer' (row has ['prompt'])"),
        ({"prompt": "q", "answer": ["1"]}, "'answer' must be a string or a number, got list"),
        ({"prompt": "q", "answer": True}, "'answer' must be a string or a number, got bool"),
        ({"prompt": "q", "answer": ""}, "'answer' is empty"),
        ('{"prompt": "q", "answer": "1"', "invalid JSON (Expecting ',' delimiter at column 30)"),
        ("[1]", "expected a JSON object, got list"),
    ],
)
def test_bad_row_error_names_file_line_and_problem(tmp_path, write_lines, tokenizer, bad_line, problem):
    rows = [ROWS[0], "", bad_line, ROWS[1]]  # the blank line still counts: the bad row is on line 3
    with pytest.raises(BadRowError) as e:
        load(tmp_path, write_lines, tokenizer, rows=rows)
    assert str(e.value) == f"{tmp_path / 'train.jsonl'}, line 3: {problem}" + FIX


def test_message_list_without_chat_template_is_a_bad_row(tmp_path, write_lines, plain_tokenizer):
    with pytest.raises(ValueError, match=r"line 3: 'prompt' is a list of chat messages, which needs a chat template"):
        load(tmp_path, write_lines, plain_tokenizer, apply_chat_template=False)


def test_missing_meta_key_is_a_bad_row(tmp_path, write_lines, tokenizer):
    with pytest.raises(ValueError, match=r"train.jsonl, line 1: missing key 'numbers'"):
        load(tmp_path, write_lines, tokenizer, meta_keys=["numbers"])


def test_skip_mode_drops_and_counts_bad_rows(tmp_path, write_lines, tokenizer, caplog):
    rows = [ROWS[0], {"answer": "1"}, "not json", ROWS[1], {"prompt": "", "answer": "3"}]
    with caplog.at_level(logging.WARNING, logger="mcore_rl.data"):
        dataset, path = load(tmp_path, write_lines, tokenizer, rows=rows, on_bad_row="skip")
    assert [item.meta["answer"] for item in dataset] == ["2", "19"]
    assert [item.source for item in dataset] == [f"{path}, line 1", f"{path}, line 4"]
    stats = dataset.stats
    assert (stats.num_rows, stats.num_bad_rows, stats.num_too_long, stats.num_kept) == (5, 3, 0, 2)
    assert stats.bad_row_examples[0] == f"{path}, line 2: missing key 'prompt' (row has ['answer'])"
    assert "line 3: invalid JSON" in stats.bad_row_examples[1]
    assert sum("skipping bad row" in r.message for r in caplog.records) == 3


def test_length_filter_drops_and_counts(tmp_path, write_lines, tokenizer):
    full, _ = load(tmp_path, write_lines, tokenizer)
    lengths = [len(item.prompt_ids) for item in full]
    limit = sorted(lengths)[1]  # keeps the two shortest
    dataset, _ = load(tmp_path, write_lines, tokenizer, max_prompt_length=limit)
    assert len(dataset) == sum(n <= limit for n in lengths) == 2
    assert dataset.stats.num_too_long == 1 and dataset.stats.num_rows == 3
    assert all(len(item.prompt_ids) <= limit for item in dataset)
    assert [item.index for item in dataset] == [0, 1]  # indices are positions after filtering
    with pytest.raises(ValueError, match="no usable prompts .* 3 longer than max_prompt_length=1"):
        load(tmp_path, write_lines, tokenizer, max_prompt_length=1)


def test_json_parquet_and_folders_load_like_jsonl(tmp_path, write_lines, tokenizer):
    simple = [{"prompt": r["prompt"], "answer": str(r["answer"])} for r in ROWS[:2]]
    reference, _ = load(tmp_path, write_lines, tokenizer, rows=simple)
    folder = tmp_path / "shards"
    folder.mkdir()
    (folder / "a.json").write_text(json.dumps(simple[:1]))
    datasets.Dataset.from_list(simple[1:]).to_parquet(folder / "b.parquet")
    cfg = DataConfig(train_files=[str(folder)], cache_dir=str(tmp_path / "cache"))
    dataset = load_prompt_dataset(cfg, tokenizer)
    assert [(i.prompt_ids, i.prompt_text, i.meta) for i in dataset] == [
        (i.prompt_ids, i.prompt_text, i.meta) for i in reference
    ]
    assert dataset[1].source == f"{folder / 'b.parquet'}, row 1"


def test_parquet_bad_row_names_file_and_row(tmp_path, tokenizer):
    path = tmp_path / "d.parquet"
    datasets.Dataset.from_list([{"prompt": "q", "answer": "1"}, {"prompt": "q", "answer": None}]).to_parquet(path)
    with pytest.raises(ValueError) as e:
        load_prompt_dataset(DataConfig(train_files=[str(path)], cache_dir=str(tmp_path / "c")), tokenizer)
    assert str(e.value) == f"{path}, row 2: 'answer' is null" + FIX


def test_val_split(tmp_path, write_lines, tokenizer):
    train = write_lines(tmp_path / "train.jsonl", ROWS[:1])
    val = write_lines(tmp_path / "val.jsonl", ROWS[1:])
    cfg = DataConfig(train_files=[str(train)], val_files=[str(val)])
    assert len(load_prompt_dataset(cfg, tokenizer, split="val")) == 2
    with pytest.raises(ValueError, match="val_files is empty"):
        load_prompt_dataset(DataConfig(train_files=[str(train)]), tokenizer, split="val")
