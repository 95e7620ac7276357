"""jaxmoe's experiments: the papers' measurements reproduced on jaxmoe, one module each.

    python -m experiments                  # the list, one line each (also --list)
    python -m experiments NAME [args...]   # run experiment NAME (NAME --help for its flags)
    python -m experiments.NAME [args...]   # the same

`benchmarks/` holds what a release reruns (speed and memory, against peers); this package
holds the research questions: does adaptive gating, the routing curriculum, a GQA conversion
recipe do what its paper says at this scale. Same runner (`benchmarks.runner`) and the same
result format (`benchmarks.results`: the Markdown table, and the dated JSON under
docs/results/ with the host recorded). Run from a checkout, like `benchmarks/`.
"""
