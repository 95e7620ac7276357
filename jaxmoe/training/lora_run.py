"""A LoRA run (`train.lora.rank` > 0, models/lora.py): adapters in the train state, the
frozen base beside it.

The train state holds the trained leaves only: the adapters, plus the base groups
`train.trainable` names (trained in full beside them, like PEFT's modules_to_save). So the
optimizer state and every checkpoint are theirs alone. The rest of the base is restored from
`train.init_from` once, cast to `train.lora.base_dtype` (the projection weights; norms,
router and biases stay float32) and handed to every step as an argument that is never
updated nor donated: the loss differentiates the trained leaves only, so no gradient of a
base weight is ever formed. The base's content fingerprint (checkpoints/fingerprint.py),
taken before the cast, goes into every checkpoint's meta; resuming, evaluating or merging
with another base is refused in one line.

This generalises train.freeze (training/freezing.py), where the frozen leaves stay in the
state (and in checkpoints) with their gradients dropped: there the checkpoint is the whole
model, here it is the adapters.
"""

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from jaxmoe.checkpoints.fingerprint import tree_fingerprint
from jaxmoe.checkpoints.trees import flatten, join, select, unflatten
from jaxmoe.config.schema import JobConfig
from jaxmoe.errors import ConfigError
from jaxmoe.models.lora import is_adapter
from jaxmoe.models.param_groups import group_of, moe_ffn_paths, parse_groups
from jaxmoe.models.spec import ModelSpec
from jaxmoe.training.lora_options import LoraOptions

# The weights a lower base_dtype stores so: those every product casts to the compute dtype
# anyway (models/layers.py cast_weight), so a bfloat16 base changes no bfloat16 computation.
STORED_LOW = ("query", "key", "value", "out", "q_down", "q_up", "kv_down", "kv_up",
              "wi", "wi_0", "wi_1", "wo", "embedding", "lm_head")  # fmt: skip
# The key in a LoRA checkpoint's meta item recording its base.
META_KEY = "lora_base"


def lora_options(config: JobConfig) -> LoraOptions | None:
    """The train.lora section of a config, or None when it is off."""
    lora = config.train.lora
    return lora if lora.enabled else None


def base_dtype(lora: LoraOptions, model_cfg) -> jnp.dtype:
    """train.lora.base_dtype, `auto` meaning the model's compute dtype."""
    name = str(model_cfg.dtype) if lora.base_dtype == "auto" else lora.base_dtype
    return jnp.dtype(name)


@dataclasses.dataclass
class LoraSplit:
    """The model's parameters split into the trained leaves (the train state's) and the
    frozen base; `trained_spec` is a ModelSpec of the trained leaves alone (what the
    optimizer and the state shardings are built from)."""

    spec: ModelSpec
    trained_spec: ModelSpec
    trained_paths: frozenset
    mesh: object
    dtype: jnp.dtype  # train.lora.base_dtype, resolved

    @classmethod
    def of(cls, spec: ModelSpec, lora: LoraOptions, trainable: str, model_cfg, mesh):
        paths = list(flatten(spec.abstract_params))
        moe_ffns = moe_ffn_paths(paths)
        groups = set(parse_groups(trainable, "train.trainable"))
        trained = frozenset(p for p in paths if is_adapter(p) or group_of(p, moe_ffns) in groups)
        trained_spec = dataclasses.replace(
            spec,
            abstract_params=select(spec.abstract_params, trained.__contains__),
            param_specs=select(spec.param_specs, trained.__contains__),
            param_axes=select(spec.param_axes, trained.__contains__),
        )
        return cls(spec, trained_spec, trained, mesh, base_dtype(lora, model_cfg))

    def abstract(self, keep, dtype_of=None) -> dict:
        """The abstract leaves `keep(path)` selects, sharded as the model's, in their stored
        dtypes or `dtype_of(path, leaf)`."""
        specs = flatten(self.spec.param_specs)
        return unflatten(
            {
                p: jax.ShapeDtypeStruct(
                    a.shape,
                    a.dtype if dtype_of is None else dtype_of(p, a),
                    sharding=NamedSharding(self.mesh, specs[p]),
                )
                for p, a in flatten(self.spec.abstract_params).items()
                if keep(p)
            }
        )

    def stored_base(self) -> dict:
        """The abstract base as its checkpoint stores it (float32): every leaf but the
        adapters (the groups trained in full included: their values start from it)."""
        return self.abstract(lambda p: not is_adapter(p))

    def base_in_memory(self) -> dict:
        """The abstract frozen base as a step receives it: STORED_LOW weights in the base
        dtype, the rest float32."""

        def dtype_of(path, leaf):
            return self.dtype if path[-1] in STORED_LOW else leaf.dtype

        return self.abstract(lambda p: p not in self.trained_paths, dtype_of)

    def cast_base(self, stored: dict) -> dict:
        """The frozen leaves of a restored base, cast to their in-memory dtypes."""
        wanted = self.base_in_memory()
        base = select(stored, lambda p: p not in self.trained_paths)
        return jax.jit(
            lambda tree: jax.tree.map(lambda x, a: x.astype(a.dtype), tree, wanted),
            out_shardings=jax.tree.map(lambda a: a.sharding, wanted),
        )(base)


def restore_base(split: LoraSplit, path: str, layouts) -> tuple[dict, dict, str]:
    """(frozen base in memory, initial values of the base groups trained in full, the
    base's fingerprint) from the base checkpoint at `path`."""
    from jaxmoe.checkpoints.manager import restore_params

    stored = restore_params(path, split.stored_base(), layouts)
    fingerprint = tree_fingerprint(stored)
    full_groups = select(stored, split.trained_paths.__contains__)
    return split.cast_base(stored), full_groups, fingerprint


def init_trained(model_cfg, lora, seed: int, split: LoraSplit, optimizer, shardings, mesh,
                 full_groups: dict):  # fmt: skip
    """The initial train state: fresh adapters (B = 0), the groups trained in full from the
    base checkpoint, a fresh optimizer state; created already sharded."""
    from jaxmoe.models import build_model
    from jaxmoe.models.spec import model_params, model_rngs

    def init(key, full_groups):
        model = build_model(model_cfg, rngs=model_rngs(key), lora=lora)
        _, params = model_params(model)
        adapters = select(params, is_adapter)
        trained = join(adapters, full_groups)
        return {
            "step": jnp.zeros((), jnp.int32),
            "params": trained,
            "opt_state": optimizer.init(trained),
        }

    with jax.set_mesh(mesh):
        return jax.jit(init, out_shardings=shardings)(jax.random.key(seed), full_groups)


def check_same_base(meta: dict, fingerprint: str, where: str, base_path: str) -> None:
    """ConfigError unless the checkpoint's recorded base (its meta) is the one given."""
    recorded = (meta or {}).get(META_KEY, {})
    if not recorded:
        raise ConfigError(f"{where}: holds no record of its LoRA base (not a LoRA checkpoint?)")
    if recorded.get("fingerprint") != fingerprint:
        raise ConfigError(
            f"{where}: its adapters were trained on a base with fingerprint "
            f"{str(recorded.get('fingerprint'))[:16]}... ({recorded.get('init_from')}), not on "
            f"{base_path} ({fingerprint[:16]}...): name the base they belong to"
        )


def base_record(fingerprint: str, init_from: str) -> dict:
    """What a LoRA checkpoint's meta records of its base."""
    return {META_KEY: {"fingerprint": fingerprint, "init_from": str(init_from)}}


class LoraRun:
    """What `jaxmoe train` does differently under train.lora: the state of the trained
    leaves, the frozen base restored beside it, and the base's record in every checkpoint.
    `None` stands for a run without LoRA wherever the loop takes one of these."""

    def __init__(self, config, spec: ModelSpec, mesh, lora: LoraOptions):
        if not config.train.init_from:
            raise ConfigError(
                "train.lora needs train.init_from: the base checkpoint its adapters belong to"
            )
        if config.train.init_optimizer:
            raise ConfigError(
                "train.init_optimizer with train.lora: the base's optimizer state is not the "
                "adapters'; leave it out"
            )
        self.config, self.lora, self.mesh = config, lora, mesh
        self.split = LoraSplit.of(spec, lora, config.train.trainable, config.model, mesh)
        self.base = None
        self.full_groups: dict = {}
        self.fingerprint = ""

    @property
    def trained_spec(self) -> ModelSpec:
        return self.split.trained_spec

    def base_shardings(self) -> dict:
        return jax.tree.map(lambda a: a.sharding, self.split.base_in_memory())

    def load_base(self, layouts) -> None:
        """Restores the base from train.init_from (once, before the state)."""
        path = self.config.train.init_from
        self.base, self.full_groups, self.fingerprint = restore_base(self.split, path, layouts)

    def record(self) -> dict:
        """The meta entries every checkpoint of this run carries."""
        return base_record(self.fingerprint, self.config.train.init_from)

    def check_resumed(self, meta: dict, step_dir) -> None:
        check_same_base(
            meta, self.fingerprint, f"checkpoint {str(step_dir)!r}", self.config.train.init_from
        )

    def init_state(self, seed: int, optimizer, shardings) -> dict:
        return init_trained(
            self.config.model, self.lora, seed, self.split, optimizer, shardings, self.mesh,
            self.full_groups,
        )  # fmt: skip

    def full(self, trained: dict) -> dict:
        """The model's whole parameter tree: the frozen base joined to the trained leaves."""
        return join(self.base, trained)

    def reference(self) -> dict:
        """DPO's reference as a tree like the state's params: the adapters at zero (base +
        zero adapters is the base, computed the same way), the groups trained in full at
        their base values."""
        abstract = self.split.abstract(self.split.trained_paths.__contains__)
        adapters = select(abstract, is_adapter)
        shardings = jax.tree.map(lambda a: a.sharding, adapters)
        zeros = jax.jit(lambda: _zeros_like(adapters), out_shardings=shardings)()
        return join(zeros, self.full_groups)


def _zeros_like(tree):
    return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), tree)


def lora_needs_base(path: str) -> str:
    """The line refusing a LoRA checkpoint opened without its base."""
    from jaxmoe.checkpoints.manager import read_meta

    recorded = read_meta(path).get(META_KEY, {})
    hint = f" (its run's train.init_from was {recorded['init_from']})" if recorded else ""
    return (
        f"checkpoint {path!r} holds LoRA adapters only (train.lora.rank > 0): name the base "
        f"checkpoint they belong to with --base CKPT (--config.train.init_from=CKPT){hint}"
    )


def lora_params(checkpoint: str, base: str, config, spec: ModelSpec, mesh) -> dict:
    """The whole model of a LoRA checkpoint on `mesh`: the base checkpoint `base` (checked
    against the fingerprint the adapters recorded) joined to the checkpoint's own leaves."""
    from jaxmoe.checkpoints.manager import read_meta, resolve_checkpoint, restore_params
    from jaxmoe.models.stack import layer_layouts

    lora = lora_options(config)
    split = LoraSplit.of(spec, lora, config.train.trainable, config.model, mesh)
    layouts = layer_layouts(config.model)
    frozen, _, fingerprint = restore_base(split, base, layouts)
    step_dir = resolve_checkpoint(checkpoint)
    check_same_base(read_meta(checkpoint), fingerprint, f"checkpoint {str(step_dir)!r}", base)
    trained = restore_params(checkpoint, split.abstract(split.trained_paths.__contains__))
    return join(frozen, trained)
