"""Values the inference commands' flags take, in a module that imports nothing: the CLI
builds its parsers (and answers `--help`) without starting JAX."""

GATE_CHOICES = ("train", "eval")  # whose decisions are counted: the training or the eval gate
SPECULATIVE = ("mtp",)  # `decode --speculative`: the drafts (speculative.py)
