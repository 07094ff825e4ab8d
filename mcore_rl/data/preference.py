"""DPO preference datasets: rows of (prompt, chosen, rejected) -> prompt ids + chosen ids + rejected ids.

The prompt is templated like an RL prompt (chat template with add_generation_prompt=True). Each response is
tokenised on its own, without special tokens, and ends with the tokenizer's EOS (appended unless already there),
so `prompt_ids + chosen_ids` is the full chosen sequence. Tokenising the response separately can split the text
at the prompt/response boundary differently from tokenising the concatenation; it matches what the policy
generates after the prompt, which is what DPO compares.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, overload

from mcore_rl.config.data import PreferenceDataConfig
from mcore_rl.data.files import RowErrors, files_for_split, iter_rows, resolve_files
from mcore_rl.data.prompts import DatasetStats
from mcore_rl.data.templating import RowProblem, check_prompt, check_text, encode, render_prompt, require_chat_template

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PreferenceItem:
    index: int  # position in the dataset (after filtering)
    prompt_ids: list[int]
    chosen_ids: list[int]  # ends with EOS
    rejected_ids: list[int]  # ends with EOS
    prompt_text: str
    source: str  # "file, line N" / "file, row N"


class PreferenceDataset(Sequence[PreferenceItem]):
    def __init__(self, items: list[PreferenceItem], stats: DatasetStats):
        self.items = items
        self.stats = stats

    def __len__(self) -> int:
        return len(self.items)

    @overload
    def __getitem__(self, i: int) -> PreferenceItem: ...
    @overload
    def __getitem__(self, i: slice) -> list[PreferenceItem]: ...
    def __getitem__(self, i):
        return self.items[i]

    def __iter__(self) -> Iterator[PreferenceItem]:
        return iter(self.items)


def load_preference_dataset(cfg: PreferenceDataConfig, tokenizer: Any, split: str = "train") -> PreferenceDataset:
    """Read, validate, template, tokenise and length-filter the preference files of `split`."""
    files = files_for_split(cfg.train_files, cfg.val_files, split)
    if cfg.apply_chat_template:
        require_chat_template(tokenizer)
    eos = tokenizer.eos_token_id
    if eos is None:
        name = getattr(tokenizer, "name_or_path", "?")
        raise ValueError(f"tokenizer {name} has no eos_token; DPO responses end with one")

    stats = DatasetStats()
    errors = RowErrors(cfg.on_bad_row)
    prompts: list[str] = []
    chosen: list[str] = []
    rejected: list[str] = []
    sources: list[str] = []
    for path in resolve_files(files):
        for where, row in iter_rows(path, cfg.cache_dir):
            stats.num_rows += 1
            try:
                if isinstance(row, str):
                    raise RowProblem(row)
                prompt = check_prompt(row, cfg.prompt_key, cfg.apply_chat_template)
                good, bad = check_text(row, cfg.chosen_key), check_text(row, cfg.rejected_key)
                text, _ = render_prompt(tokenizer, prompt, cfg.system_prompt, cfg.apply_chat_template)
            except RowProblem as problem:
                errors.add(where, str(problem))
                continue
            prompts.append(text)
            chosen.append(good)
            rejected.append(bad)
            sources.append(str(where))

    prompt_ids = encode(tokenizer, prompts, add_special_tokens=not cfg.apply_chat_template)
    chosen_ids = [_with_eos(ids, eos) for ids in encode(tokenizer, chosen, add_special_tokens=False)]
    rejected_ids = [_with_eos(ids, eos) for ids in encode(tokenizer, rejected, add_special_tokens=False)]
    items: list[PreferenceItem] = []
    for text, p, c, r, source in zip(prompts, prompt_ids, chosen_ids, rejected_ids, sources, strict=True):
        too_long_prompt = cfg.max_prompt_length is not None and len(p) > cfg.max_prompt_length
        too_long_pair = cfg.max_length is not None and len(p) + max(len(c), len(r)) > cfg.max_length
        if too_long_prompt or too_long_pair:
            stats.num_too_long += 1
            continue
        items.append(PreferenceItem(len(items), p, c, r, text, source))

    stats.num_bad_rows = errors.num_bad_rows
    stats.bad_row_examples = errors.examples
    logger.info(
        "%s preference pairs: %d rows read, %d kept, %d malformed rows skipped, %d too long dropped",
        split, stats.num_rows, stats.num_kept, stats.num_bad_rows, stats.num_too_long,
    )  # fmt: skip
    if not items:
        raise ValueError(
            f"no usable preference pairs in {files}: {stats.num_rows} rows, {stats.num_bad_rows} malformed, "
            f"{stats.num_too_long} over max_prompt_length={cfg.max_prompt_length} / max_length={cfg.max_length}"
        )
    return PreferenceDataset(items, stats)


def _with_eos(ids: list[int], eos: int) -> list[int]:
    return ids if ids and ids[-1] == eos else [*ids, eos]
