"""Everything a run holds, set up once and torn down once: parallel state, the actor / reference / critic engines,
the tasks, the rollout engine and its rewards, the weight sync, metrics, checkpoints. The loop (loop.py) uses it.

    run = Run(cfg, stop)      # every torchrun process; rank 0 also owns the SGLang engine and the rewards
    run.sync_weights(step)    # actor -> engine, checked against the engine's count
    run.save(step, state)     # atomic run checkpoint (engines, RNG, state.json)
    run.close()
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time

import torch
import torch.distributed as dist

from mcore_rl.config.root import RLConfig
from mcore_rl.parallel.runtime import from_rank0
from mcore_rl.procs import OutputLock, OutputLockedError, StopRequested, StopSignals, follow_launcher
from mcore_rl.rollout.errors import RolloutEngineError
from mcore_rl.engine import checkpoint as engine_ckpt
from mcore_rl.trainer import checkpoint as ckpt
from mcore_rl.trainer.metrics import MetricsLogger
from mcore_rl.trainer.rl_step import StepContext
from mcore_rl.trainer.tasks import build_tasks

log = logging.getLogger("mcore_rl")


class Run:
    def __init__(self, cfg: RLConfig, stop: StopSignals | None = None):
        """stop: the run's stop signals; one that arrives while the rollout engine starts ends the start-up
        (StopRequested on every rank)."""
        from megatron.core import parallel_state as ps

        from mcore_rl.weight_sync import WeightSync

        self.cfg = cfg
        follow_launcher()  # this worker and what it starts end when torchrun does, however torchrun ends
        self.startup = StartupClock()
        """Where the time before the first step goes (logged after it: loop.py)."""
        with self.startup.phase("set-up"):
            self.hf, self.model_path, tokenizer, layout = setup(cfg)
        # One run per output folder: rank 0 holds the lock for the run's lifetime; every rank hears the verdict.
        self.lock = None
        verdict = None
        if dist.get_rank() == 0:
            try:
                self.lock = OutputLock(cfg.trainer.output_dir, what="training run").acquire()
            except OutputLockedError as e:
                verdict = e
            except OSError as e:  # under a file, on a read-only or full file system
                verdict = OSError(e.errno, f"cannot write to trainer.output_dir {cfg.trainer.output_dir} "
                                  f"({e.filename}: {e.strerror}); choose a folder this run can create and write")
        from_rank0(verdict)
        specs = cfg.task_specs()
        use_ref = cfg.ref.enabled and (
            any(not s.is_rl for s in specs) or cfg.actor.kl_loss_coef > 0 or cfg.multitask.kl_target is not None
            or any(s.is_rl and s.algorithm.kl_in_reward and s.algorithm.kl_coef > 0 for s in specs))
        ctx = StepContext(None, None, None, tokenizer, ps.get_data_parallel_group(), ps.get_data_parallel_rank(),
                          ps.get_data_parallel_world_size(), score_temperature(cfg))
        self.ctx = ctx
        # datasets first: a bad row fails before the engines load
        with self.startup.phase("datasets"):
            self.tasks = build_tasks(cfg, ctx, tokenizer, use_ref=use_ref)
        rl_tasks = [t for t in self.tasks if t.spec.is_rl]
        steps = cfg.trainer.total_steps
        actor_mini = 1 if cfg.multi_task else self.tasks[0].num_mini_batches
        with self.startup.phase("models"):
            ctx.actor, ctx.ref, ctx.critic = build_engines(
                cfg, self.hf, self.model_path, use_ref=use_ref, use_critic=cfg.critic.enabled,
                actor_updates=steps * actor_mini * cfg.actor.ppo_epochs,
                critic_updates=steps * cfg.critic.ppo_epochs * sum(t.num_mini_batches for t in rl_tasks))
        self.actor, self.ref, self.critic = ctx.actor, ctx.ref, ctx.critic

        self.start_step = 0
        self.last_checkpoint = None
        self.resume_state: dict | None = None
        self.queue_state: dict | None = None  # rank 0: the checkpoint's batches made ahead (async_rollout)
        resume_from = ckpt.find_resume(cfg.trainer.output_dir, cfg.trainer.resume)
        for partial in ckpt.remove_partial(cfg.trainer.output_dir) if self.lock is not None else []:
            log.info("removed %s: a checkpoint whose save did not finish (the run was killed while saving)", partial)
        if resume_from is not None:
            with self.startup.phase("checkpoint"):
                self.resume_state = self._load(resume_from)
            self.start_step = int(self.resume_state["step"])
            self.last_checkpoint = resume_from
            log.info("resumed from %s at step %d", resume_from, self.start_step)

        self.rollout = None
        self.sync = None
        self.expected_syncs = 0
        if rl_tasks:
            try:
                with self.startup.phase("rollout engine"):
                    self.rollout = start_rollout(cfg, self.model_path, stop)
            except StopRequested as e:  # before this run's first step: say what there is to continue from
                raise StopRequested(e.signal_name, f"before step {self.start_step + 1}; " + (
                    f"checkpoint {self.last_checkpoint}; continue with trainer.resume=auto" if self.last_checkpoint
                    else "no checkpoint exists (the first is saved after step 1): start the run again")) from None
            if dist.get_rank() == 0:
                from mcore_rl.rewards.manager import RewardManager

                for task in rl_tasks:
                    task.rewards = RewardManager(task.spec.reward)
            self.sync = WeightSync(cfg.weight_sync, self.actor.model_chunks, self.hf, self.rollout,
                                   scratch_dir=os.path.join(cfg.trainer.output_dir, "scratch"),
                                   model_path=self.model_path)
            if self.start_step > 0:  # the engine starts from the HF weights; give it the actor's
                self.expected_syncs = self.sync.sync()
                if self.rollout is not None:
                    self.rollout.policy_version = self.start_step
        self.producer = None
        """Rank 0 of a run with trainer.rollout_mode != sync: the thread that makes the coming batches
        (trainer/async_rollout.py); the rl tasks take their batches from it."""
        if self.rollout is not None and cfg.trainer.rollout_mode != "sync":
            self.producer = start_producer(self, cfg)
        for task in rl_tasks:
            task.producer = self.producer
        self.metrics_log = MetricsLogger(cfg.trainer.output_dir, dist.get_rank() == 0, cfg.logger.tensorboard,
                                         wandb_settings(cfg) if cfg.logger.wandb else None,
                                         resume_step=self.start_step)
        if dist.get_rank() == 0:
            log.info("layout: world %d = tp %d x pp %d x dp %d (%s); model %s", layout.world_size, layout.tp,
                     layout.pp, layout.dp, layout.backend, self.model_path)
            if cfg.multi_task:
                log.info("tasks: %s; combine %s, weighting %s", ", ".join(
                    f"{t.name} ({t.spec.kind}, w {t.spec.weight})" for t in self.tasks), cfg.multitask.combine,
                    cfg.multitask.weighting)

    # -- weight sync -------------------------------------------------------------------------------------------

    def sync_weights(self, step: int) -> dict[str, float]:
        """Push the actor's weights to the engine and check that the engine counted the sync."""
        if self.sync is None:
            return {}
        if self.producer is None:
            return self._sync_weights(step)
        t0 = time.perf_counter()
        self.producer.pause_for_sync()  # the batch in flight finishes, or is interrupted (partial_rollouts)
        try:
            wait = time.perf_counter() - t0
            return {**self._sync_weights(step), "timing/sync_wait_for_rollout_s": wait}
        finally:
            self.producer.sync_done()

    def release_rollout_memory(self) -> dict[str, float]:
        """Colocated, rollout.release_while_training: the engine gives its weights and KV cache to the update
        until the weight sync takes them back (rank 0; the other ranks have no engine)."""
        if self.rollout is None or not self.cfg.rollout.release_while_training:
            return {}
        t0 = time.perf_counter()
        self.rollout.release_memory()
        return {"timing/engine_release_s": time.perf_counter() - t0}

    def _resume_rollout_memory(self) -> dict[str, float]:
        if self.rollout is None or not self.rollout.released:
            return {}
        t0 = time.perf_counter()
        if torch.cuda.is_available():  # the memory the update's allocator keeps cached goes back to the engine
            torch.cuda.empty_cache()
        self.rollout.resume_memory()
        return {"timing/engine_resume_s": time.perf_counter() - t0}

    def _sync_weights(self, step: int) -> dict[str, float]:
        resumed = self._resume_rollout_memory()  # resumed weights hold no values until the sync below
        t0 = time.perf_counter()
        engine_syncs = self.sync.sync()
        m = {**resumed, "timing/weight_sync_s": time.perf_counter() - t0}
        if dist.get_rank() != 0:
            return m
        # The engine counts the syncs it completed since it started; the weights it now holds are the actor's
        # after this step's update, whatever the run's history (resumed or not).
        if engine_syncs != self.expected_syncs + 1:
            raise RuntimeError(f"rollout engine reports {engine_syncs} weight syncs, expected "
                               f"{self.expected_syncs + 1}: a sync was lost")
        self.expected_syncs = engine_syncs
        self.rollout.policy_version = step
        m["rollout/engine_syncs"] = float(engine_syncs)
        m["rollout/weight_version"] = float(step)
        m["weight_sync/gb_per_s"] = self.sync.last_bytes / 1e9 / max(m["timing/weight_sync_s"], 1e-9)
        return m

    # -- checkpoints -------------------------------------------------------------------------------------------

    def save(self, step: int, state: dict) -> None:
        """Engines, this rank's RNG and state.json (step, `state`, the config), committed atomically."""
        cfg = self.cfg
        tmp = ckpt.step_dir(cfg.trainer.output_dir, step).with_suffix(".tmp")
        try:
            tmp = ckpt.begin(cfg.trainer.output_dir, step)
            reshardable = cfg.trainer.checkpoint_reshardable
            self.actor.save_checkpoint(tmp / "actor", reshardable=reshardable)
            if self.critic is not None:
                self.critic.save_checkpoint(tmp / "critic", reshardable=reshardable)
            ckpt.write_rank_state(tmp)
            if self.producer is not None:  # rank 0: the batches made ahead (called inside quiet_rollouts)
                from mcore_rl.trainer.async_rollout import save_queue

                save_queue(tmp, self.producer.state_dict())
            state = {"step": step, **state, "world_size": dist.get_world_size(),
                     "layout": engine_ckpt.layout(len(self.actor.model_chunks)),
                     "config": dataclasses.asdict(cfg)}
            final = ckpt.commit(cfg.trainer.output_dir, step, tmp, state, cfg.trainer.keep_last)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # a full disk or a read-only folder: Megatron's writer re-raises an OSError as a
            err = ckpt.write_error(e, tmp)  # RuntimeError inside torch's CheckpointException (a BaseException)
            if err is None:
                raise
            raise OSError(err.errno, f"could not write the checkpoint of step {step} into {tmp}: {err.strerror}; "
                          f"free space in (or choose another) trainer.output_dir. The last complete checkpoint, "
                          f"{self.last_checkpoint or 'none this run'}, is intact; continue from it with "
                          "trainer.resume=auto") from e
        self.last_checkpoint = final
        log.info("saved checkpoint %s", final)

    def _load(self, path) -> dict:
        state = ckpt.read_state(path)
        saved = state.get("tasks")
        names = [t.name for t in self.tasks]
        if saved is None or any(n not in saved for n in names):
            raise ValueError(f"the checkpoint {path} has no data position for tasks "
                             f"{[n for n in names if saved is None or n not in saved]} (it has "
                             f"{sorted(saved or [])}): resume with the tasks it was saved with")
        ckpt.check_engine_files(path / "actor")
        if self.critic is not None:
            ckpt.check_engine_files(path / "critic")
        self.actor.load_checkpoint(path / "actor")
        if self.critic is not None:
            self.critic.load_checkpoint(path / "critic")
        saved_world = state.get("world_size")  # absent before 2026-12-05: those resume at their own size only
        if saved_world is None or saved_world == dist.get_world_size():
            ckpt.set_rng_state(ckpt.read_rank_state(path)["rng"])
        elif dist.get_rank() == 0:
            log.warning(
                "resuming %s, saved at world size %d (%s), at world size %d (%s): weights, optimizer state, LR "
                "schedule, data position and KL controller carry over, and each sample's seed does not depend on the "
                "layout; the ranks' RNG streams start afresh from parallel.seed and reductions run in another order, "
                "so the run is not bit-equal to one that kept its size", path, saved_world,
                engine_ckpt.layout_str(state.get("layout")), dist.get_world_size(),
                engine_ckpt.layout_str(engine_ckpt.layout(len(self.actor.model_chunks))))
        for task in self.tasks:
            task.load_state_dict(saved[task.name])
        if dist.get_rank() == 0:
            from mcore_rl.trainer.async_rollout import load_queue

            self.queue_state = load_queue(path)
            if self.queue_state is not None and self.cfg.trainer.rollout_mode == "sync":
                log.warning("the checkpoint %s holds %d batches generated ahead by an asynchronous run; "
                            "trainer.rollout_mode=sync does not use them (their prompts are skipped)", path,
                            len(self.queue_state["ready"]))
        return state

    @contextlib.contextmanager
    def quiet_rollouts(self):
        """Asynchronous rollouts: the batch in flight finishes and none starts while the block runs (a save)."""
        with self.producer.held() if self.producer is not None else contextlib.nullcontext():
            yield

    def export_hf(self) -> None:
        from mcore_rl.trainer.export import export_final

        path = export_final(self.actor.model_chunks, self.hf, self.model_path,
                            os.path.join(self.cfg.trainer.output_dir, "hf"))
        log.info("exported the actor as an HF checkpoint: %s", path)

    def close(self) -> None:
        from mcore_rl.parallel import destroy

        self.metrics_log.close()
        if self.producer is not None:
            self.producer.close()
        if self.sync is not None:
            self.sync.close()
        if self.rollout is not None:
            self.rollout.shutdown()
        errors = []
        for task in self.tasks:
            try:
                task.close()
            except Exception as e:  # a user tool's close: the other tasks, the lock and the groups still go
                log.error("closing task %s failed: %s: %s", task.name, type(e).__name__, e)
                errors.append(e)
        if self.lock is not None:
            self.lock.release()
        destroy()
        if errors:
            raise errors[0]


class StartupClock:
    """Seconds of each start-up phase, and since this process started (its imports and Python's own start-up
    are the part before the first phase)."""

    def __init__(self):
        import psutil

        self.process_start = psutil.Process().create_time()
        self.phases: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.phases[name] = self.phases.get(name, 0.0) + time.perf_counter() - t0

    def summary(self, first_step_s: float) -> tuple[str, dict[str, float]]:
        """(the log line, the metrics) once the first step has run, first_step_s long."""
        total = time.time() - self.process_start
        parts = {**self.phases, "first step": first_step_s}
        parts = {"imports": max(total - sum(parts.values()), 0.0), **parts}
        line = f"first step done {total:.0f} s after the process started: " + ", ".join(
            f"{name} {sec:.1f} s" for name, sec in parts.items())
        metrics = {f"timing/startup/{name.replace(' ', '_').replace('-', '_')}_s": sec for name, sec in parts.items()}
        return line, {**metrics, "timing/startup/total_s": total}


def setup(cfg: RLConfig):
    """Logging, model path, parallel state, tokenizer. Returns (hf config, model path, tokenizer, layout)."""
    from transformers import AutoTokenizer

    from mcore_rl.models.arch import load_hf_config
    from mcore_rl.models.smollm2 import resolve_model_path
    from mcore_rl.parallel import initialize

    rank0 = int(os.environ.get("RANK", 0)) == 0
    # Our own handler: SGLang reconfigures the root logger (to its log_level) when its engine starts, which
    # would silence the per-step summary line.
    log.setLevel(logging.INFO if rank0 else logging.WARNING)
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s mcore_rl: %(message)s", datefmt="%H:%M:%S"))
        log.addHandler(handler)
        log.propagate = False
    model_path = resolve_model_path(cfg.model.path)  # safe to call from every rank at once (file lock)
    hf = load_hf_config(model_path)
    check_sequence_budget(cfg, hf)
    layout = initialize(cfg.parallel, hf)
    if cfg.trainer.deterministic:
        torch.use_deterministic_algorithms(True)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    check_tokenizer(tokenizer, hf, model_path)
    return hf, model_path, tokenizer, layout


def check_tokenizer(tokenizer, hf: dict, model_path: str) -> None:
    """Refuse a tokenizer with ids past the model's embedding (config.json's vocab_size): the engine would index
    past its embedding table mid-rollout. A smaller tokenizer is normal (padded vocabularies)."""
    vocab = hf.get("vocab_size")
    if vocab and len(tokenizer) > vocab:
        raise ValueError(f"the tokenizer in {model_path} has {len(tokenizer)} tokens, but config.json's vocab_size is "
                         f"{vocab}: token ids {vocab}..{len(tokenizer) - 1} have no embedding. The tokenizer files do "
                         "not belong to these weights; use the tokenizer the model was trained with")


def check_sequence_budget(cfg: RLConfig, hf: dict) -> None:
    """Refuse, before anything loads, an rl task whose longest engine request cannot fit the engine's context
    (rollout.context_length, else the model's max_position_embeddings): SGLang would reject it mid-run.

    Single-turn: max_prompt_length + rollout.max_new_tokens. Agentic: a trajectory's last turn sends the prompt
    and up to agent.max_response_tokens - 1 tokens of earlier turns, and may generate rollout.max_new_tokens
    more, so max_prompt_length + agent.max_response_tokens + rollout.max_new_tokens. Tasks whose data has
    max_prompt_length=null cannot be checked here."""
    limit = cfg.rollout.context_length or hf.get("max_position_embeddings")
    if not limit:
        return
    limit_name = "rollout.context_length" if cfg.rollout.context_length else "the model's max_position_embeddings"
    new = cfg.rollout.max_new_tokens
    for task in cfg.task_specs():
        prompt = task.data.max_prompt_length if task.is_rl else None
        if prompt is None:
            continue
        where = f"task {task.name}: " if cfg.tasks else ""
        if task.agent is None:
            need, parts = prompt + new, f"data.max_prompt_length ({prompt}) + rollout.max_new_tokens ({new})"
        else:
            budget = task.agent.max_response_tokens
            need = prompt + budget + new
            parts = (f"data.max_prompt_length ({prompt}) + agent.max_response_tokens ({budget}) + "
                     f"rollout.max_new_tokens ({new}, the last turn's)")
        if need > limit:
            raise ValueError(f"{where}{parts} = {need} tokens do not fit {limit_name} ({limit}): lower them")


def start_producer(run: Run, cfg: RLConfig):
    """Rank 0 of an asynchronous run: the rollout producer, with the checkpoint's queue when resuming."""
    from mcore_rl.trainer.async_rollout import RolloutProducer

    t = cfg.trainer
    log.info("rollouts: %s%s", t.rollout_mode, f" (max_staleness {t.max_staleness}, partial_rollouts "
             f"{t.partial_rollouts})" if t.rollout_mode == "async" else "")
    if not cfg.actor.off_policy_correction:
        log.warning("trainer.rollout_mode=%s trains on samples of older weights without correcting for it; "
                    "consider +actor.off_policy_correction={name: token_tis, cap: 2.0} (docs/async.md)",
                    t.rollout_mode)
    return RolloutProducer(run.rollout, run.tasks, run.ctx, t, run.start_step, queue=run.queue_state)


def start_rollout(cfg: RLConfig, model_path: str, stop: StopSignals | None):
    """Global rank 0 starts the SGLang engine (None elsewhere). Collective: its failure (RolloutEngineError) or a
    stop signal during the start-up (StopRequested) is raised on every rank, so no rank waits for an engine that
    is not coming."""
    engine = outcome = None
    if dist.get_rank() == 0:
        from mcore_rl.rollout.engine import RolloutEngine

        t0 = time.perf_counter()  # the long quiet part of a GPU start: imports, CUDA graphs, the first kernel compiles
        log.info("starting the rollout engine (SGLang, %s mode); a first start on a GPU takes a minute or two",
                 cfg.rollout.mode)
        try:
            with stop.interrupting() if stop is not None else contextlib.nullcontext():
                engine = RolloutEngine(cfg.rollout, model_path, weight_loaders=cfg.weight_sync.engine_loaders)
            log.info("rollout engine ready in %.0f s%s", time.perf_counter() - t0,
                     f" (attention: {engine.attention_backend})" if engine.attention_backend else "")
        except (RolloutEngineError, ValueError, StopRequested) as e:
            outcome = e
        except Exception as e:  # anything else: still an engine that did not start, on every rank
            outcome = RolloutEngineError(f"the SGLang engine failed to start: {type(e).__name__}: {e}")
            outcome.__cause__ = e
    from_rank0(outcome)
    return engine


def build_engines(cfg: RLConfig, hf, model_path, *, actor_updates: int, critic_updates: int, use_ref: bool,
                  use_critic: bool):
    """The actor (trained), the frozen reference and the critic, all loaded from the HF checkpoint. The
    optimizers' decay runs to the end of the run unless actor / critic.lr_decay_steps say otherwise."""
    from mcore_rl.bridge import load_hf_weights
    from mcore_rl.engine import TrainEngine

    actor_optim = dataclasses.replace(cfg.actor, lr_decay_steps=cfg.actor.lr_decay_steps or actor_updates)
    actor = TrainEngine(hf, cfg.model, cfg.parallel, actor_optim)
    load_hf_weights(actor.model_chunks, model_path, hf)
    actor.reload_master_weights()  # the optimizer's fp32 master copies were taken before the weights arrived
    ref = critic = None
    if use_ref:
        ref = TrainEngine(hf, cfg.model, cfg.parallel, None)
        load_hf_weights(ref.model_chunks, model_path, hf)
    if use_critic:
        critic_optim = dataclasses.replace(cfg.critic, lr_decay_steps=cfg.critic.lr_decay_steps or critic_updates)
        critic = TrainEngine(hf, cfg.model, cfg.parallel, critic_optim, value_head=True)
        load_hf_weights(critic.model_chunks, model_path, hf, critic=True)  # starts from the actor's weights
        critic.reload_master_weights()
    return actor, ref, critic


def score_temperature(cfg: RLConfig) -> float:
    # The trainer scores tokens under the distribution the engine sampled from: logits / T. Greedy (T = 0)
    # log-probs are the plain log-softmax, as SGLang reports them.
    return cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0


def wandb_settings(cfg: RLConfig) -> dict:
    return {"project": cfg.logger.wandb_project, "name": cfg.logger.run_name, "config": dataclasses.asdict(cfg)}
