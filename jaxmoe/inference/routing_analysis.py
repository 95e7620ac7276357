"""`jaxmoe analyze-routing`: which tokens the router sends to two experts, in every MoE layer.

    jaxmoe analyze-routing --checkpoint runs/default --data embedded --out runs/routing

The checkpoint is restored onto the mesh of its config (`config.mesh`, overridable) and the
data (`jsonl:FILE`, `NAME/SPLIT` or `embedded`, read as `jaxmoe eval` reads it) is scored in
batches. For every valid token and MoE layer the gate's decision (one expert or two) comes
back to the host, where only counters (routing_counts.py) are kept. Writes routing.json,
summary.md and PNG plots (routing_plots.py) into --out.

By default the decision is the one the *training* gate (`model.moe.gating`) makes on the
layer's input, so a model evaluated with `model.moe.eval_gating=top1` still shows which tokens
its adaptive gate finds hard; `gate="eval"` reports the evaluation gate instead. The model's
own forward pass (and so every later layer's input) always uses the evaluation gate, as
`jaxmoe eval` does. Router jitter is never applied.
"""

from jaxmoe.inference.choices import GATE_CHOICES

# JAX and the model code are imported inside the functions: the CLI builds its parser
# without loading them.


def piece_namer(tokenizer, encoder_decoder: bool):
    """id -> the text of that token (special ids, span-corruption sentinels and ids the
    tokenizer does not know by name)."""
    from jaxmoe.data.seq2seq import EXTRA_IDS

    if tokenizer is None:
        return lambda v: f"<id {v}>"
    specials = {tokenizer.pad_id: "<pad>", tokenizer.eos_id: "</s>"}
    if tokenizer.bos_id is not None:
        specials[tokenizer.bos_id] = "<s>"
    size = tokenizer.vocab_size

    def piece(v: int) -> str:
        if v in specials:
            return specials[v]
        if v < size:
            return tokenizer.decode([v])
        if encoder_decoder and v < size + EXTRA_IDS:  # seq2seq.py numbers them from the top
            return f"<extra_id_{size + EXTRA_IDS - 1 - v}>"
        return f"<id {v}>"

    return piece


def _data_batches(config, data_spec: str, tokenizer, data_parallel: int):
    """Global batches of `data_spec`, read by jaxmoe.inference.evaluate's readers."""
    from jaxmoe.inference.evaluate import batch_examples, packed_batches, read_jsonl

    encoder_decoder = config.model.arch == "encoder_decoder"
    if data_spec.startswith("jsonl:"):
        examples = read_jsonl(
            data_spec.removeprefix("jsonl:"), tokenizer, encoder_decoder, config.model.vocab_size
        )
        batch_size = -(-config.train.batch_size // data_parallel) * data_parallel
        return batch_examples(examples, batch_size, encoder_decoder)
    if tokenizer is None:
        raise ValueError("--data: text data needs a tokenizer (--config.data.tokenizer=FILE)")
    return packed_batches(config, data_spec, tokenizer)


def analyze_routing(
    checkpoint: str,
    data_spec: str,
    out_dir: str,
    config=None,
    overrides=(),
    *,
    gate: str = "train",
    min_count: int = 20,
    top_n: int = 15,
    max_batches: int = 0,
) -> dict:
    """Routing statistics of `checkpoint` on `data_spec`, written into `out_dir`.

    config: the run config (default: the one stored with the checkpoint, with `overrides`).
    Returns the summary dict that routing.json holds (see routing_counts.summarize), plus
    `files`: the paths written (by process 0).
    """
    import jax

    from jaxmoe.inference.routing_counts import summarize
    from jaxmoe.inference.routing_plots import write_report
    from jaxmoe.inference.routing_probe import collect_counts
    from jaxmoe.inference.trained_model import TrainedModel
    from jaxmoe.parallel.sharding import data_parallel_size

    if gate not in GATE_CHOICES:
        raise ValueError(f"--gate={gate!r}: expected one of {GATE_CHOICES}")
    text = not data_spec.startswith("jsonl:")
    model = TrainedModel.open(
        checkpoint, config=config, overrides=overrides, tokenizer=text, strict_mesh=True
    )
    config, tokenizer, encoder_decoder = model.config, model.tokenizer, model.encoder_decoder
    batches = _data_batches(config, data_spec, tokenizer, data_parallel_size(model.mesh))
    counts, num_batches = collect_counts(model, batches, gate, max_batches)
    summary = summarize(
        counts, piece_namer(tokenizer, encoder_decoder), min_count=min_count, top_n=top_n
    )
    moe = config.model.moe
    summary |= {
        "checkpoint": model.checkpoint,
        "step": model.step,
        "data": data_spec,
        "gate": (moe.gate if gate == "train" else moe.eval_gate).gating,
        "threshold": moe.gate.threshold,
        "num_batches": num_batches,
    }
    summary["files"] = write_report(summary, out_dir) if jax.process_index() == 0 else []
    return summary
