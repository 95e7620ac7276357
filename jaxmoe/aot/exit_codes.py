"""`jaxmoe compile`'s exit status, importable without JAX (the CLI's parsers need it)."""

EXIT_FITS, EXIT_FAILS = 0, 2
