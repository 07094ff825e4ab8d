"""The actor's (and critic's) updates of one step, from the batches the active tasks brought.

One task (a run without a `tasks` list): the task trains alone, `actor.ppo_epochs` passes over its batch in
`actor.mini_batch_size` mini-batches, one optimizer step each, under the actor's global clip.

Several tasks: each optimizer step combines every active task's whole batch (engine.multi_objective_step):
each task's gradient clipped to its own `clip_grad`, weighted by the scheduler's coefficient, summed, then the
global clip and Adam; `actor.ppo_epochs` such steps. Metrics of task <name> go under task/<name>/.

An optimizer step whose gradient norm is inf or nan is never applied (engine.optimizer_step); it is counted in
actor/nonfinite_updates (critic/...), and trainer.on_nonfinite says whether the run stops (NonFiniteUpdate,
raised on every rank alike: the norm is global) or goes on.
"""

from __future__ import annotations

import math
import time

from mcore_rl.trainer.step_data import RLBatch


def train_step(run, scheduler, batches: dict) -> dict[str, float]:
    """batches: task index -> the task's batch (RLBatch | PreferenceBatch), in the scheduler's order."""
    t0 = time.perf_counter()
    if run.cfg.multi_task:
        m = _combined(run, scheduler, batches)
    else:
        ((i, batch),) = batches.items()
        task = run.tasks[i]
        m = task.train_alone(batch)
        m.update(task.train_critic(batch))
    check_finite(m, run.cfg.trainer.on_nonfinite)
    m.update(run.actor.moe_metrics())  # MoE: router statistics of this step's actor updates, every task's
    m["timing/train_s"] = time.perf_counter() - t0
    tokens = sum(len(s.prompt_ids) + len(s.response_ids) for b in batches.values() if isinstance(b, RLBatch)
                 for s in b.rollout.samples)
    if tokens:
        m["throughput/train_tokens_per_s"] = tokens * run.cfg.actor.ppo_epochs / max(m["timing/train_s"], 1e-9)
    return m


def _combined(run, scheduler, batches: dict) -> dict[str, float]:
    from mcore_rl.engine import TaskGrad

    cfg, tasks = run.cfg, run.tasks
    epochs = cfg.actor.ppo_epochs
    order = list(batches)
    coef = dict(zip(order, scheduler.coefficients(order)))  # a task that dropped out shares nothing
    objectives = {i: tasks[i].objective(batches[i]) for i in order}
    grads = [TaskGrad(objectives[i].micro_batches, objectives[i].loss_fn, coef[i], tasks[i].spec.clip_grad,
                      objectives[i].temperature, objectives[i].with_entropy) for i in order]
    m: dict[str, float] = {"actor/nonfinite_updates": 0.0}
    sums: dict[str, float] = {}
    applied = 0
    for epoch in range(epochs):
        res, per_task = run.actor.multi_objective_step(grads)
        for i, r in zip(order, per_task):
            if epoch == 0 and objectives[i].kl is None and "dpo/logratio" in r.metrics:
                objectives[i].kl = r.metrics["dpo/logratio"]  # measured before this step's first update
        if res.nonfinite:  # not applied (engine); check_finite applies trainer.on_nonfinite
            if not m["actor/nonfinite_updates"]:
                m.update({"actor/nonfinite_loss": res.loss, "actor/nonfinite_grad_norm": res.grad_norm})
            m["actor/nonfinite_updates"] += 1
            continue
        applied += 1
        _add(sums, "actor/grad_norm", res.grad_norm)
        m["actor/lr"] = res.lr
        for i, r in zip(order, per_task):
            p = f"task/{tasks[i].name}/"
            if epochs > 1 and epoch in (0, epochs - 1):
                # the same batch before the first and before the last update: did the combined updates lower
                # this task's own loss?
                m[p + ("loss/first_epoch" if epoch == 0 else "loss/last_epoch")] = r.loss
            _add(sums, p + "loss", r.loss)
            _add(sums, p + "grad_norm", r.grad_norm)
            _add(sums, p + "clip_coef", r.clip_coef)
            for key, v in r.metrics.items():
                _add(sums, p + key, v)
    m.update({k: v / applied for k, v in sums.items()})
    for i in order:
        p = f"task/{tasks[i].name}/"
        m[p + "coef"] = coef[i]
        if objectives[i].peaks is not None:
            m.update({p + k: v for k, v in objectives[i].peaks.reduce().items()})
    for i in order:  # the critic learns each rl task's values on that task's rollouts
        m.update({f"task/{tasks[i].name}/{k}": v for k, v in tasks[i].train_critic(batches[i]).items()})
    if applied:  # a step whose updates were all skipped (non-finite) tells the scheduler nothing
        scheduler.observe({i: m[f"task/{tasks[i].name}/loss"] for i in order})
    kl = global_kl([(objectives[i].kl, objectives[i].kl_tokens) for i in order])
    if kl is not None:
        m["kl"] = kl
    return m


class NonFiniteUpdate(RuntimeError):
    """An update's gradient norm was inf or nan and trainer.on_nonfinite=stop."""


def check_finite(m: dict[str, float], policy: str) -> None:
    """trainer.on_nonfinite for this step's updates: stop raises NonFiniteUpdate naming the model, the first
    non-finite loss and gradient norm and how many updates were skipped; skip lets the run go on (the count is in
    the metrics)."""
    for key in [k for k in m if k.endswith("/nonfinite_updates") and m[k]] if policy == "stop" else []:
        where = key[:-len("/nonfinite_updates")]  # actor, critic, task/<name>/critic
        model = where.rsplit("/", 1)[-1]
        loss, norm = m[f"{where}/nonfinite_loss"], m[f"{where}/nonfinite_grad_norm"]
        bad = [name for name, v in (("loss", loss), ("gradient norm", norm)) if not math.isfinite(v)]
        raise NonFiniteUpdate(
            f"the {where}'s {' and '.join(bad)} {'are' if len(bad) > 1 else 'is'} not finite (loss {loss}, "
            f"gradient norm {norm}); updates skipped, not applied: {int(m[key])} of this step's. Lower "
            f"{model}.lr, check the rewards' scale and the advantages, or set trainer.on_nonfinite=skip to "
            "skip such updates and go on")


def global_kl(parts: list[tuple[float | None, int]]) -> float | None:
    """Token-weighted mean over this step's tasks of their KL measure: rl tasks give k1 KL(actor || reference)
    on their own samples (on-policy, an estimate of the true KL); dpo tasks give the mean log-ratio
    log pi - log pi_ref on the dataset's responses (how far the actor moved there; not a KL). None when no task
    measured one (no reference)."""
    parts = [(k, n) for k, n in parts if k is not None]
    total = sum(n for _, n in parts)
    return sum(k * n for k, n in parts) / total if total else None


def _add(sums: dict, key: str, value: float) -> None:
    sums[key] = sums.get(key, 0.0) + float(value)
