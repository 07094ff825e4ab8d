"""Datasets for RL prompts and DPO pairs: file reading with row-precise errors, chat templating, tokenising,
length filtering, and a resumable seeded batch sampler. Synthetic tasks live in `mcore_rl.data.synthetic`."""

from mcore_rl.data.files import BadRowError, RowLocation, resolve_files
from mcore_rl.data.preference import PreferenceDataset, PreferenceItem, load_preference_dataset
from mcore_rl.data.prompts import DatasetStats, PromptDataset, PromptItem, load_prompt_dataset
from mcore_rl.data.sampler import EpochSampler, shard_batch

__all__ = [
    "BadRowError",
    "DatasetStats",
    "EpochSampler",
    "PreferenceDataset",
    "PreferenceItem",
    "PromptDataset",
    "PromptItem",
    "RowLocation",
    "load_preference_dataset",
    "load_prompt_dataset",
    "resolve_files",
    "shard_batch",
]
