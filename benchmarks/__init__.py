"""jaxmoe's benchmarks: one module per benchmark, run from the repository root.

    python -m benchmarks                  # the list, one line each (also --list)
    python -m benchmarks NAME [args...]   # run benchmark NAME (NAME --help for its flags)
    python -m benchmarks.NAME [args...]   # the same

Each benchmark is a module with `main(argv)`. Shared pieces: `worker_protocol` (a worker
process driven over stdin/stdout, or printing JSON lines), `peer_harness` (starting a worker
under its own interpreter, MaxText's venv, quiet-run checks) and `results` (the dated JSON
under docs/results/ and the Markdown table). The package is not installed with jaxmoe: run
it from a checkout, where `benchmarks` is importable from the working directory.

This file and the shared pieces import only the standard library: workers run under other
interpreters (MaxText's venv) and must not pull in JAX or torch through the package.
"""
