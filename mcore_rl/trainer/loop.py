"""The training loop, top to bottom: `train(cfg)`, run by every torchrun process.

    for each step:
        the scheduler picks the tasks of this step (every task, or one: multitask.combine)
        each task brings its batch (tasks.py): rl: prompts -> SGLang rollout -> rewards -> old / reference
            log-probs and values -> advantages; dpo: preference pairs -> reference log-probs
        the actor (and critic) update on those batches (update.py)
        the KL monitor may lower the actor's learning rate; the weights go to the rollout engine
        metrics; checkpoint; on a stop signal (SIGTERM), a checkpoint and exit status 80

With trainer.rollout_mode = one_step_off_policy | async the rl tasks' rollouts are made ahead on a thread of
rank 0 (async_rollout.py) while the step trains; the sync pauses it, and a save holds it (docs/async.md).

A run without a `tasks` list is a run with one task (config/root.py RLConfig.task_specs). Global rank 0 owns the
rollout engine and the reward functions; the samples are broadcast to every rank, each data-parallel rank
trains on its share, and the weights come back to the engine through the weight-sync package.
"""

from __future__ import annotations

import logging
import resource
import time

import torch

from mcore_rl import algorithms as alg
from mcore_rl.config.root import RLConfig
from mcore_rl.parallel import watchdog
from mcore_rl.parallel.runtime import any_rank
from mcore_rl.procs import StopRequested, StopSignals
from mcore_rl.rollout.errors import RolloutEngineError
from mcore_rl.trainer.run import Run
from mcore_rl.trainer.step_data import Skip
from mcore_rl.trainer.update import NonFiniteUpdate, train_step

log = logging.getLogger("mcore_rl")


def train(cfg: RLConfig) -> None:
    stop = StopSignals(cfg.trainer.stop_signals).install()  # before any thread or child process exists
    try:
        run = Run(cfg, stop)
    except StopRequested as e:  # every rank has it (run.start_rollout): one line, from rank 0
        log.info("stopped by %s while the rollout engine was starting, %s", *e.args)
        stop.exit()
    except RolloutEngineError as e:
        log.info("the rollout engine failed to start: %s", e)
        stop.exit(1)
    step = run.start_step
    watchdog.start(cfg.parallel.watchdog_s, torch.distributed.get_rank(), lambda: run.last_checkpoint)
    try:
        scheduler, kl_monitor = build_scheduler(cfg, run)

        def save(step: int) -> None:
            watchdog.set_phase("checkpoint", step)
            with run.quiet_rollouts():  # asynchronous rollouts: the queue and the samplers hold still
                run.save(step, {"tasks": {t.name: t.state_dict() for t in run.tasks},
                                "scheduler": scheduler.state_dict(),
                                "kl_monitor": kl_monitor.state_dict() if kl_monitor is not None else None})

        for step in range(run.start_step + 1, cfg.trainer.total_steps + 1):
            t_step = time.perf_counter()
            watchdog.set_phase("rollout", step)
            batches, m = collect_batches(run, scheduler, step)
            if batches:
                m.update(run.release_rollout_memory())
                watchdog.set_phase("update")
                m.update(train_step(run, scheduler, batches))
                m.update(watch_kl(run, kl_monitor, m))
                watchdog.set_phase("weight sync")
                m.update(run.sync_weights(step))
            m.update(memory_metrics())
            m["timing/step_s"] = time.perf_counter() - t_step
            if step == run.start_step + 1:  # where the time before it went, once
                line, startup = run.startup.summary(m["timing/step_s"])
                m.update(startup)
                log.info(line)
            run.metrics_log.log(step, m)
            due = (cfg.trainer.save_every and step % cfg.trainer.save_every == 0) or step == cfg.trainer.total_steps
            if due:
                save(step)
            watchdog.set_phase("step end")
            if any_rank(stop.received is not None):  # a step's end is the safe point; every rank agrees on it
                if not due:
                    save(step)
                log.info("stopped by %s after step %d; checkpoint %s; continue with trainer.resume=auto",
                         stop.received or "a signal on another rank", step, run.last_checkpoint)
                stop.exit()
        if cfg.trainer.export_hf:
            watchdog.set_phase("export")
            run.export_hf()
    except RolloutEngineError as e:  # every rank has it (rl_step.generate): one line, from rank 0
        log.info("the rollout engine failed in step %d: %s. Last checkpoint: %s; continue with "
                 "trainer.resume=auto", step, e, run.last_checkpoint or "none this run")
        stop.exit(1)
    except NonFiniteUpdate as e:  # every rank has it (the gradient norm is global): one line, from rank 0
        log.info("step %d: %s. Last checkpoint: %s (trainer.resume=auto continues from it)", step, e,
                 run.last_checkpoint or "none this run")
        stop.exit(1)
    except KeyboardInterrupt:
        log.info("interrupted in step %d (%s). Last checkpoint: %s; continue with trainer.resume=auto", step,
                 watchdog.current_phase(), run.last_checkpoint or "none this run")
        raise SystemExit(130) from None
    finally:
        watchdog.set_phase("shutdown")
        run.close()


def collect_batches(run: Run, scheduler, step: int) -> tuple[dict, dict[str, float]]:
    """The batch of each task the scheduler picks for this step (task index -> batch) and the tasks' metrics; a
    task that has nothing to train on is left out, with a warning."""
    multi = run.cfg.multi_task
    batches, m = {}, {}
    for i in scheduler.next_tasks():
        task = run.tasks[i]
        t0 = time.perf_counter()
        batch, tm = task.next_batch(step, run.rollout)
        tm["timing/prepare_s"] = time.perf_counter() - t0
        m.update({f"task/{task.name}/{k}": v for k, v in tm.items()} if multi else tm)
        if isinstance(batch, Skip):
            log.warning("step %d: task %s had nothing to train on (%s)", step, task.name, batch.reason)
            continue
        batches[i] = batch
    if multi:
        for i, task in enumerate(run.tasks):
            m[f"task/{task.name}/weight"] = scheduler.weights[i]
            m[f"task/{task.name}/trained"] = float(i in batches)
    return batches, m


def build_scheduler(cfg: RLConfig, run: Run):
    """The task scheduler and the global KL monitor, restored from the checkpoint when resuming."""
    mt = cfg.multitask
    scheduler = alg.TaskScheduler(
        [t.name for t in run.tasks], [t.spec.weight for t in run.tasks], combine=mt.combine,
        weighting=mt.weighting, window=mt.auto_window, min_history=mt.auto_min_history,
        min_multiplier=mt.auto_min_multiplier, max_multiplier=mt.auto_max_multiplier, smoothing=mt.auto_smoothing)
    kl_monitor = (alg.KLLRMonitor(mt.kl_target, mt.kl_lr_decay, mt.kl_min_lr_multiplier)
                  if mt.kl_target is not None else None)
    state = run.resume_state
    if state is not None:
        scheduler.load_state_dict(state["scheduler"])
        if kl_monitor is not None and state.get("kl_monitor"):
            kl_monitor.load_state_dict(state["kl_monitor"])
            run.actor.set_lr_multiplier(kl_monitor.lr_multiplier)
    return scheduler, kl_monitor


def watch_kl(run: Run, kl_monitor, m: dict) -> dict[str, float]:
    """Decay the actor's learning rate while KL(actor || reference) exceeds multitask.kl_target."""
    out = {}
    if kl_monitor is not None and m.get("kl") is not None:
        run.actor.set_lr_multiplier(kl_monitor.update(m["kl"]))
        out["kl_monitor/exceeded"] = float(kl_monitor.decayed)
    if run.cfg.multi_task or kl_monitor is not None:
        out["actor/lr_multiplier"] = run.actor.lr_multiplier
    return out


def memory_metrics() -> dict[str, float]:
    m = {"memory/peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6}  # kB on Linux
    if torch.cuda.is_available():
        m["memory/peak_gpu_gb"] = torch.cuda.max_memory_allocated() / 1e9
    return m
