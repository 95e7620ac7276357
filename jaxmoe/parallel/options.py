"""The `mesh` config section: every axis size's type, default and one-line doc, and their
checks (jaxmoe/config builds the ConfigDict defaults from these and runs the checks through
`jaxmoe.config.typed`; mesh.py fills a partial mapping of axis sizes from them)."""

from dataclasses import dataclass

from jaxmoe.config.fields import option
from jaxmoe.errors import ConfigError


@dataclass(frozen=True)
class MeshOptions:
    """mesh: the sizes of the device mesh's axes (and, multislice, of their slice spans)."""

    data: int = option(-1, "data-parallel axis (-1 = the remaining devices)")
    fsdp: int = option(1, "parameter-sharded data-parallel axis")
    tensor: int = option(1, "tensor-parallel axis (heads, FFN hidden)")
    expert: int = option(1, "expert-parallel axis (also splits the batch)")
    context: int = option(
        1,
        "context-parallel axis: splits each sequence (load-balanced causal chunks; attention "
        "gathers keys/values); docs/long_context.md",
    )
    dcn_data: int = option(-1, "multislice: slices the data axis spans (-1 = the remaining slices)")
    dcn_fsdp: int = option(1, "multislice: slices the fsdp axis spans")

    def check(self) -> None:
        for axis in ("data", "fsdp", "context", "tensor", "expert", "dcn_data", "dcn_fsdp"):
            size = getattr(self, axis)
            if not (size == -1 or size >= 1):
                raise ConfigError(f"mesh.{axis}={size} must be positive or -1")
