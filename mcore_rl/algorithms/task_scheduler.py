"""Task weights for multi-task training of one actor, and which tasks train at each step.

Weights. Every task i has a base weight b_i (config). With `weighting="fixed"` its weight is b_i. With
`weighting="auto"` the scheduler keeps each task's last `window` losses and, once every task has at least
`min_history` of them, sets

    s_i   = standard deviation (population) of task i's recent losses
    m_i   = clamp(s_i / mean_j(s_j), min_multiplier, max_multiplier)      (m_i = 1 for all i if every s_j = 0)
    w_i  <- smoothing * w_i + (1 - smoothing) * b_i * m_i

so a task whose loss fluctuates more than the others' gets proportionally more weight, within the bounds, and
the weights move gradually. The rule sees raw losses: tasks on very different loss scales should have their base
weights set with that in mind (a DPO loss is ~0.7 at the start, a normalised-advantage GRPO loss is ~0).

Steps. `combine="weighted_sum"`: every task trains every step; the trainer combines the (per-task clipped)
gradients as sum_i (w_i / sum_j w_j) g_i. `combine="alternating"`: one task a step, chosen by smooth weighted
round-robin (each step every task's credit grows by its weight, the task with the most credit trains and pays
back the sum of the weights; ties go to the earlier task), so over N steps task i trains N w_i / sum w times, as
evenly spread as possible, and deterministically.

The whole state (weights, loss windows, credits) is plain floats: `state_dict` / `load_state_dict` restore it
exactly, so a resumed run picks the same tasks and weights as an uninterrupted one.
"""

from __future__ import annotations

import math
from typing import Any, Sequence


class TaskScheduler:
    def __init__(self, names: Sequence[str], base_weights: Sequence[float], *, combine: str = "weighted_sum",
                 weighting: str = "fixed", window: int = 8, min_history: int = 3, min_multiplier: float = 0.25,
                 max_multiplier: float = 4.0, smoothing: float = 0.5):
        if len(names) != len(base_weights) or not names:
            raise ValueError(f"need one base weight per task; got {len(names)} names, {len(base_weights)} weights")
        if len(set(names)) != len(names):
            raise ValueError(f"task names must be unique, got {list(names)}")
        if any(w <= 0 or not math.isfinite(w) for w in base_weights):
            raise ValueError(f"base weights must be finite and > 0, got {list(base_weights)}")
        if combine not in ("weighted_sum", "alternating"):
            raise ValueError(f"combine must be weighted_sum or alternating, got {combine!r}")
        if weighting not in ("fixed", "auto"):
            raise ValueError(f"weighting must be fixed or auto, got {weighting!r}")
        self.names = list(names)
        self.base = [float(w) for w in base_weights]
        self.combine, self.weighting = combine, weighting
        self.window, self.min_history = window, min_history
        self.min_multiplier, self.max_multiplier, self.smoothing = min_multiplier, max_multiplier, smoothing
        self.weights = list(self.base)
        self.history: list[list[float]] = [[] for _ in names]
        self.credits = [0.0] * len(names)

    # -- which tasks train, with which coefficient ----------------------------------------------------------

    def next_tasks(self) -> list[int]:
        """Indices of the tasks that train this step (advances the round-robin in alternating mode)."""
        if self.combine == "weighted_sum":
            return list(range(len(self.names)))
        total = sum(self.weights)
        for i, w in enumerate(self.weights):
            self.credits[i] += w
        chosen = max(range(len(self.names)), key=lambda i: (self.credits[i], -i))
        self.credits[chosen] -= total
        return [chosen]

    def coefficients(self, tasks: Sequence[int]) -> list[float]:
        """Gradient coefficients of `tasks` this step: normalised weights (weighted_sum), 1 (alternating)."""
        if self.combine == "alternating":
            return [1.0 for _ in tasks]
        total = sum(self.weights[i] for i in tasks)
        return [self.weights[i] / total for i in tasks]

    # -- the auto rule ---------------------------------------------------------------------------------------

    def observe(self, losses: dict[int, float]) -> None:
        """Record this step's loss of each task that trained, then update the weights (auto)."""
        for i, loss in losses.items():
            loss = float(loss)
            if not math.isfinite(loss):
                raise ValueError(f"task {self.names[i]}: loss is {loss}; the run has diverged")
            self.history[i] = (self.history[i] + [loss])[-self.window:]
        if self.weighting == "auto" and all(len(h) >= self.min_history for h in self.history):
            target = self.target_weights()
            s = self.smoothing
            self.weights = [s * w + (1 - s) * t for w, t in zip(self.weights, target)]

    def fluctuations(self) -> list[float]:
        """Population standard deviation of each task's recorded losses."""
        out = []
        for h in self.history:
            mean = sum(h) / len(h) if h else 0.0
            out.append(math.sqrt(sum((x - mean) ** 2 for x in h) / len(h)) if h else 0.0)
        return out

    def target_weights(self) -> list[float]:
        stds = self.fluctuations()
        mean = sum(stds) / len(stds)
        if mean <= 0:
            return list(self.base)
        mult = [min(max(s / mean, self.min_multiplier), self.max_multiplier) for s in stds]
        return [b * m for b, m in zip(self.base, mult)]

    # -- checkpoints -----------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"names": list(self.names), "weights": list(self.weights),
                "history": [list(h) for h in self.history], "credits": list(self.credits)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if list(state.get("names", [])) != self.names:
            raise ValueError(f"the checkpoint's tasks {state.get('names')} differ from the configured tasks "
                             f"{self.names}: resume with the same tasks, in the same order")
        self.weights = [float(w) for w in state["weights"]]
        self.history = [[float(x) for x in h][-self.window:] for h in state["history"]]
        self.credits = [float(c) for c in state["credits"]]
