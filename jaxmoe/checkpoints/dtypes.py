"""The dtypes a converter may write parameters in (`--dtype`)."""

import ml_dtypes
import numpy as np

from jaxmoe.errors import CheckpointError

OUTPUT_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}


def output_dtype(name: str) -> np.dtype:
    if name not in OUTPUT_DTYPES:
        raise CheckpointError(f"--dtype={name!r} is not one of {list(OUTPUT_DTYPES)}")
    return OUTPUT_DTYPES[name]
