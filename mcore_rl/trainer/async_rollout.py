"""Rollouts that run ahead of training (trainer.rollout_mode = one_step_off_policy | async; docs/async.md).

On global rank 0 a RolloutProducer thread generates and scores the batches of the coming steps while the main
thread trains; a task's next_batch takes its batch from here instead of generating it, and the loop is the same
as in sync runs. The other ranks only receive the samples (rl_step.receive), as they always do.

    producer = RolloutProducer(engine, tasks, ctx, cfg.trainer, start_step)   # rank 0, after the engine is up
    payload, error = producer.take(task, step)          # main thread: waits until that batch is ready
    producer.pause_for_sync(); sync weights; producer.sync_done()             # Run.sync_weights
    with producer.held(): save checkpoint, producer.state_dict()              # Run.quiet_rollouts

Batches are made in the loop's order (step by step, the rl tasks of a step in task order), one at a time: each
generate call already batches all of a step's samples in the engine. The batch of step j starts only once the
engine's weights are at most S versions behind the weights step j will train from (S = trainer.max_staleness;
1 for one_step_off_policy), so the bound holds by construction; take() still checks it (a queue restored from
a checkpoint of a run with a larger bound) and drops what breaks it. At a weight sync the batch in flight
finishes with the old weights (finish; one_step_off_policy) or is interrupted and its unfinished samples
continued with the new weights after the sync (continue; mcore_rl.rollout.partial).

Checkpoints hold the queue: at a save the batch in flight finishes and none starts (held()); the batches made but
not yet trained are saved with the checkpoint (rank 0's `rollout_queue.pt`) together with the samplers, which
have already drawn their prompts. A resumed run trains on exactly those batches, so with greedy or seeded
sampling (rollout.deterministic) it repeats the uninterrupted run.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time

from mcore_rl.rollout.backend import Interrupt
from mcore_rl.rollout.errors import RolloutEngineError
from mcore_rl.rollout.partial import continue_samples, stamp, unfinished
from mcore_rl.trainer import rl_step as rl

log = logging.getLogger("mcore_rl")

WAIT_S = 0.2


class ProducerClosed(RolloutEngineError):
    """The run is ending: the producer stopped before this batch was made."""


class RolloutProducer:
    def __init__(self, engine, tasks, ctx: rl.StepContext, trainer_cfg, start_step: int,
                 queue: dict | None = None):
        """tasks: the run's tasks (only rl ones are produced; indices are the run's). queue: state_dict() of the
        checkpoint a run resumes from."""
        self.engine, self.tasks, self.ctx = engine, tasks, ctx
        self.total_steps = trainer_cfg.total_steps
        self.mode = trainer_cfg.rollout_mode
        self.max_staleness = 1 if self.mode == "one_step_off_policy" else trainer_cfg.max_staleness
        self.partial = "finish" if self.mode == "one_step_off_policy" else trainer_cfg.partial_rollouts
        self._jobs = [(step, i) for step in range(start_step + 1, self.total_steps + 1)
                      for i, t in enumerate(tasks) if t.spec.is_rl]
        self._ready: dict[tuple[int, int], tuple] = {}
        if queue:
            self._load(queue)
        self._cond = threading.Condition()
        self._paused = 0  # pause_for_sync() / held() callers: no batch starts while > 0
        self._syncing = False  # a weight sync is under way: an interrupted batch waits for its end
        self._busy = False  # a batch is being made
        self._parked = False  # the batch in flight was interrupted and waits for resume()
        self._interrupt: Interrupt | None = None
        self._demand = start_step  # take() asked for this step: its batches may start whatever the versions
        self._closed = False
        self._dropped_total = 0
        self._engine_wait_s = 0.0  # since the last take(): the engine had nothing to do (gate, sync, save)
        self._thread = threading.Thread(target=self._run, name="rollout-producer", daemon=True)
        self._thread.start()

    # -- the main thread ---------------------------------------------------------------------------------------
    def take(self, task, step: int) -> tuple[list | BaseException, BaseException | None]:
        """The batch of `task` for `step`, as (payload, error) for rl_step.receive, with the queue's and
        the staleness metrics in the payload's. Waits until it is made; a failure to make it (the engine's, a
        reward function's) comes back as the payload, which every rank then raises."""
        task_index = next(i for i, t in enumerate(self.tasks) if t is task)
        key = (step, task_index)
        t0 = time.perf_counter()
        with self._cond:
            self._demand = max(self._demand, step)
            self._cond.notify_all()
            while key not in self._ready:
                if not self._thread.is_alive():
                    e = ProducerClosed(f"the rollout producer stopped before making the batch of step {step}")
                    return e, None
                self._cond.wait(WAIT_S)
            payload, error = self._ready.pop(key)
            m = {"timing/wait_for_rollout_s": time.perf_counter() - t0,
                 "async/queue_depth": float(len(self._ready)), "async/in_flight": float(self._busy),
                 "timing/engine_wait_s": self._engine_wait_s}
            self._engine_wait_s = 0.0
        if error is None:  # every rank logs the same metrics: they travel with the samples
            payload, staleness_m = self._check_staleness(payload, step)
            payload = [payload[0], payload[1], {**payload[2], **m, **staleness_m}]
        return payload, error

    def pause_for_sync(self) -> None:
        """Before a weight sync: when this returns the engine runs no request, and no batch starts until
        sync_done(). The batch in flight finishes with the old weights first (partial_rollouts=finish), or is
        interrupted and goes on with the new weights after sync_done() (continue)."""
        with self._cond:
            self._paused += 1
            self._syncing = True
            if self.partial == "continue" and self._interrupt is not None:
                self._interrupt.fire()
            while self._busy and not self._parked and self._thread.is_alive():
                self._cond.wait(WAIT_S)

    def sync_done(self) -> None:
        with self._cond:
            self._paused -= 1
            self._syncing = False
            self._cond.notify_all()

    @contextlib.contextmanager
    def held(self):
        """No generation while the block runs, and the batch in flight finished first (a checkpoint: the queue
        and the samplers stay as they are)."""
        with self._cond:
            self._paused += 1
            while self._busy and self._thread.is_alive():
                self._cond.wait(WAIT_S)
        try:
            yield
        finally:
            with self._cond:
                self._paused -= 1
                self._cond.notify_all()

    def state_dict(self) -> dict:
        """The batches made and not yet trained (call inside held())."""
        return {"ready": [[step, i, payload] for (step, i), (payload, error) in sorted(self._ready.items())
                          if error is None], "dropped_total": self._dropped_total}

    def close(self) -> None:
        with self._cond:
            self._closed = True
            if self._interrupt is not None:
                self._interrupt.fire()
            self._cond.notify_all()
        self._thread.join(timeout=60)

    # -- the producer thread -----------------------------------------------------------------------------------
    def _run(self) -> None:
        for step, i in self._jobs:
            if (step, i) in self._ready:  # restored from the checkpoint
                continue
            with self._cond:
                t0 = time.perf_counter()
                while not self._closed and (self._paused or not self._may_start(step)):
                    self._cond.wait(WAIT_S)
                self._engine_wait_s += time.perf_counter() - t0
                if self._closed:
                    return
                self._busy, self._interrupt = True, Interrupt()
                version = self.engine.policy_version
            try:
                payload, error = self._make(step, i, version)
            except ProducerClosed:
                return
            except Exception as e:  # outside the engine's part (the sampler, the agent's set-up): every rank raises
                payload, error = RuntimeError(f"global rank 0 failed to prepare the batch of step {step}: "
                                              f"{type(e).__name__}: {e}"), e
            finally:
                with self._cond:
                    self._busy, self._parked, self._interrupt = False, False, None
                    self._cond.notify_all()
            with self._cond:
                self._ready[(step, i)] = (payload, error)
                self._cond.notify_all()
            if error is not None:  # the engine (or a reward function) failed: take() hands it on
                return

    def _may_start(self, step: int) -> bool:
        # Step j trains from the weights after step j - 1, so weights at version v are j - 1 - v behind them.
        return step - 1 - self.engine.policy_version <= self.max_staleness or step <= self._demand

    def _make(self, step: int, i: int, version: int):
        task = self.tasks[i]
        prompts = task.sampler.next_batch()
        n = task.algo.n_samples_per_prompt
        first_group_id = (step - 1) * len(prompts)
        stream = f"task:{task.name}" if task.cfg.multi_task else ""
        agent = task.agent_rollout(self.engine)

        def generate():
            if agent is not None:  # partial_rollouts=finish (config/root.py): whole trajectories, one version
                batch = agent.generate(self.engine, prompts, n, first_group_id=first_group_id, seed_stream=stream)
                stamp(batch.samples, version)
                return batch
            batch = self.engine.generate([p.prompt_ids for p in prompts], n=n, first_group_id=first_group_id,
                                         metas=[p.meta for p in prompts],
                                         prompt_texts=[p.prompt_text for p in prompts], seed_stream=stream,
                                         interrupt=self._interrupt)
            stamp(batch.samples, version)
            sampling = self.engine.default_sampling()
            while unfinished(batch.samples):
                # Aborted requests can stay in SGLang's scheduler an iteration after their answers came back: the
                # sync must not start before they are gone (RolloutEngine.wait_idle), so wait before parking.
                self.engine.wait_idle()
                current = self._park()
                continue_samples(self.engine, batch.samples, sampling, current, interrupt=self._interrupt,
                                 seed_stream=stream)
            batch.policy_version = min(s.policy_version for s in batch.samples if s.versions) \
                if any(s.versions for s in batch.samples) else version
            return batch

        return rl.produce(self.ctx, self.engine, task.rewards, prompts, n, first_group_id, agent, stream,
                          generate_fn=generate)

    def _park(self) -> int:
        """An interrupted batch waits here for the weight sync to end; returns the engine's new version."""
        with self._cond:
            self._parked = True
            self._cond.notify_all()
            t0 = time.perf_counter()
            while self._syncing and not self._closed:
                self._cond.wait(WAIT_S)
            self._engine_wait_s += time.perf_counter() - t0
            if self._closed:
                raise ProducerClosed("the run is ending")
            self._parked = False
            self._interrupt = Interrupt()
            return self.engine.policy_version

    # -- staleness ---------------------------------------------------------------------------------------------
    def _check_staleness(self, payload: list, step: int) -> tuple[list, dict]:
        samples, version, metrics = payload
        kept, m = check_staleness(samples, self.engine.policy_version, self.max_staleness)
        dropped = len(samples) - len(kept)
        self._dropped_total += dropped
        m["async/dropped_stale_total"] = float(self._dropped_total)
        if dropped:
            log.warning("step %d: dropped %d samples generated more than %d versions behind the trainer's weights "
                        "(trainer.max_staleness)", step, dropped, self.max_staleness)
        return [kept, version, metrics], m

    def _load(self, queue: dict) -> None:
        self._dropped_total = int(queue.get("dropped_total", 0))
        for step, i, payload in queue["ready"]:
            self._ready[(int(step), int(i))] = (payload, None)


QUEUE_FILE = "rollout_queue.pt"


def save_queue(folder, state: dict) -> None:
    """Rank 0: the queue into a checkpoint folder being written (trainer/checkpoint.py commits it atomically)."""
    import torch

    torch.save(state, folder / QUEUE_FILE)


def load_queue(folder) -> dict | None:
    """The queue of a checkpoint; None for one written by a sync run."""
    import torch

    path = folder / QUEUE_FILE
    if not path.exists():
        return None
    return torch.load(path, weights_only=False)  # Samples: our own file, written by save_queue


def check_staleness(samples: list, trainer_version: int, max_staleness: int) -> tuple[list, dict[str, float]]:
    """The samples to train on, and the staleness metrics. A sample is `trainer_version - v` versions behind, v
    the version of its oldest token (Sample.policy_version); the groups (all samples of a prompt, which advantages
    are computed over) with a sample more than max_staleness behind are dropped. Samples without versions (a
    sync run's) count as current."""
    behind = [trainer_version - s.policy_version if s.versions else 0 for s in samples]
    stale_groups = {s.group_id for s, b in zip(samples, behind) if b > max_staleness}
    kept = [s for s in samples if s.group_id not in stale_groups]
    num = max(len(samples), 1)
    m = {"async/staleness_mean": sum(behind) / num, "async/staleness_max": float(max(behind, default=0)),
         "async/dropped_stale": float(len(samples) - len(kept)),
         "async/partial_samples": float(sum(len(set(s.versions or ())) > 1 for s in samples))}
    for d in range(max_staleness + 1):
        m[f"async/staleness_hist/{d}"] = sum(b == d for b in behind) / num
    if any(b > max_staleness for b in behind):
        m[f"async/staleness_hist/>{max_staleness}"] = sum(b > max_staleness for b in behind) / num
    return kept, m
