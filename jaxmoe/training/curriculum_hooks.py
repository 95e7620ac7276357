"""The curriculum inside the train loop: collect complexities, order each epoch by them.

`make_curriculum(...)` returns None for `data.curriculum = "none"` (the loop then makes no
call here and no extra host sync), else a `Curriculum` whose three hooks the loop calls:

  before_batch(params)   before fetching a batch; at an epoch boundary (only there) it
                         freezes the complexities, orders the next epoch and writes both
  observe(batch, metrics) after dispatching a step: keeps its routing_BM [B, M] and the
                         batch's example_ids [B] on device, records the previous step's
  before_save(step)      records the pending step, flushes the log, notes the checkpoint
                         and deletes the files that no kept checkpoint needs

`data.curriculum_source` says where complexities come from:
- `previous_epoch` (default): the routing of every train step, read one step late like the
  loss (one [B, M] fetch per step; with several processes an allgather, so every process
  sees the global batch) plus one sync at each epoch boundary for the epoch's last step.
  No extra compute. Each vector is that example's routing at the step it was trained.
With each example's top-2 fractions the store keeps its top-2 and real token counts per
layer: `data.curriculum_reference = count` (the paper) takes the example with the fewest
top-2 tokens as the reference, `mean` the smallest mean fraction. A store written before
the counts were kept orders by the mean, with one warning.

- `scoring_pass`: at each epoch boundary a jitted forward pass over every train example
  with the current parameters. It routes with the TRAINING gate (the model is rebuilt with
  `eval_gating` set to the training gate, since an evaluation gate such as top1 would
  measure nothing) but `train=False`, so router jitter noise does not blur the measure.
  Costs a forward pass over the split per epoch (default job, 2 busy CPU cores: ~9 s
  against ~47 s of training per epoch) and one extra compile, but no per-step fetches.
  Early in training it predicts the next epoch's routing far better (experiments/curriculum.py).

Epoch 0 uses the default shuffled order; epoch e >= 1 the order written at its boundary.
Only process 0 writes files; with several processes the others wait at a barrier and read
the order it wrote (computed once, so float differences between hosts cannot split it).
numpy memmaps need a local file: with a remote workdir (gs://) the store lives in a local
temporary folder, filled from WORKDIR/curriculum at start and copied back to it before each
checkpoint is saved (and each new epoch order as soon as it is written, for the other
processes), so what a checkpoint needs is stored before the checkpoint is.

jax is imported inside functions: `jaxmoe.data` stays importable without it.
"""

import atexit
import logging
import shutil
import tempfile

import numpy as np
from etils import epath

from jaxmoe.data import curriculum
from jaxmoe.data.complexity_store import ComplexityStore
from jaxmoe.data.options import CURRICULUM_SOURCES as SOURCES
from jaxmoe.data.pipeline import TrainBatches, default_epoch_order
from jaxmoe.storage.mirror import Mirror
from jaxmoe.storage.paths import finished_steps, is_remote

_SCORE_SYNC_EVERY = 16  # scoring batches in flight before their results are fetched
log = logging.getLogger(__name__)


def _to_host(tree):
    """Device arrays (global under multi-process) -> numpy on every process."""
    import jax

    if jax.process_count() == 1:
        return jax.device_get(tree)
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(tree, tiled=True)


def _has_checkpoints(workdir: str) -> bool:
    return bool(finished_steps(epath.Path(workdir) / "checkpoints"))


def _local_store(workdir: str, pull: tuple[str, ...] | None = None) -> tuple[str, Mirror | None]:
    """(local folder of the store, its Mirror or None): WORKDIR/curriculum itself when
    local, else a temporary folder holding the remote files named in `pull` (None = all)."""
    root = str(epath.Path(workdir) / "curriculum")
    if not is_remote(workdir):
        return root, None
    local = tempfile.mkdtemp(prefix="jaxmoe-curriculum-")
    atexit.register(shutil.rmtree, local, ignore_errors=True)
    mirror = Mirror(root, local)
    if pull is None:
        mirror.pull_all()
    for name in pull or ():
        mirror.pull(name)
    return local, mirror


def make_curriculum(config, workdir: str, train: TrainBatches, batch_shardings: dict):
    """The curriculum of `config.data`, installed as `train`'s epoch order; None for none."""
    policy = config.data.curriculum
    source = config.data.curriculum_source
    workdir = str(workdir)
    if policy not in curriculum.POLICIES:
        raise ValueError(f"data.curriculum={policy!r} is not one of {list(curriculum.POLICIES)}")
    if policy == "none":
        # Resuming a curriculum run without it would change the current epoch's order.
        info = epath.Path(workdir) / "curriculum" / "run.json"
        if info.exists() and _has_checkpoints(workdir):
            store_root, _ = _local_store(workdir, pull=("run.json",))
            ComplexityStore(store_root, train.num_examples, writer=False).check_run_info(
                {"data.curriculum": "none"}, resuming=True
            )
        return None
    if source not in SOURCES:
        raise ValueError(f"data.curriculum_source={source!r} is not one of {list(SOURCES)}")
    if config.model.moe.num_experts == 0:
        raise ValueError(
            f"data.curriculum={policy!r} orders examples by their MoE routing, but "
            f"model.moe.num_experts=0 (a dense model)"
        )
    store_root, mirror = _local_store(workdir)
    return Curriculum(
        config,
        store_root,
        train,
        batch_shardings,
        resuming=_has_checkpoints(workdir),
        checkpoints_dir=epath.Path(workdir) / "checkpoints",
        mirror=mirror,
    )


class Curriculum:
    """Hooks for jaxmoe.training.loop (see the module docstring). Same calls on every process."""

    def __init__(
        self,
        config,
        store_root: str,
        train: TrainBatches,
        batch_shardings,
        resuming: bool,
        checkpoints_dir: epath.Path,
        mirror: Mirror | None,
    ):
        import jax

        self.policy = config.data.curriculum
        self.source = config.data.curriculum_source
        self.reference = config.data.curriculum_reference
        self._warned_no_counts = False
        self.train = train
        self.batch_size = train.global_batch_size
        self.log_rows = (train.num_examples // self.batch_size) * self.batch_size
        self.order_kwargs = dict(
            seed=config.train.seed,
            batch_size=self.batch_size,
            shuffle=config.data.shuffle,
        )
        self.multi = jax.process_count() > 1
        self.rows = self._local_rows(jax.process_index(), jax.process_count())
        self.store = ComplexityStore(store_root, train.num_examples, jax.process_index() == 0)
        self.store.check_run_info(
            {
                "data.curriculum": self.policy,
                "data.curriculum_source": self.source,
                "train.seed": self.order_kwargs["seed"],
                "data.shuffle": self.order_kwargs["shuffle"],
            },
            resuming,
        )
        if not resuming and self.store.writer:
            self.store.clear()  # files of an earlier run that never reached a checkpoint
        self.batch_shardings = batch_shardings
        self.model_config = config.model
        self._pending = None  # (epoch, position, ids, routing_BM, tokens_BM, finite) on device
        self._score_fn = None
        self.checkpoints_dir = checkpoints_dir
        self.mirror = mirror  # None: the store is WORKDIR/curriculum itself
        train.set_epoch_order(self.epoch_order)

    def _local_rows(self, process_index: int, process_count: int) -> slice:
        local = self.batch_size // process_count
        return slice(process_index * local, (process_index + 1) * local)

    def epoch_order(self, epoch: int) -> np.ndarray:
        """int64 [N]: the default shuffle for epoch 0, else the order stored for `epoch`."""
        if epoch == 0:
            return default_epoch_order(
                0,
                num_examples=self.train.num_examples,
                seed=self.order_kwargs["seed"],
                shuffle=self.order_kwargs["shuffle"],
            )
        if self.mirror and not self.store.writer:
            self.mirror.pull(self.store.path(epoch, "order").name)  # process 0 stored it
        return self.store.read_order(epoch)

    # --- hooks -------------------------------------------------------------------

    def before_batch(self, params) -> None:
        """At an epoch boundary: freeze complexities, order the next epoch, write both."""
        state = self.train.get_state()
        if state["position"] < self.train.steps_per_epoch:
            return
        epoch, next_epoch = int(state["epoch"]), int(state["epoch"]) + 1
        if self.source == "previous_epoch":
            self._record_pending()
            if self.store.writer:
                self.store.freeze_next(epoch, state["position"] * self.batch_size)
        else:
            vectors_NM, tokens_NM = self._score(params)
            if self.store.writer:
                seen_N = np.ones(self.train.num_examples, bool)
                counts_NM = np.rint(vectors_NM * tokens_NM)
                self.store.write_frozen(next_epoch, vectors_NM, seen_N, counts_NM, tokens_NM)
        if self.store.writer:
            vectors_NM, seen_N = self.store.read_frozen(next_epoch)
            order = curriculum.epoch_order(
                self.policy,
                vectors_NM,
                seen_N,
                epoch=next_epoch,
                counts_NM=self._reference_counts(next_epoch),
                **self.order_kwargs,
            )
            self.store.write_order(next_epoch, order)
            if self.mirror:
                self.mirror.push(self.store.path(next_epoch, "order").name)
        if self.multi:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices(f"jaxmoe curriculum epoch {next_epoch}")

    def observe(self, batch: dict, metrics: dict) -> None:
        """After dispatching a step: keep its routing on device; record the previous step's."""
        if self.source != "previous_epoch":
            return
        state = self.train.get_state()
        current = (
            int(state["epoch"]),
            int(state["position"]) - 1,
            batch["example_ids"],
            metrics["routing_BM"],
            metrics["tokens_BM"],
            metrics["finite"],
        )
        self._record_pending()
        self._pending = current

    def before_save(self, step: int) -> None:
        """Make the log hold every step up to `step` before checkpoint `step` exists; delete
        the files of epochs that no kept checkpoint (nor the running epoch) needs."""
        self._record_pending()
        if not self.store.writer:
            return
        self.store.flush()
        epoch = int(self.train.get_state()["epoch"])
        self.store.collect_garbage(finished_steps(self.checkpoints_dir), epoch)
        self.store.note_checkpoint(step, epoch)
        if self.mirror:
            logs = tuple(p.name for p in self.store.root.glob("epoch_*.log.npy"))
            self.mirror.push_changed(updated_in_place=logs)

    # --- internals -----------------------------------------------------------------

    def _reference_counts(self, epoch: int) -> np.ndarray | None:
        """Top-2 counts for the paper's reference, or None (`mean`, or a store without
        counts: then the mean, warned about once)."""
        if self.policy != "paper" or self.reference != "count":
            return None
        counts_NM = self.store.read_frozen_counts(epoch)
        if counts_NM is None and not self._warned_no_counts:
            self._warned_no_counts = True
            log.warning(
                "curriculum: %s has no top-2 token counts (written before they were kept); "
                "the reference is the smallest mean fraction (data.curriculum_reference=mean)",
                self.store.path(epoch, "frozen"),
            )
        return counts_NM

    def _record_pending(self) -> None:
        if self._pending is None:
            return
        epoch, position, ids, routing, tokens, finite = self._pending
        self._pending = None
        ids_B, top2_BM, tokens_BM, finite = _to_host((ids, routing, tokens, finite))
        top2_BM = np.asarray(top2_BM, np.float32)
        # A non-finite step (skipped under train.nonfinite=skip) measures nothing.
        usable_B = np.all(np.isfinite(top2_BM), axis=1) & bool(np.all(finite))
        if self.store.writer:
            ids_B = np.where(usable_B, np.asarray(ids_B), -1)
            top2_BM = np.nan_to_num(top2_BM)
            tokens_BM = np.asarray(tokens_BM, np.float32)
            # fraction = count / tokens in float32: the product rounds back to the count.
            counts_BM = np.rint(top2_BM * tokens_BM)
            self.store.record(epoch, position, self.log_rows, ids_B, top2_BM, counts_BM, tokens_BM)

    def _score(self, params) -> tuple[np.ndarray, np.ndarray]:
        """(routing, real tokens) float32 [N, M] of every train example under `params` (all
        processes)."""
        import jax

        if self._score_fn is None:
            self._score_fn = _scoring_fn(self.model_config, self.batch_shardings)
        num, size = self.train.num_examples, self.batch_size
        results, in_flight = [], []
        for start in range(0, num, size):
            ids_B = np.arange(start, start + size)
            ids_B[ids_B >= num] = -1  # padding rows of the last batch
            local = self.train.examples.batch(ids_B[self.rows])
            batch = {
                key: jax.make_array_from_process_local_data(sharding, np.asarray(local[key]))
                for key, sharding in self.batch_shardings.items()
                if key in local
            }
            in_flight.append(self._score_fn(params, batch))
            if len(in_flight) == _SCORE_SYNC_EVERY:
                results += _to_host(in_flight)
                in_flight = []
        results += _to_host(in_flight)
        routing, tokens = (np.concatenate([r[i] for r in results])[:num] for i in (0, 1))
        return routing.astype(np.float32), tokens.astype(np.float32)


def _scoring_fn(model_config, batch_shardings: dict):
    """jit((params, batch) -> routing float32 [B, M]) with the training gate, no jitter."""
    import jax
    import jax.numpy as jnp

    from jaxmoe.models.spec import model_spec
    from jaxmoe.training.steps import forward, real_tokens_BM

    scoring_config = model_config.replace(moe=model_config.moe.replace(eval_gating=""))  # train's
    mesh = next(iter(batch_shardings.values())).mesh
    spec = model_spec(scoring_config, mesh)

    def score(params, batch):
        # `rest`: the router-jitter RNG state the graph carries when jitter > 0 (unused here).
        _, aux = forward(spec.graphdef, params, batch, train=False, rest=spec.rest)
        # Layer order as in jaxmoe.training.steps (routing_BM): the model's aux order, layer order.
        routing_BM = jnp.stack([aux[i]["top2_per_example"] for i in aux], axis=1)
        return routing_BM, real_tokens_BM(batch, list(aux))

    return jax.jit(score)
