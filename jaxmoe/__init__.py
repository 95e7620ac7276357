"""jaxmoe: mixture-of-experts LMs with adaptive gating and grouped-query attention in JAX."""

__version__ = "0.1.0"
