"""Dataset configs: where prompts (RL) and preference pairs (DPO) come from and how they are templated.

Both read jsonl, json (a list of objects) or parquet files, or folders of them. Consumed by
`mcore_rl.data.PromptDataset` and `mcore_rl.data.PreferenceDataset`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

_BAD_ROW_MODES = ("error", "skip")


@dataclass
class _FileDataConfig:
    """Fields shared by prompt and preference datasets."""

    # Files (.jsonl, .json, .parquet) or folders; a folder contributes its files of those kinds, sorted by name,
    # not recursively. Order matters for reproducibility: the same list gives the same dataset order.
    train_files: list[str] = field(default_factory=list)
    # Optional held-out files, loaded the same way (never shuffled by the sampler unless asked).
    val_files: list[str] = field(default_factory=list)
    # Column holding the prompt: a string, or a list of chat messages [{"role": ..., "content": ...}, ...].
    prompt_key: str = "prompt"
    # Render the prompt with the tokenizer's chat template (add_generation_prompt=True). When False, the prompt
    # must be a string and is tokenised as-is, with the tokenizer's own special tokens (e.g. BOS).
    apply_chat_template: bool = True
    # Prepended as a {"role": "system"} message unless the row's messages already start with one. With
    # apply_chat_template=False it is prepended to the prompt text followed by a blank line.
    system_prompt: str | None = None
    # Prompts longer than this many tokens (after templating) are dropped and counted; None keeps all.
    max_prompt_length: int | None = 1024
    # Reshuffle the order every epoch (seeded by `seed` and the epoch number).
    shuffle: bool = True
    seed: int = 0
    # What a malformed row does: "error" raises a ValueError naming the file and row; "skip" drops and counts it.
    on_bad_row: str = "error"
    # Where `datasets` keeps its Arrow cache when reading parquet files; None uses the HuggingFace default.
    cache_dir: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.train_files, str):
            raise ValueError(
                f"train_files must be a list of paths, got the string {self.train_files!r}; "
                f"write train_files=[{self.train_files!r}]"
            )
        if not self.train_files:
            raise ValueError("train_files is empty; give at least one .jsonl/.json/.parquet file or folder")
        if isinstance(self.val_files, str):
            raise ValueError(f"val_files must be a list of paths, got the string {self.val_files!r}")
        if not self.prompt_key:
            raise ValueError("prompt_key is empty; name the column that holds the prompt")
        if self.max_prompt_length is not None and self.max_prompt_length <= 0:
            raise ValueError(
                f"max_prompt_length ({self.max_prompt_length}) must be positive, or None to keep every prompt"
            )
        if self.on_bad_row not in _BAD_ROW_MODES:
            raise ValueError(f"on_bad_row ({self.on_bad_row!r}) must be one of {_BAD_ROW_MODES}")


@dataclass
class DataConfig(_FileDataConfig):
    """Prompts for RL: each row gives a prompt, optionally a reference answer, and extra fields for the reward."""

    # Column holding the reference answer (string or number, stored as a string in meta["answer"]);
    # None for datasets without answers (e.g. scored by a reward model).
    answer_key: str | None = "answer"
    # Further columns copied into `meta` (and so into Sample.meta for the reward), e.g. ["numbers", "target"].
    meta_keys: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.meta_keys, str):
            raise ValueError(f"meta_keys must be a list of column names, got the string {self.meta_keys!r}")
        # The dataset fills meta["answer"] (from answer_key) and meta["messages"] (the chat messages) itself.
        for reserved in ("answer", "messages"):
            if reserved in self.meta_keys:
                raise ValueError(
                    f"meta_keys contains {reserved!r}, a name the dataset fills itself (meta['answer'] comes from "
                    "answer_key, meta['messages'] holds the prompt's chat messages); remove it from meta_keys"
                )
        if self.prompt_key in self.meta_keys:
            raise ValueError(f"meta_keys contains the prompt column {self.prompt_key!r}; remove it")
        if len(set(self.meta_keys)) != len(self.meta_keys):
            raise ValueError(f"meta_keys has duplicates: {self.meta_keys}")


@dataclass
class PreferenceDataConfig(_FileDataConfig):
    """Preference pairs for DPO: each row gives a prompt and a chosen and a rejected response (strings)."""

    chosen_key: str = "chosen"
    rejected_key: str = "rejected"
    # Pairs whose prompt plus longer response exceeds this many tokens are dropped and counted; None keeps all.
    max_length: int | None = 2048

    def __post_init__(self) -> None:
        super().__post_init__()
        keys = {"prompt_key": self.prompt_key, "chosen_key": self.chosen_key, "rejected_key": self.rejected_key}
        if len(set(keys.values())) != 3:
            raise ValueError(f"prompt_key, chosen_key and rejected_key must differ, got {keys}")
        if self.max_length is not None and self.max_length <= 0:
            raise ValueError(f"max_length ({self.max_length}) must be positive, or None to keep every pair")
        if (
            self.max_length is not None
            and self.max_prompt_length is not None
            and self.max_prompt_length >= self.max_length
        ):
            raise ValueError(
                f"max_prompt_length ({self.max_prompt_length}) must be smaller than max_length ({self.max_length}), "
                "or no response fits"
            )
