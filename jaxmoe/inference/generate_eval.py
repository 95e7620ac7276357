"""`jaxmoe eval --task generate`: generate for jsonl `inputs`, score against `targets`.

Generation is batched and sharded (decode.Generator: greedy or sampled; beam_search.py:
beam search with T5X's length penalty). Inputs are sorted by length and run in batches of a
fixed number of rows, so each prompt-length bucket compiles once. An encoder-decoder reads
the input followed by EOS; a decoder-only model continues the input text.

Metrics, as the GQA / T5 papers report them, all in percent: ROUGE-1/2/L F-measure
(Google's `rouge-score`, Porter stemming), corpus BLEU (`sacrebleu`, its default 13a
tokenisation) and SQuAD's exact match / token F1 (lower case, no punctuation, no articles).
"""

import collections
import json
import re
import string
import time

import numpy as np
from etils import epath

from jaxmoe.inference import across_processes
from jaxmoe.inference.decode import Generation, Sampling, fit_context, without_stop
from jaxmoe.inference.stop_strings import StopStrings, cut_at_strings
from jaxmoe.storage.paths import is_remote
from jaxmoe.storage.temporaries import write_atomically


def normalize_answer(text: str) -> str:
    """SQuAD's answer normalisation: lower case, no punctuation, articles or extra spaces."""
    text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def token_f1(prediction: str, target: str) -> float:
    """SQuAD's F1 of the normalised tokens (bags of words)."""
    pred, gold = normalize_answer(prediction).split(), normalize_answer(target).split()
    if not pred or not gold:
        return float(pred == gold)
    common = sum((collections.Counter(pred) & collections.Counter(gold)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(gold)
    return 2 * precision * recall / (precision + recall)


def text_metrics(predictions: list[str], targets: list[str]) -> dict:
    """ROUGE-1/2/L (mean F), corpus BLEU, exact match and token F1, all in percent."""
    try:
        import sacrebleu
        from rouge_score import rouge_scorer
    except ImportError as error:
        raise RuntimeError(f"{error}; install the eval extra: pip install 'jaxmoe[eval]'") from None
    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)
    rouge = collections.defaultdict(list)
    for prediction, target in zip(predictions, targets, strict=True):
        for name, score in scorer.score(target, prediction).items():
            rouge[name].append(score.fmeasure)
    pairs = list(zip(predictions, targets, strict=True))
    return {
        **{name: 100 * float(np.mean(values)) for name, values in rouge.items()},
        "bleu": float(sacrebleu.corpus_bleu(predictions, [targets]).score),
        "exact_match": 100
        * float(np.mean([normalize_answer(p) == normalize_answer(t) for p, t in pairs])),
        "f1": 100 * float(np.mean([token_f1(p, t) for p, t in pairs])),
    }


def read_numbered_pairs(path: str) -> list[tuple[int, str, str]]:
    """(line number, inputs, targets) of each example of a JSON-lines file."""
    from jaxmoe.inference.evaluate import jsonl_records

    pairs = []
    for line_no, record in jsonl_records(path):
        if not isinstance(record, dict) or not all(
            isinstance(record.get(key), str) for key in ("inputs", "targets")
        ):
            raise ValueError(f"{path}:{line_no}: --task generate needs 'inputs' and 'targets' text")
        pairs.append((line_no, record["inputs"], record["targets"]))
    if not pairs:
        raise ValueError(f"--data jsonl:{path}: no examples")
    return pairs


def generate_all(
    generator, prompts, *, rows, max_new_tokens, sampling, beams, alpha, seed, stop=None
):
    """New tokens for every prompt, in length-sorted batches of `rows` prompts (filler
    prompts complete the last one); returns (tokens per prompt, summed Generation). With
    `stop` (StopStrings) sampled or greedy rows end inside the loop at their stop strings."""
    from jaxmoe.inference.beam_search import beam_search

    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    tokens: list = [None] * len(prompts)
    total = Generation([], 0.0, 0.0, 0.0)
    # Several processes: each generates every N-th batch on its own devices, all gathered.
    for start in across_processes.shard(list(range(0, len(order), rows))):
        chunk = order[start : start + rows]
        batch = [prompts[i] for i in chunk] + [[generator.eos_id]] * (rows - len(chunk))
        if beams > 1:
            result, _ = beam_search(generator, batch, max_new_tokens, beams, alpha)
        else:
            result = generator.generate(batch, max_new_tokens, sampling, seed + start, stop)
        for i, new in zip(chunk, result.tokens, strict=False):
            tokens[i] = new
            total.tokens.append(new)
        total.prefill_s += result.prefill_s
        total.decode_s += result.decode_s
        total.compile_s += result.compile_s
        total.steps += result.steps
    if across_processes.multi_process():
        parts = across_processes.allgather_objects((tokens, total))
        total = Generation([], 0.0, 0.0, 0.0)
        for part_tokens, part in parts:
            tokens = [a if a is not None else b for a, b in zip(tokens, part_tokens, strict=True)]
            total.tokens += part.tokens
            total.prefill_s = max(total.prefill_s, part.prefill_s)  # the processes overlap
            total.decode_s = max(total.decode_s, part.decode_s)
            total.compile_s = max(total.compile_s, part.compile_s)
            total.steps += part.steps
    return tokens, total


def generate_eval(
    checkpoint: str,
    data_spec: str,
    *,
    max_new_tokens: int = 64,
    num_beams: int = 1,
    length_penalty: float = 0.6,
    temperature: float | None = None,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    stop_strings: tuple[str, ...] = (),
    batch_size: int = 0,
    output: str | None = None,
    config=None,
    overrides=(),
    truncate: bool = False,
) -> dict:
    """Generate for every `inputs` of `data_spec` (jsonl:FILE) and score against `targets`;
    predictions are cut before the first of `stop_strings` as lm-eval cuts them. An input
    that with `max_new_tokens` exceeds the model's context is refused, or with `truncate`
    cut to its last tokens (logged); an empty one is refused (nothing to continue)."""
    from jaxmoe.data.tokenizer import with_bos
    from jaxmoe.inference.trained_model import TrainedModel

    if not data_spec.startswith("jsonl:"):
        raise ValueError(f"--task generate reads --data jsonl:FILE, got {data_spec!r}")
    path = data_spec.removeprefix("jsonl:")
    numbered = read_numbered_pairs(path)
    pairs = [(inputs, targets) for _, inputs, targets in numbered]
    if num_beams > 1 and (temperature or top_k or top_p < 1.0):
        raise ValueError(
            "--num_beams > 1 searches; it does not sample (leave out --temperature, --top_k "
            "and --top_p)"
        )
    sampling = Sampling.from_flags(temperature, top_k, top_p)
    from jaxmoe.inference.trained_model import checkpoint_config

    if config is None:
        config = checkpoint_config(checkpoint, overrides)
    mesh = across_processes.process_mesh(config.mesh)  # a process's own devices
    model = TrainedModel.open(checkpoint, mesh, config=config, overrides=overrides)
    config, tokenizer, mesh = model.config, model.tokenizer, model.mesh
    generator = model.generator()
    encoder_decoder = model.encoder_decoder
    # As `jaxmoe decode` and training: BOS first when the tokenizer has one; an encoder
    # reads the input followed by EOS.
    eos = [tokenizer.eos_id] if encoder_decoder else []
    prompts = [with_bos(tokenizer, tokenizer.encode(inputs)) + eos for inputs, _ in pairs]
    labels = [f"{path}:{line_no}: 'inputs'" for line_no, _, _ in numbered]
    for label, prompt in zip(labels, prompts, strict=True):
        if not prompt:  # a decoder continues its input: an empty one has nothing to continue
            raise ValueError(f"{label} gives no tokens (a decoder-only model needs a prompt)")
    prompts = fit_context(
        prompts, config.model.max_len, max_new_tokens, truncate, encoder_decoder, labels
    )
    dp = generator.batch_multiple
    rows = -(-(batch_size or config.train.batch_size) // dp) * dp
    start = time.perf_counter()
    tokens, total = generate_all(
        generator,
        prompts,
        rows=rows,
        max_new_tokens=max_new_tokens,
        sampling=sampling,
        beams=num_beams,
        alpha=length_penalty,
        seed=seed,
        stop=StopStrings(stop_strings, tokenizer, generator.vocab_limit) if stop_strings else None,
    )
    seconds = time.perf_counter() - start
    predictions = [
        cut_at_strings(tokenizer.decode(without_stop(new, generator.stop_ids)[0]), stop_strings)
        for new in tokens
    ]
    targets = [target for _, target in pairs]
    result = {
        "num_examples": len(pairs),
        **text_metrics(predictions, targets),
        "decoding": f"beam{num_beams} alpha={length_penalty}"
        if num_beams > 1
        else sampling.describe(),
        "new_tokens": total.num_new_tokens,
        "decode_steps": total.steps,
        "tokens_per_s": total.tokens_per_s,
        "compile_s": total.compile_s,
        "seconds": seconds,
        "mesh": dict(mesh.shape),
        "checkpoint": model.checkpoint,
        "step": model.step,
    }
    if output and across_processes.process_index() == 0:  # every process holds them all
        lines = [
            json.dumps({"inputs": i, "targets": t, "prediction": p}, ensure_ascii=False)
            for (i, t), p in zip(pairs, predictions, strict=True)
        ]
        text = "\n".join(lines) + "\n"
        if is_remote(output):  # an object store replaces an object whole
            epath.Path(output).write_text(text)
        else:  # whole or absent, even when interrupted
            write_atomically(output, text.encode())
    return result
