"""Scoring samples with a HuggingFace sequence-classification reward model (one scalar logit per sequence).

The model and tokenizer come from one local folder (`AutoModelForSequenceClassification`, num_labels=1). What it
reads: when its tokenizer has a chat template and the sample carries meta["messages"] (the prompt's chat
messages, filled by PromptDataset), the conversation messages + {"role": "assistant", "content": response} in
the reward model's own template; otherwise prompt_text + response_text, i.e. the policy's template, which is
right only when the reward model was trained on it. No special tokens are added (templates carry their own).
Too long inputs lose tokens from the left, so the end of the response, where the score is read, stays.
"""

from __future__ import annotations

import threading

from mcore_rl.types import Sample

_DTYPES = ("float32", "bfloat16", "float16")


class RewardModelScorer:
    def __init__(
        self,
        path: str,
        *,
        device: str = "cpu",
        dtype: str = "float32",
        batch_size: int = 8,
        max_length: int = 4096,
        use_chat_template: bool = True,
    ):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        if dtype not in _DTYPES:
            raise ValueError(f"dtype ({dtype!r}) must be one of {_DTYPES}")
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForSequenceClassification.from_pretrained(path, dtype=getattr(torch, dtype))
        if self.model.config.num_labels != 1:
            raise ValueError(
                f"reward model {path} has num_labels={self.model.config.num_labels}; a reward model gives one "
                "scalar, so it needs num_labels=1"
            )
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        if self.tokenizer.pad_token is None:
            raise ValueError(f"reward model tokenizer in {path} has neither a pad nor an eos token to pad with")
        # The classification head reads the last non-pad token, found through config.pad_token_id.
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.tokenizer.padding_side = "right"
        self.tokenizer.truncation_side = "left"
        self.model.to(device).eval()
        self.device = device
        self.batch_size = batch_size
        self.max_length = max_length
        self.use_chat_template = use_chat_template and self.tokenizer.chat_template is not None
        self._lock = threading.Lock()  # one forward at a time when the manager calls from several threads

    def text(self, sample: Sample) -> str:
        messages = sample.meta.get("messages")
        if self.use_chat_template and isinstance(messages, list):
            conversation = [*messages, {"role": "assistant", "content": sample.response_text}]
            return self.tokenizer.apply_chat_template(conversation, tokenize=False)
        return sample.prompt_text + sample.response_text

    def score_texts(self, texts: list[str]) -> list[float]:
        """The scalar logit of each text, in batches of batch_size."""
        import torch

        scores: list[float] = []
        with self._lock, torch.inference_mode():
            for start in range(0, len(texts), self.batch_size):
                batch = self.tokenizer(
                    texts[start : start + self.batch_size],
                    padding=True,
                    truncation=True,
                    max_length=self.max_length,
                    add_special_tokens=False,  # chat templates and the policy's prompt_text carry their own
                    return_tensors="pt",
                ).to(self.device)
                logits_B1 = self.model(**batch).logits
                scores.extend(logits_B1[:, 0].float().cpu().tolist())
        return scores

    def __call__(self, samples: list[Sample]) -> list[float]:
        return self.score_texts([self.text(s) for s in samples])
