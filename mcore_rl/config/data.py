"""Dataset configs: where prompts (RL) and preference pairs (DPO) come from and how they are templated.

Both read jsonl, json (a list of objects) or parquet files, or folders of them. Consumed by
`mcore_rl.data.PromptDataset` and `mcore_rl.data.PreferenceDataset`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import MISSING

_BAD_ROW_MODES = ("error", "skip")


@dataclass
class _FileDataConfig:
    """Fields shared by prompt and preference datasets."""

    train_files: list[str] = MISSING
    """Training files (.jsonl, .json = a list of objects, .parquet) or folders; a folder contributes its files of
    those kinds, sorted by name, not recursively. Must not be empty; write a list (train_files=[a.jsonl]), not a
    string. Order matters for reproducibility: the same list gives the same dataset order."""
    val_files: list[str] = field(default_factory=list)
    """Held-out files, read the same way by the dataset's split="val" (empty = no validation split). The trainer
    does not evaluate on them during a run."""
    prompt_key: str = "prompt"
    """Column holding the prompt: a string, or a list of chat messages [{"role": ..., "content": ...}, ...]."""
    apply_chat_template: bool = True
    """Render the prompt with the tokenizer's chat template (add_generation_prompt=True). false: the prompt must be
    a string and is tokenised as-is, with the tokenizer's own special tokens (e.g. BOS); for base models without a
    chat template."""
    system_prompt: str | None = None
    """Prepended as a {"role": "system"} message unless the row's messages already start with one; with
    apply_chat_template=false, prepended to the prompt text followed by a blank line. null = none."""
    max_prompt_length: int | None = 1024
    """Prompts longer than this many tokens (after templating) are dropped and counted; null keeps all. Keep
    it + rollout.max_new_tokens within model.max_seq_len."""
    shuffle: bool = True
    """Reshuffle the order every epoch (seeded by `seed` and the epoch number); false reads the files in order."""
    seed: int = 0
    """Seed of the sampler's shuffle (with the epoch number); change it for a different prompt order. Megatron
    is seeded by parallel.seed and SGLang's sampling by rollout.random_seed."""
    on_bad_row: str = "error"
    """What a malformed row does: error raises a ValueError naming the file and row; skip drops and counts it."""
    cache_dir: str | None = None
    """Where `datasets` keeps its Arrow cache when reading parquet files; null = the HuggingFace default."""

    def __post_init__(self) -> None:
        if self.train_files == MISSING:  # required: OmegaConf's to_object names it if it is still unset
            pass
        elif isinstance(self.train_files, str):
            raise ValueError(
                f"train_files must be a list of paths, got the string {self.train_files!r}; "
                f"write train_files=[{self.train_files!r}]"
            )
        elif not self.train_files:
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

    answer_key: str | None = "answer"
    """Column holding the reference answer (string or number, stored as a string in meta["answer"]); null for
    datasets without answers (e.g. scored by a reward model)."""
    meta_keys: list[str] = field(default_factory=list)
    """Further columns copied into `meta` (and so into Sample.meta for the reward), e.g. [numbers, target] for
    the countdown reward. Not "answer", "messages" or the prompt column (the dataset fills those itself)."""

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
    """Column holding the preferred response (a string)."""
    rejected_key: str = "rejected"
    """Column holding the dispreferred response (a string)."""
    max_length: int | None = 2048
    """Pairs whose prompt plus longer response exceeds this many tokens are dropped and counted; null keeps all.
    Must be larger than max_prompt_length."""

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
