"""`TrainedModel.open(path)`: a trained checkpoint ready to use, from a command or a notebook.

    from jaxmoe import TrainedModel
    model = TrainedModel.open("runs/default")       # the newest step of a workdir
    ids = model.tokenizer.encode("The router")
    result = model.generator().generate([ids], max_new_tokens=16)
    print(model.tokenizer.decode(result.tokens[0]))

It holds the four things every inference command needs, opened the one way
(checkpoints/restore.py): the stored config with the command line's overrides, the
checkpoint's own tokenizer (or one named on the command line), the mesh, and the
parameters read straight into their shards on it, on first use.
"""

import functools

from jaxmoe.checkpoints.restore import (
    checkpoint_config,
    checkpoint_step,
    checkpoint_tokenizer,
    restore_on_mesh,
)


class TrainedModel:
    """A checkpoint opened for inference: `config`, `tokenizer` (None when not needed and
    the checkpoint has none), `mesh`, `spec` (models/spec.py), `params` (read on first
    access), and `checkpoint` / `step`, the step directory it came from."""

    def __init__(self, checkpoint: str, config, tokenizer, mesh, spec):
        self.config, self.tokenizer, self.mesh, self.spec = config, tokenizer, mesh, spec
        where = checkpoint_step(checkpoint)
        self.checkpoint, self.step = where["checkpoint"], where["step"]

    @classmethod
    def open(
        cls,
        path: str,
        mesh=None,
        *,
        config=None,
        overrides=(),
        tokenizer: bool = True,
        strict_mesh: bool = False,
    ) -> "TrainedModel":
        """Opens the checkpoint at `path` (a step directory, or a workdir for its newest
        step). `mesh`: a jax Mesh, default the one `config.mesh` describes. `config`: a
        config to use instead of the stored one (`--config FILE`); `overrides`:
        `--config.KEY=VALUE` strings. `tokenizer=False`: token-id input only, so a
        checkpoint without a tokenizer opens (with `tokenizer` None). `strict_mesh`:
        refuse a mesh whose axes do not divide the tensors they split."""
        from jax.sharding import Mesh

        from jaxmoe.config.validation import resolve_vocab_size
        from jaxmoe.errors import ConfigError
        from jaxmoe.models.spec import model_spec
        from jaxmoe.parallel.mesh import make_mesh
        from jaxmoe.parallel.platforms import skip_absent_tpu
        from jaxmoe.parallel.sharding import strict_param_check

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
            resolve_vocab_size(config, opened.vocab_size)
        mesh = make_mesh(config.mesh) if mesh is None else mesh
        spec = model_spec(config.model, mesh)
        if strict_mesh:
            strict_param_check(spec, mesh)
        return cls(path, config, opened, mesh, spec)

    @functools.cached_property
    def params(self) -> dict:
        """The parameters, sharded on `mesh` as `spec` lays them out (either layer layout)."""
        from jaxmoe.models.stack import layer_layouts

        layouts = layer_layouts(self.config.model)
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
