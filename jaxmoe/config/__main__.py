"""`python -m jaxmoe.config`: every config key, its type, default and one-line doc."""

from jaxmoe.config.schema import describe

if __name__ == "__main__":
    print("\n".join(describe()))
