"""`jaxmoe compile --config C --topology v5p-128|h100-32`: the train step compiled ahead of time
for a TPU topology or an NVIDIA GPU cluster on this host; exit 0 if it fits, 2 if not or on
error."""

import json
import sys

from jaxmoe.aot.exit_codes import EXIT_FAILS, EXIT_FITS
from jaxmoe.cli.flags import add_override_flag, module_docstring, positive_float, positive_int
from jaxmoe.errors import ConfigError


def add_parser(subparsers) -> None:
    """Register `jaxmoe compile` on the CLI's subparsers (`--config.a.b=v` handled by caller)."""
    parser = subparsers.add_parser(
        "compile",
        help="compile the train step for a TPU pod or GPU cluster on this host; does it fit",
        description=module_docstring("jaxmoe.aot.compile_check").split("\n\n")[1],
    )
    parser.add_argument("--config", required=True, help="config file, optionally with :variant")
    add_override_flag(parser)
    parser.add_argument(
        "--topology",
        required=True,
        help="TPU slice (v5p-128, v6e-256, v5p:4x4x8) or GPU cluster (h100-32: 32 H100s in "
        "nodes of 8; h100:4x8; h200, b200, a100-80g; gb200-72: one NVL72 rack)",
    )
    parser.add_argument(
        "--num_slices",
        type=positive_int,
        default=1,
        help="slices joined over DCN (GPU: NVLink domains joined by the cluster network)",
    )
    parser.add_argument(
        "--step_time", type=positive_float, default=None, help="seconds per step, to report MFU"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(run=run)


def _compile_on_cpu_host() -> None:
    """Keep this process off any local TPU or GPU: compiling needs none, and a running job
    may hold it. Only when the user chose no platform."""
    import jax

    if jax.config.jax_platforms is None:
        jax.config.update("jax_platforms", "cpu")


def run(args) -> int:
    """`jaxmoe compile`: print the report (or JSON); 0 if the step fits, 2 if not or on error."""
    overrides = args.overrides
    from jaxmoe.aot.compile_check import compile_for_topology
    from jaxmoe.aot.report import format_report
    from jaxmoe.config.loading import load_config

    _compile_on_cpu_host()
    try:
        config = load_config(args.config, overrides)
        result = compile_for_topology(config, args.topology, args.num_slices, args.step_time)
    except (ConfigError, ValueError, RuntimeError) as error:
        # RuntimeError covers the compiler's own (JaxRuntimeError): one line, no traceback.
        message = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
        if args.json:
            print(json.dumps({"verdict": "error", "error": message}))
        print(f"jaxmoe compile: error: {message}", file=sys.stderr)
        return EXIT_FAILS
    if args.json:
        print(json.dumps(result, default=_json_default))
    else:
        print(format_report(result, args.config))
    return EXIT_FITS if result["verdict"] == "fits" else EXIT_FAILS


def _json_default(value):
    import numpy as np

    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")
