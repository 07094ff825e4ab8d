import pytest

from mcore_rl.config.data import PreferenceDataConfig
from mcore_rl.data import EpochSampler, load_preference_dataset

ROWS = [
    {"prompt": "What is 1 + 1?", "chosen": "1 + 1 = 2. #### 2", "rejected": "1 + 1 = 3. #### 3"},
    {"prompt": "What is 2 + 2?", "chosen": "#### 4<|end|>", "rejected": "#### 5"},
]


def load(tmp_path, write_lines, tokenizer, rows=ROWS, **cfg):
    path = write_lines(tmp_path / "pairs.jsonl", rows)
    return load_preference_dataset(PreferenceDataConfig(train_files=[str(path)], **cfg), tokenizer), path


def test_pairs_tokenise_prompt_chosen_rejected_with_eos(tmp_path, write_lines, tokenizer):
    dataset, path = load(tmp_path, write_lines, tokenizer)
    eos = tokenizer.eos_token_id
    first = dataset[0]
    assert first.prompt_text == "<|user|>What is 1 + 1?<|end|><|assistant|>"
    assert first.prompt_ids == tokenizer(first.prompt_text, add_special_tokens=False)["input_ids"]
    assert first.chosen_ids == tokenizer("1 + 1 = 2. #### 2", add_special_tokens=False)["input_ids"] + [eos]
    assert first.rejected_ids == tokenizer("1 + 1 = 3. #### 3", add_special_tokens=False)["input_ids"] + [eos]
    # A response that already ends with EOS does not get a second one.
    assert dataset[1].chosen_ids == tokenizer("#### 4", add_special_tokens=False)["input_ids"] + [eos]
    assert dataset[1].source == f"{path}, line 2"


@pytest.mark.parametrize(
    "row, problem",
    [
        ({"prompt": "q", "chosen": "a"}, "missing key 'rejected' (row has ['chosen', 'prompt'])"),
        ({"prompt": "q", "chosen": 1, "rejected": "b"}, "'chosen' must be a string, got int"),
        ({"prompt": "q", "chosen": "a", "rejected": " "}, "'rejected' is empty"),
        ({"prompt": "", "chosen": "a", "rejected": "b"}, "'prompt' is empty"),
    ],
)
def test_bad_pair_names_file_and_line(tmp_path, write_lines, tokenizer, row, problem):
    with pytest.raises(ValueError) as e:
        load(tmp_path, write_lines, tokenizer, rows=[ROWS[0], row])
    assert str(e.value) == (f"{tmp_path / 'pairs.jsonl'}, line 2: {problem}; fix the row, or set on_bad_row=skip "
                            "to skip bad rows")


def test_skip_mode_and_length_filter_count(tmp_path, write_lines, tokenizer):
    rows = [ROWS[0], {"prompt": "q"}, ROWS[1], {"prompt": "q", "chosen": "a " * 300, "rejected": "b"}]
    limits = dict(max_prompt_length=64, max_length=128)
    dataset, _ = load(tmp_path, write_lines, tokenizer, rows=rows, on_bad_row="skip", **limits)
    s = dataset.stats
    assert (len(dataset), s.num_rows, s.num_bad_rows, s.num_too_long) == (2, 4, 1, 1)
    assert [item.index for item in dataset] == [0, 1]


def test_preference_sampler_resumes(tmp_path, write_lines, tokenizer):
    rows = [{"prompt": f"q{i}", "chosen": f"a{i}", "rejected": f"b{i}"} for i in range(7)]
    dataset, _ = load(tmp_path, write_lines, tokenizer, rows=rows)
    uninterrupted = EpochSampler(dataset, 3, seed=4)
    stream = [uninterrupted.next_batch() for _ in range(5)]
    first = EpochSampler(dataset, 3, seed=4)
    head = [first.next_batch() for _ in range(2)]
    resumed = EpochSampler(dataset, 3, seed=4)
    resumed.load_state_dict(first.state_dict())
    assert head + [resumed.next_batch() for _ in range(3)] == stream
