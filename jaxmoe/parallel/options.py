"""The `mesh` config section: every axis size's type, default and one-line doc, and their
checks, run when the section is made."""

from dataclasses import dataclass

from jaxmoe.errors import ConfigError
from jaxmoe.fields import Options, check_choices, option


@dataclass(frozen=True)
class MeshOptions(Options):
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

    def __post_init__(self) -> None:
        check_choices(self, "mesh.")
        for axis in ("data", "fsdp", "context", "tensor", "expert", "dcn_data", "dcn_fsdp"):
            size = getattr(self, axis)
            if not (size == -1 or size >= 1):
                raise ConfigError(f"mesh.{axis}={size} must be positive or -1")
