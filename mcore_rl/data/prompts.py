"""RL prompt datasets: rows -> validated, chat-templated, tokenised prompts with their answers and reward fields.

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    cfg = DataConfig(train_files=["data/train.jsonl"])
    dataset = load_prompt_dataset(cfg, tokenizer)
    sampler = EpochSampler(dataset, batch_size=64, shuffle=cfg.shuffle, seed=cfg.seed)
    items = sampler.next_batch()          # list[PromptItem]; sampler.state_dict() goes into checkpoints

Every DP rank builds the same dataset and sampler and so draws the same global batch; see `shard_batch`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, overload

from mcore_rl.config.data import DataConfig
from mcore_rl.data.files import RowErrors, files_for_split, iter_rows, resolve_files
from mcore_rl.data.templating import (
    RowProblem,
    check_answer,
    check_present,
    check_prompt,
    encode,
    render_prompt,
    require_chat_template,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PromptItem:
    """One prompt, ready for the rollout engine and, through `meta`, for the reward function."""

    index: int  # position in the dataset (after filtering); stable for the same files and config
    prompt_ids: list[int]
    prompt_text: str  # the templated text; prompt_ids are its tokens
    # meta["answer"]: the reference answer as a string (when answer_key is set);
    # meta["messages"]: the chat messages before templating (when apply_chat_template), for reward models
    # that apply their own template; plus the columns named in meta_keys. Goes into Sample.meta as it is.
    meta: dict[str, Any]
    source: str  # "file, line N" / "file, row N", for debugging


@dataclass
class DatasetStats:
    """What loading kept and dropped; log it once after loading."""

    num_rows: int = 0  # rows read, good or bad
    num_bad_rows: int = 0  # malformed rows skipped (on_bad_row="skip")
    num_too_long: int = 0  # rows dropped by the length limit
    bad_row_examples: list[str] = field(default_factory=list)

    @property
    def num_kept(self) -> int:
        return self.num_rows - self.num_bad_rows - self.num_too_long


class PromptDataset(Sequence[PromptItem]):
    """An in-memory list of PromptItems plus the statistics of how it was loaded."""

    def __init__(self, items: list[PromptItem], stats: DatasetStats):
        self.items = items
        self.stats = stats

    def __len__(self) -> int:
        return len(self.items)

    @overload
    def __getitem__(self, i: int) -> PromptItem: ...
    @overload
    def __getitem__(self, i: slice) -> list[PromptItem]: ...
    def __getitem__(self, i):
        return self.items[i]

    def __iter__(self) -> Iterator[PromptItem]:
        return iter(self.items)


def load_prompt_dataset(cfg: DataConfig, tokenizer: Any, split: str = "train",
                        tools: list[dict] | None = None) -> PromptDataset:
    """Read, validate, template, tokenise and length-filter the files of `split` ("train" or "val"). tools: the
    chat template's `tools=` list (an agent task's tool schemas), or None."""
    files = files_for_split(cfg.train_files, cfg.val_files, split)
    if cfg.apply_chat_template:
        require_chat_template(tokenizer)
    stats = DatasetStats()
    errors = RowErrors(cfg.on_bad_row)
    texts: list[str] = []
    metas: list[dict[str, Any]] = []
    sources: list[str] = []
    for path in resolve_files(files):
        for where, row in iter_rows(path, cfg.cache_dir):
            stats.num_rows += 1
            try:
                if isinstance(row, str):
                    raise RowProblem(row)
                text, meta = _prepare_row(row, cfg, tokenizer, tools)
            except RowProblem as problem:
                errors.add(where, str(problem))
                continue
            texts.append(text)
            metas.append(meta)
            sources.append(str(where))

    # Chat templates carry their own special tokens (BOS etc.); raw prompts get the tokenizer's.
    all_ids = encode(tokenizer, texts, add_special_tokens=not cfg.apply_chat_template)
    items: list[PromptItem] = []
    for text, ids, meta, source in zip(texts, all_ids, metas, sources, strict=True):
        if cfg.max_prompt_length is not None and len(ids) > cfg.max_prompt_length:
            stats.num_too_long += 1
            continue
        items.append(PromptItem(len(items), ids, text, meta, source))

    stats.num_bad_rows = errors.num_bad_rows
    stats.bad_row_examples = errors.examples
    _log_stats(split, stats, cfg.max_prompt_length)
    if not items:
        raise ValueError(
            f"no usable prompts in {files}: {stats.num_rows} rows, {stats.num_bad_rows} malformed, "
            f"{stats.num_too_long} longer than max_prompt_length={cfg.max_prompt_length}; point the data's "
            "train_files at a file with prompts, or raise max_prompt_length"
        )
    return PromptDataset(items, stats)


def _prepare_row(row: dict[str, Any], cfg: DataConfig, tokenizer: Any,
                 tools: list[dict] | None = None) -> tuple[str, dict[str, Any]]:
    prompt = check_prompt(row, cfg.prompt_key, cfg.apply_chat_template)
    meta: dict[str, Any] = {}
    if cfg.answer_key is not None:
        meta["answer"] = check_answer(row, cfg.answer_key)
    for key in cfg.meta_keys:
        meta[key] = check_present(row, key)
    text, messages = render_prompt(tokenizer, prompt, cfg.system_prompt, cfg.apply_chat_template, tools)
    if messages is not None:
        meta["messages"] = messages
    return text, meta


def _log_stats(split: str, stats: DatasetStats, limit: int | None) -> None:
    logger.info(
        "%s prompts: %d rows read, %d kept, %d malformed rows skipped, %d longer than %s tokens dropped",
        split, stats.num_rows, stats.num_kept, stats.num_bad_rows, stats.num_too_long, limit,
    )  # fmt: skip
