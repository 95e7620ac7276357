"""jaxmoe: mixture-of-experts LMs with adaptive gating and grouped-query attention in JAX."""

__version__ = "0.1.0"


def __getattr__(name: str):
    # Imported on first use: `jaxmoe --help` and the converters need no JAX start-up.
    if name == "TrainedModel":
        from jaxmoe.inference.trained_model import TrainedModel

        return TrainedModel
    raise AttributeError(f"module 'jaxmoe' has no attribute {name!r}")
