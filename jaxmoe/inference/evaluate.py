"""`jaxmoe eval`: restore a checkpoint onto any mesh and score data, sharded.

Scoring follows T5X and Hugging Face so numbers compare 1:1: a decoder-only `targets` list
of n ids is one sequence with n-1 predictions (no BOS added); an encoder-decoder reads
`inputs` in the encoder and predicts every target id from `targets` shifted right with 0.
A checkpoint trained on a fine-tuning format (its stored `data.format`) reads `jsonl:FILE`
records of that format and scores what training scored: the completion and its EOS, the
assistant turns, the seq2seq targets (`--per_example`: each example's mean over them).
"""

import functools
import json
import logging
import math
import re
from dataclasses import dataclass

import jax
import numpy as np
from etils import epath
from jax.sharding import NamedSharding

from jaxmoe.errors import ConfigError
from jaxmoe.inference import across_processes
from jaxmoe.inference.trained_model import TrainedModel, checkpoint_config
from jaxmoe.parallel.sharding import batch_spec, data_parallel_size
from jaxmoe.training.steps import eval_metrics, eval_step

log = logging.getLogger(__name__)


@dataclass
class Example:
    targets: list[int]
    inputs: list[int] | None = None
    # Decoder-only: loss weight of each token as a target (its first is never one); None = 1.
    weights: list[float] | None = None


def _ids(value, tokenizer, what: str, where: str, add_eos: bool, vocab_size: int) -> list[int]:
    """Token ids of one field: text (tokenized) or a list of ints in [0, vocab_size)."""
    if isinstance(value, str):
        if tokenizer is None:
            raise ValueError(
                f"{where}: '{what}' is text but the checkpoint has no tokenizer; "
                f"pass --config.data.tokenizer=FILE.model or give token ids"
            )
        from jaxmoe.data.tokenizer import with_bos

        ids = tokenizer.encode(value)
        # Encoder-decoder sides end with EOS; LM text starts as training documents do.
        return [*ids, tokenizer.eos_id] if add_eos else with_bos(tokenizer, ids)
    if not isinstance(value, list):
        raise ValueError(f"{where}: '{what}' must be text or a list of token ids, not {value!r}")
    for i, x in enumerate(value):
        # JSON true/false parse as bool, a subclass of int; 2.0 is a float: neither is an id.
        if isinstance(x, bool) or not isinstance(x, int):
            raise ValueError(f"{where}: '{what}'[{i}] = {json.dumps(x)} is not a token id")
        if not 0 <= x < vocab_size:
            # An id outside the embedding table is clamped or wrapped by the gather on the
            # device: a NaN or a finite wrong loss, never an error.
            raise ValueError(
                f"{where}: '{what}'[{i}] = {x} is outside the vocabulary [0, {vocab_size})"
            )
    return value


def jsonl_records(path: str):
    """(line number, value) for each non-empty line of the JSON-lines file `path`."""
    file = epath.Path(path)
    if not file.exists():
        raise ValueError(f"--data jsonl:{path}: no such file")
    if file.is_dir():
        raise ValueError(f"--data jsonl:{path}: is a directory (jsonl:FILE names one file)")
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(
            f"--data jsonl:{path}: not UTF-8 text (byte {error.start}: {error.reason})"
        ) from None
    for line_no, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield line_no, json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}:{line_no}: not JSON ({error.msg})") from None


def read_format_jsonl(path: str, data, tokenizer) -> list[Example]:
    """Examples of a fine-tuning `data.format` (the checkpoint's, data/formats.py), scored
    as training scored them: the completion, the assistant turns, the seq2seq targets."""
    from jaxmoe.data.formats import ExampleEncoder, RecordFields

    if tokenizer is None:
        raise ValueError(f"data.format={data.format!r} reads text: the checkpoint has no tokenizer")
    fields, encoder = RecordFields.of(data), ExampleEncoder(data, tokenizer)
    examples = []
    for line_no, record in jsonl_records(path):
        document = fields.read(record, f"{path}:{line_no}")
        example = None if document is None else encoder.encode(document)
        if example is None:
            raise ValueError(f"{path}:{line_no}: the example has no tokens")
        if data.format == "seq2seq":
            examples.append(Example(targets=[int(i) for i in example[1]],
                                    inputs=[int(i) for i in example[0]]))  # fmt: skip
            continue
        ids, weights = example
        if len(ids) < 2 or not weights[1:].any():
            raise ValueError(f"{path}:{line_no}: nothing to score (no completion / assistant turn)")
        examples.append(Example(targets=[int(i) for i in ids], weights=[float(w) for w in weights]))
    if not examples:
        raise ValueError(f"--data jsonl:{path}: no examples")
    return examples


def read_jsonl(path: str, tokenizer, encoder_decoder: bool, vocab_size: int) -> list[Example]:
    """Examples from a JSON-lines file: `text`, or `inputs`/`targets` (strings or id lists).

    Every id must lie in [0, vocab_size) (the model's embedding table)."""
    examples = []
    for line_no, record in jsonl_records(path):
        where = f"{path}:{line_no}"
        if not isinstance(record, dict):
            raise ValueError(
                f"{where}: expected a JSON object with 'text' or 'targets', "
                f"got {json.dumps(record)[:40]}"
            )

        def ids(key: str, add_eos: bool, record=record, where=where) -> list[int]:
            return _ids(record[key], tokenizer, key, where, add_eos, vocab_size)

        if encoder_decoder:
            if "inputs" not in record or "targets" not in record:
                raise ValueError(f"{where}: an encoder-decoder needs 'inputs' and 'targets'")
            examples.append(Example(targets=ids("targets", True), inputs=ids("inputs", True)))
        elif "targets" in record or "text" in record:
            key = "targets" if "targets" in record else "text"
            targets = ids(key, False)
            if len(targets) < 2:
                raise ValueError(f"{where}: '{key}' has fewer than 2 tokens")
            examples.append(Example(targets=targets))
        else:
            raise ValueError(f"{where}: expected 'text' or 'targets'")
    if not examples:
        raise ValueError(f"--data jsonl:{path}: no examples")
    return examples


def fit_examples(examples: list[Example], max_len: int, truncate: bool) -> list[Example]:
    """Examples checked against the model's context `max_len` (model.max_len; 0 = unknown,
    nothing checked): a decoder reads len(targets) - 1 ids, an encoder-decoder reads
    `inputs` and `targets` each. Too long is refused, or with `truncate` cut to its first
    tokens (the prefix is scored, as Hugging Face's truncation does) and counted in a
    warning."""
    if not max_len:
        return examples
    out, cut = [], 0
    for i, e in enumerate(examples):
        sides = {"targets": len(e.targets) - (0 if e.inputs is not None else 1)}
        if e.inputs is not None:
            sides["inputs"] = len(e.inputs)
        side, length = max(sides.items(), key=lambda kv: kv[1])
        if length <= max_len:
            out.append(e)
            continue
        if not truncate:
            raise ValueError(
                f"example {i}: '{side}' is {length} tokens, longer than the model's context "
                f"of {max_len} (model.max_len, the longest sequence it was trained on); "
                f"--truncate scores its first {max_len}"
            )
        cut += 1
        if e.weights is not None:  # a fine-tuning format: its oldest tokens go (formats.py)
            from jaxmoe.data.formats import fit_decoder_example

            fitted = fit_decoder_example(np.array(e.targets), np.array(e.weights), max_len, "left")
            if fitted is None:
                raise ValueError(
                    f"example {i}: its last scored part does not fit the model's context of "
                    f"{max_len} tokens, even with --truncate"
                )
            out.append(Example(targets=fitted[0].tolist(), weights=fitted[1].tolist()))
        elif e.inputs is None:
            out.append(Example(targets=e.targets[: max_len + 1]))
        else:
            out.append(Example(targets=e.targets[:max_len], inputs=e.inputs[:max_len]))
    if cut:
        log.warning("%d of %d examples cut to the model's context of %d tokens (--truncate)",
                    cut, len(examples), max_len)  # fmt: skip
    return out


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def batch_examples(examples: list[Example], batch_size: int, encoder_decoder: bool):
    """Padded global batches (one shape for all, so one compile) and the example count."""
    if encoder_decoder:
        dec_len = _round_up(max(len(e.targets) for e in examples), 16)
        enc_len = _round_up(max(len(e.inputs) for e in examples), 16)
    else:
        dec_len = _round_up(max(len(e.targets) - 1 for e in examples), 16)
    batches = []
    for start in range(0, len(examples), batch_size):
        chunk = examples[start : start + batch_size]
        inputs = np.zeros((batch_size, dec_len), np.int32)
        targets = np.zeros((batch_size, dec_len), np.int32)
        weights = np.zeros((batch_size, dec_len), np.float32)
        encoder = np.zeros((batch_size, enc_len), np.int32) if encoder_decoder else None
        for row, example in enumerate(chunk):
            t = example.targets
            if encoder_decoder:
                n = len(t)
                inputs[row, :n] = [0, *t[:-1]]
                targets[row, :n] = t
                encoder[row, : len(example.inputs)] = example.inputs
            else:
                n = len(t) - 1
                inputs[row, :n] = t[:-1]
                targets[row, :n] = t[1:]
            weights[row, :n] = 1.0 if example.weights is None else example.weights[1:]
        batch = {"inputs": inputs, "targets": targets, "weights": weights}
        if encoder_decoder:
            batch["encoder_inputs"] = encoder
        batches.append(batch)
    return batches


# Data kinds `train` and `prepare` read (data.source) that evaluation does not.
_TRAINING_KINDS = ("text", "parquet")
# A TFDS name may carry a version after a colon ("mnist:3.0.1/test"); a path never starts so.
_TFDS_VERSION = re.compile(r"^[0-9*]")


def check_eval_data(data_spec: str) -> None:
    """ValueError naming --data unless it is jsonl:FILE, NAME/SPLIT or embedded: a `KIND:`
    that is not jsonl would otherwise be looked up as a TFDS dataset name."""
    kind, colon, rest = data_spec.partition(":")
    if not colon or kind in ("jsonl", "tfds") or "/" in kind or _TFDS_VERSION.match(rest):
        return
    known = f"{kind}: data is read by train and prepare (data.source)"
    raise ValueError(
        f"--data {data_spec!r}: "
        + (known if kind in _TRAINING_KINDS else f"unknown kind {kind + ':'!r}")
        + "; evaluation reads jsonl:FILE, NAME/SPLIT (a prepared TFDS dataset) or embedded"
    )


def packed_batches(config, data_spec: str, tokenizer):
    """Validation-style packed windows of a TFDS split (`NAME/SPLIT`) or `embedded`."""
    from jaxmoe.data.pipeline import eval_batches

    check_eval_data(data_spec)
    data_spec = data_spec.removeprefix("tfds:")  # the kind training's data.source names
    if data_spec in ("embedded", "embedded/validation"):
        source, split = "embedded", "validation"
    else:
        name, _, split = data_spec.rpartition("/")
        if not name:
            raise ValueError(f"--data {data_spec!r}: expected NAME/SPLIT, embedded or jsonl:FILE")
        source = f"tfds:{name}"
    data = config.data.replace(source=source, eval_split=split)
    batches = eval_batches(data, config.train, tokenizer, spans=config.span_corruption)
    return [{k: v for k, v in b.items() if k != "example_ids"} for b in batches]


def check_recordable(config, num_examples) -> None:
    """ValueError unless `--record_routing` can record: an MoE decoder, jsonl:FILE data."""
    if config.model.arch != "decoder" or not config.model.moe.num_experts:
        raise ValueError("--record_routing records the routing of an MoE decoder")
    if num_examples is None:
        raise ValueError("--record_routing needs jsonl:FILE data (one sequence per line)")


def write_recorded(path: str, model_cfg, experts_NLMK, lengths: list[int]) -> None:
    """The routing record of sequences in rows of experts_NLMK, the first `lengths[i]`
    positions of row i (a sequence of n ids has n - 1 routed positions)."""
    from jaxmoe.data.routing_record import Record, write_record
    from jaxmoe.models.moe.replay import moe_layer_ids

    sequences = [experts_NLMK[i, :n].astype(np.int16) for i, n in enumerate(lengths)]
    moe = model_cfg.moe
    slots = experts_NLMK.shape[-1]
    write_record(path, Record(sequences, tuple(moe_layer_ids(model_cfg)), moe.num_experts, slots))


def evaluate(
    checkpoint: str,
    data_spec: str,
    config=None,
    per_example: bool = False,
    overrides=(),
    truncate: bool = False,
    record_routing: str | None = None,
) -> dict:
    """Score `data_spec` with the parameters of `checkpoint`; returns the result dict, which
    names the checkpoint step it scored. Sequences longer than the model's context are
    refused, or cut with `truncate`; a non-finite loss is an error, never a number.
    `record_routing`: a file to write each sequence's chosen experts to (a routing record,
    data/routing_record.py), jsonl:FILE data of an MoE decoder only."""
    check_eval_data(data_spec)  # before the checkpoint is opened
    if config is None:
        config = checkpoint_config(checkpoint, overrides)
    # Token-id data needs no tokenizer; text does (refused in one line without one), and so
    # does a fine-tuning format (the checkpoint's data.format: read as training read it).
    text = not data_spec.startswith("jsonl:") or config.data.format != "text"
    # Several processes: each scores every N-th batch on its own devices (across_processes).
    mesh = across_processes.process_mesh(config.mesh)
    model = TrainedModel.open(
        checkpoint, mesh, config=config, overrides=overrides, tokenizer=text, strict_mesh=True
    )
    config, tokenizer, mesh, spec = model.config, model.tokenizer, model.mesh, model.spec
    encoder_decoder = model.encoder_decoder
    dp = data_parallel_size(mesh)
    batch_size = _round_up(config.train.batch_size, dp)
    if data_spec.startswith("jsonl:") and config.data.format != "text":
        examples = read_format_jsonl(data_spec.removeprefix("jsonl:"), config.data, tokenizer)
        examples = fit_examples(examples, config.model.max_len, truncate)
        batches = batch_examples(examples, batch_size, encoder_decoder)
        num_examples = len(examples)
    elif data_spec.startswith("jsonl:"):
        examples = read_jsonl(
            data_spec.removeprefix("jsonl:"), tokenizer, encoder_decoder, config.model.vocab_size
        )
        examples = fit_examples(examples, config.model.max_len, truncate)
        batches = batch_examples(examples, batch_size, encoder_decoder)
        num_examples = len(examples)
    else:
        if tokenizer is None:
            raise ValueError("--data: text data needs a tokenizer (--config.data.tokenizer=FILE)")
        batches = packed_batches(config, data_spec, tokenizer)
        num_examples = None

    if record_routing:
        check_recordable(config, num_examples)
    params = model.params  # read after the data: a bad file fails before a long restore
    shardings = {
        key: NamedSharding(mesh, batch_spec(mesh, value.ndim, value.shape[0]))
        for key, value in batches[0].items()
    }
    step = jax.jit(
        functools.partial(
            eval_step, graphdef=spec.graphdef, rest=spec.rest, record_routing=bool(record_routing)
        )
    )
    totals = {"nll_sum": 0.0, "correct_sum": 0.0, "weight_sum": 0.0}
    mine = across_processes.shard(list(range(len(batches))))
    outputs = {}
    with jax.set_mesh(mesh):
        for index in mine:
            batch = batches[index]
            device_batch = {k: jax.device_put(v, shardings[k]) for k, v in batch.items()}
            outputs[index] = jax.device_get(step(params, device_batch))
    for part in across_processes.allgather_objects(outputs):
        outputs.update(part)
    losses, counts = [], []
    for index in range(len(batches)):  # in batch order: the same sums on any process count
        out = outputs[index]
        for key in totals:
            totals[key] += float(out[key])
        losses.append(out["nll_per_example"])
        counts.append(out["weight_per_example"])
    result = eval_metrics(totals)
    if not math.isfinite(result["loss"]):
        raise ValueError(
            f"eval of {checkpoint}: the loss is {result['loss']} (the parameters give "
            f"non-finite logits: check the checkpoint with `jaxmoe eval` on other data, or "
            f"its conversion)"
        )
    result |= {"checkpoint": model.checkpoint, "step": model.step}
    if record_routing:
        recorded = [outputs[index]["experts_BLMK"] for index in range(len(batches))]
        lengths = [len(e.targets) - 1 for e in examples]
        if jax.process_index() == 0:
            write_recorded(record_routing, config.model, np.concatenate(recorded), lengths)
        result["routing_record"] = record_routing
    if per_example:
        if num_examples is None:
            raise ConfigError("--per_example needs jsonl:FILE data (one example per line)")
        nll = np.concatenate(losses)[:num_examples]
        n = np.concatenate(counts)[:num_examples]
        result["per_example"] = [
            {"loss": float(a / max(b, 1.0)), "num_tokens": int(b)}
            for a, b in zip(nll, n, strict=True)
        ]
    return result
