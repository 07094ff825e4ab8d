"""Rewards from an HTTP service.

Protocol: POST `url` with the JSON body

    {"samples": [{"prompt": prompt_text, "response": response_text, "meta": {...}}, ...]}

and expect 200 with {"rewards": [float, ...]}, one finite number per sample, in order.

Retries: connection errors, timeouts (`timeout_s` per connect and per read), HTTP 429 and 5xx are retried up
to `max_retries` times, waiting backoff_s * 2**attempt (capped at backoff_max_s, times a random factor in
[0.5, 1] so that many clients do not retry in step). Other HTTP errors and malformed answers are not retried:
they mean the request or the service is wrong, and repeating it would only slow the run down.
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from typing import TYPE_CHECKING, Any

from mcore_rl.types import Sample

if TYPE_CHECKING:
    import requests

logger = logging.getLogger(__name__)


class RemoteRewardError(RuntimeError):
    pass


class RemoteReward:
    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 30.0,
        max_retries: int = 3,
        backoff_s: float = 1.0,
        backoff_max_s: float = 30.0,
        headers: dict[str, str] | None = None,
    ):
        self.url = url
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self.headers = {"Content-Type": "application/json", **(headers or {})}

    def __call__(self, samples: list[Sample]) -> list[float]:
        payload = [{"prompt": s.prompt_text, "response": s.response_text, "meta": s.meta} for s in samples]
        return self.score(payload)

    def score(self, payload: list[dict[str, Any]]) -> list[float]:
        """POST the samples (with retries) and return the validated rewards."""
        import requests

        body = json.dumps({"samples": payload}, default=_to_json).encode()
        attempts = self.max_retries + 1
        for attempt in range(attempts):
            try:
                response = requests.post(self.url, data=body, headers=self.headers, timeout=self.timeout_s)
            except (requests.ConnectionError, requests.Timeout) as e:
                problem = f"{type(e).__name__}: {e}"
            else:
                if response.status_code == 200:
                    return self._parse(response, len(payload))
                problem = f"HTTP {response.status_code}: {response.text[:200]!r}"
                if response.status_code != 429 and response.status_code < 500:
                    raise RemoteRewardError(f"reward service {self.url} refused the request: {problem}")
            if attempt + 1 < attempts:
                delay = min(self.backoff_max_s, self.backoff_s * 2**attempt) * random.uniform(0.5, 1.0)
                logger.warning(
                    "reward service %s: %s; retry %d/%d in %.2fs",
                    self.url, problem, attempt + 1, self.max_retries, delay,
                )  # fmt: skip
                time.sleep(delay)
        raise RemoteRewardError(f"reward service {self.url} failed after {attempts} attempts; last error: {problem}")

    def _parse(self, response: requests.Response, num_samples: int) -> list[float]:
        try:
            data = response.json()
        except ValueError:
            raise RemoteRewardError(
                f"reward service {self.url} returned malformed JSON: {response.text[:200]!r}"
            ) from None
        rewards = data.get("rewards") if isinstance(data, dict) else None
        if not isinstance(rewards, list) or len(rewards) != num_samples:
            raise RemoteRewardError(
                f'reward service {self.url} must return {{"rewards": [...]}} with {num_samples} numbers, '
                f"got {str(data)[:200]}"
            )
        for r in rewards:
            if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r):
                raise RemoteRewardError(f"reward service {self.url} returned a non-numeric reward {r!r}")
        return [float(r) for r in rewards]


def _to_json(value: Any) -> Any:
    """numpy scalars and arrays in meta become plain numbers and lists; anything else its str()."""
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)
