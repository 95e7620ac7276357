"""`TrainedModel.open(path)`: a trained checkpoint ready to use, from a command or a notebook.

    from jaxmoe import TrainedModel
    model = TrainedModel.open("runs/default")       # the newest step of a workdir
    ids = model.tokenizer.encode("The router")
    result = model.generator().generate([ids], max_new_tokens=16)
    print(model.tokenizer.decode(result.tokens[0]))

It holds the four things every inference command needs, opened the one way: the stored
config with the command line's overrides (config/stored.py), the checkpoint's own tokenizer
(or one named on the command line), the mesh, and the parameters read straight into their
shards on it, on first use (checkpoints/restore.py).

A checkpoint is data, never instructions: what its stored config says about where to read
or write (`data.source`, `data.mixture`, `data.cache_dir`, `data.data_dir`,
`train.init_from`) is dropped, and its tokenizer is the copy inside it
(checkpoints/tokenizer_item.py); only the command line names other places.
"""

import functools

from jaxmoe.checkpoints.manager import read_stored_config
from jaxmoe.checkpoints.restore import checkpoint_step, restore_on_mesh
from jaxmoe.checkpoints.tokenizer_item import check_tokenizer_fits
from jaxmoe.config.schema import JobConfig
from jaxmoe.config.stored import opened_config
from jaxmoe.errors import ConfigError


def _named(overrides, key: str) -> bool:
    """True when `--config.KEY=...` is among `overrides`."""
    return any(o.removeprefix("--").removeprefix("config.").startswith(key + "=")
               for o in overrides)  # fmt: skip


def checkpoint_config(checkpoint: str, overrides=()) -> JobConfig:
    """The config stored with `checkpoint`, its places reset to the defaults, then the
    `--config.KEY=VALUE` overrides applied. A tokenizer named there is not looked up in
    the checkpoint (nor refused there)."""
    named = _named(overrides, "data.tokenizer")
    return opened_config(checkpoint, overrides, tokenizer=not named)


def checkpoint_tokenizer(checkpoint: str, config: JobConfig, overrides=(), required=True):
    """The tokenizer to use with `checkpoint`: the one named by `--config.data.tokenizer`,
    else the checkpoint's own copy, else the one a `--config` file names.
    Without either: a ConfigError saying how to name one, or None when not `required`
    (token-id data needs none). A tokenizer with more ids than the model's embedding
    table is refused: those ids would silently index past it."""
    from jaxmoe.checkpoints.manager import resolve_checkpoint
    from jaxmoe.data.tokenizer import open_tokenizer

    if _named(overrides, "data.tokenizer"):
        path, where = config.data.tokenizer, "--config.data.tokenizer"
    else:
        own = read_stored_config(checkpoint).get("data", {}).get("tokenizer")
        path, where = own or config.data.tokenizer, "the checkpoint's own tokenizer"
    if not path:
        if not required:
            return None
        raise ConfigError(
            f"checkpoint {str(resolve_checkpoint(checkpoint))!r} holds no tokenizer (saved "
            f"before checkpoints carried one, or converted without tokenizer files): name "
            f"one with --config.data.tokenizer=FILE (a .model, a tokenizer.json or its folder)"
        )
    tokenizer = open_tokenizer(path, eos_token=config.data.eos_token)
    check_tokenizer_fits(tokenizer, config.model.vocab_size, where)
    return tokenizer


class TrainedModel:
    """A checkpoint opened for inference: `config`, `tokenizer` (None when not needed and
    the checkpoint has none), `mesh`, `spec` (models/spec.py), `params` (read on first
    access), and `checkpoint` / `step`, the step directory it came from."""

    def __init__(
        self, checkpoint: str, config: JobConfig, tokenizer, mesh, spec, base: str | None = None
    ):
        self.config, self.tokenizer, self.mesh, self.spec = config, tokenizer, mesh, spec
        where = checkpoint_step(checkpoint)
        self.checkpoint, self.step = where["checkpoint"], where["step"]
        self.base = base  # a LoRA checkpoint's base (its adapters are joined to it)

    @classmethod
    def open(
        cls,
        path: str,
        mesh=None,
        *,
        config: JobConfig | None = None,
        overrides=(),
        tokenizer: bool = True,
        strict_mesh: bool = False,
        base: str | None = None,
    ) -> "TrainedModel":
        """Opens the checkpoint at `path` (a step directory, or a workdir for its newest
        step). `mesh`: a jax Mesh, default the one `config.mesh` describes. `config`: a
        config to use instead of the stored one (`--config FILE`); `overrides`:
        `--config.KEY=VALUE` strings. `tokenizer=False`: token-id input only, so a
        checkpoint without a tokenizer opens (with `tokenizer` None). `strict_mesh`:
        refuse a mesh whose axes do not divide the tensors they split. `base`: the base
        checkpoint of a LoRA checkpoint (training/lora_run.py), which holds adapters only:
        the model runs base + adapters, unmerged, after the base's fingerprint is checked
        against the one the adapters recorded (default: `--config.train.init_from`, which
        the commands' `--base CKPT` sets; a checkpoint never names its base itself)."""
        from jax.sharding import Mesh

        from jaxmoe.models.spec import model_spec
        from jaxmoe.parallel.mesh import make_mesh
        from jaxmoe.parallel.platforms import skip_absent_tpu
        from jaxmoe.parallel.sharding import strict_param_check
        from jaxmoe.training.lora_run import lora_needs_base, lora_options

        if mesh is not None and not isinstance(mesh, Mesh):
            raise TypeError(
                f"TrainedModel.open: mesh={mesh!r} is not a jax.sharding.Mesh (None: the "
                f"checkpoint's mesh.*; overrides=['mesh.data=2'] changes it)"
            )
        skip_absent_tpu()  # as the CLI: no libtpu probe (and its stderr lines) without a TPU
        if config is None:
            config = checkpoint_config(path, overrides)
        opened = checkpoint_tokenizer(path, config, overrides, required=tokenizer)
        if config.model.vocab_size == 0:  # a training config (--config): sized as training did
            if opened is None:
                raise ConfigError(
                    "model.vocab_size=0 needs a tokenizer: set --config.model.vocab_size"
                )
            config = config.replace(model=config.model.with_vocab(opened.vocab_size))
        mesh = make_mesh(config.mesh) if mesh is None else mesh
        lora = lora_options(config)
        if lora is None and base:
            raise ConfigError(
                f"base={base!r}: checkpoint {path!r} is a whole model, not LoRA adapters"
            )
        base = base or (config.train.init_from if lora is not None else None)
        if lora is not None and not base:
            raise ConfigError(lora_needs_base(path))
        spec = model_spec(config.model, mesh, lora=lora)
        if strict_mesh:
            strict_param_check(spec, mesh)
        return cls(path, config, opened, mesh, spec, base)

    @functools.cached_property
    def params(self) -> dict:
        """The parameters, sharded on `mesh` as `spec` lays them out (either layer layout)."""
        from jaxmoe.models.stack import layer_layouts

        layouts = layer_layouts(self.config.model)
        if self.base:
            from jaxmoe.training.lora_run import lora_params

            return lora_params(self.checkpoint, self.base, self.config, self.spec, self.mesh)
        return restore_on_mesh(self.checkpoint, self.spec, self.mesh, layouts)

    def generator(self, speculative: str = ""):
        """A compiled KV-cache Generator (decode.py) of this model, stopping at every EOS id
        of its tokenizer; `speculative="mtp"`: greedy decoding drafted by the model's
        multi-token-prediction module (speculative.py)."""
        from jaxmoe.inference.decode import Generator

        cls = Generator
        if speculative == "mtp":
            from jaxmoe.inference.speculative import MTPGenerator

            cls = MTPGenerator
        elif speculative:
            raise ValueError(f"--speculative {speculative!r}: expected mtp")
        return cls.for_tokenizer(
            self.config.model, self.params, self.mesh, self.tokenizer, spec=self.spec
        )

    @property
    def encoder_decoder(self) -> bool:
        return self.config.model.arch == "encoder_decoder"

    def __repr__(self) -> str:
        return (
            f"TrainedModel({self.checkpoint!r}, step={self.step}, mesh={dict(self.mesh.shape)}, "
            f"tokenizer={self.tokenizer!r})"
        )
