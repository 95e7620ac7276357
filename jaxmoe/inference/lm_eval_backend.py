"""jaxmoe checkpoints in EleutherAI's lm-evaluation-harness: `jaxmoe lm-eval ...`.

`JaxmoeLM` is an lm-eval model (registered as `jaxmoe`) that restores a checkpoint (a
decoder, or an encoder-decoder as lm-eval's `seq2seq` models) onto a device mesh and answers
lm-eval's three request kinds:

- loglikelihood / loglikelihood_rolling: context + continuation in one forward pass, the
  continuation's summed log-probabilities read from the logits. Sequences are sorted by
  length, right-padded to power-of-two lengths and batched in a fixed number of rows, so
  each (rows, length) bucket compiles once, whatever the number of requests.
- generate_until: the KV-cache generator of `jaxmoe decode`, batched the same way; a row
  stops inside the loop once its stop strings allow (inference/stop_strings.py) and its
  text is cut at the first stop string as lm-eval's own backends cut it.

Tokenization follows lm-eval's Hugging Face backend (TemplateLM): context and continuation
are encoded together and split at the context's length (an encoder-decoder encodes them
apart, the context ending with EOS), an empty context becomes EOS (the tokenizer has no
BOS), and rolling windows are lm-eval's own. So an exported checkpoint
scores the same under `--model hf` and `--model jaxmoe`.

On several processes (`launch/local.sh N -- lm-eval ...`, a pod) each process is one of
lm-eval's data-parallel ranks: lm-eval gives it every N-th document, it evaluates them on its
own devices (`mesh=` describes one process's mesh) and lm-eval gathers the results on
process 0 through `gather_object` (across_processes.py: jax's `process_allgather`).

Model args: `checkpoint=PATH` (required), `mesh=data:4/tensor:2` (mesh axis sizes),
`max_length=N` (default: train.seq_len), `max_gen_toks=N` (default 256) and any config
override as `section.key=value` (e.g. `model.dtype=float32`).
"""

import contextlib
import functools
import logging
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import (
    handle_stop_sequences,
    normalize_gen_kwargs,
    postprocess_generated_text,
)
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from jaxmoe.errors import ConfigError
from jaxmoe.inference import across_processes
from jaxmoe.inference.decode import Sampling, bucket, without_stop
from jaxmoe.inference.lm_eval_checks import check_paths
from jaxmoe.inference.stop_strings import StopStrings
from jaxmoe.parallel.sharding import batch_spec, data_parallel_size
from jaxmoe.training.steps import forward

log = logging.getLogger(__name__)
# Under lm-eval's logger, which its command line configures (--verbosity).
_lm_eval_log = logging.getLogger("lm_eval.models.jaxmoe")

DEFAULT_BATCH_SIZE = 32
# jax's own monitoring events for tracing, lowering and XLA compiling a program.
COMPILE_EVENTS = frozenset(
    {
        "/jax/core/compile/jaxpr_trace_duration",
        "/jax/core/compile/jaxpr_to_mlir_module_duration",
        "/jax/core/compile/backend_compile_duration",
    }
)


class CompileClock:
    """Seconds this process has spent tracing, lowering and compiling so far (read from
    jax.monitoring, which reports every jit compile), so a phase's wall time can be split
    into compile and the rest."""

    seconds = 0.0
    _listening = False

    @classmethod
    def start(cls) -> None:
        if not cls._listening:
            jax.monitoring.register_event_duration_secs_listener(cls._record)
            cls._listening = True

    @classmethod
    def _record(cls, event: str, duration: float, **kwargs) -> None:
        del kwargs
        if event in COMPILE_EVENTS:
            cls.seconds += duration


def mesh_overrides(mesh: str) -> list[str]:
    """`data:4/tensor:2` -> ["mesh.data=4", "mesh.tensor=2"]."""
    overrides = []
    for part in str(mesh).split("/"):
        axis, sep, size = part.partition(":")
        if not sep or not axis or not size.lstrip("-").isdigit():
            raise ConfigError(f"model_args mesh={mesh!r}: expected AXIS:SIZE[/AXIS:SIZE...]")
        overrides.append(f"mesh.{axis}={size}")
    return overrides


def _token_logprobs(params, batch, *, graphdef, rest):
    """Per-position log p(target) [B, L] and whether the target is the argmax [B, L]."""
    targets_BL = batch["targets"]
    logits_BLV, _ = forward(graphdef, params, batch, train=False, rest=rest)
    logp_BLV = jax.nn.log_softmax(logits_BLV.astype(jnp.float32), axis=-1)
    logp_BL = jnp.take_along_axis(logp_BLV, targets_BL[..., None], axis=-1)[..., 0]
    return logp_BL, logits_BLV.argmax(-1) == targets_BL


def _batch_size(value) -> int:
    """lm-eval passes --batch_size as int or text (`auto`, `auto:4`): auto means our default."""
    if value is None or str(value).startswith("auto"):
        return DEFAULT_BATCH_SIZE
    size = int(value)
    if size < 1:
        raise ValueError(f"--batch_size={value} must be >= 1")
    return size


def _check_positive(name: str, value) -> None:
    """A token count from --model_args (lm-eval passes it parsed: int, or text if not one);
    None keeps the default. 0 would score every request against an empty window."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"--model_args {name}={value}: expected a positive integer")


def _check_context(max_length, context: int) -> None:
    """`max_length` from --model_args within the model's context (model.max_len, 0 =
    unknown): windows past it would score positions the model was never trained on."""
    if max_length and context and int(max_length) > context:
        raise ValueError(
            f"--model_args max_length={max_length} exceeds the model's context of {context} "
            f"tokens (model.max_len, the longest sequence it was trained on)"
        )


@register_model("jaxmoe")
class JaxmoeLM(TemplateLM):
    """A jaxmoe checkpoint (decoder, dense or MoE with adaptive gating, or encoder-decoder)."""

    def __init__(
        self,
        checkpoint: str | None = None,
        mesh: str | None = None,
        batch_size=None,
        max_length: int | None = None,
        max_gen_toks: int = 256,
        device=None,
        max_batch_size=None,
        **config_overrides,
    ):
        super().__init__()
        del device, max_batch_size  # the mesh decides placement; batches have one size
        CompileClock.start()
        with self._phase("load"):
            self._open(checkpoint, mesh, batch_size, max_length, max_gen_toks, config_overrides)

    def _open(self, checkpoint, mesh, batch_size, max_length, max_gen_toks, config_overrides):
        """Restore the checkpoint onto this process's mesh and prepare the scoring program."""
        from jaxmoe.inference.trained_model import TrainedModel, checkpoint_config
        from jaxmoe.storage.paths import absolute_path

        if not checkpoint:
            raise ValueError("--model_args checkpoint=PATH is required")
        bad = [k for k in config_overrides if "." not in k]
        if bad:
            raise ValueError(
                f"--model_args {bad[0]}: unknown; expected checkpoint, mesh, max_length, "
                f"max_gen_toks or a config override such as model.dtype=float32"
            )
        for name, value in (("max_length", max_length), ("max_gen_toks", max_gen_toks)):
            _check_positive(name, value)
        overrides = [f"{k}={v}" for k, v in config_overrides.items()]
        overrides += mesh_overrides(mesh) if mesh else []
        self.checkpoint = absolute_path(checkpoint)
        config = checkpoint_config(self.checkpoint, overrides)
        mesh = across_processes.process_mesh(config.mesh)  # a process's own devices
        model = TrainedModel.open(self.checkpoint, mesh, config=config, overrides=overrides)
        self._rank, self._world_size = jax.process_index(), jax.process_count()
        self.config = config = model.config
        # lm-eval's TemplateLM encodes an encoder-decoder's context and continuation apart.
        self.encoder_decoder = model.encoder_decoder
        self.backend = "seq2seq" if self.encoder_decoder else "causal"
        self.tokenizer, self.mesh, self.spec = model.tokenizer, model.mesh, model.spec
        self.generator = model.generator()
        self.params = self.generator.params
        dp = data_parallel_size(self.mesh)
        self.rows = -(-_batch_size(batch_size) // dp) * dp
        _check_context(max_length, config.model.max_len)
        self._max_length = int(max_length or config.train.seq_len)
        self._max_gen_toks = int(max_gen_toks)
        self._score = jax.jit(
            functools.partial(_token_logprobs, graphdef=self.spec.graphdef, rest=self.spec.rest)
        )
        self.compiled_shapes: set[tuple[int, int]] = set()

    # ------------------------------------------------------------------ lm-eval interface

    def all_gather(self, tensor):
        """lm-eval's count of requests per rank: every process's tensor, concatenated."""
        import torch

        gathered = across_processes.allgather_array(tensor.detach().cpu().numpy())
        return torch.from_numpy(gathered.reshape(-1, *tensor.shape[1:]))

    def gather_object(self, obj, dst=0):
        with self._phase("gather", requests=len(obj) if isinstance(obj, list) else None):
            gathered = across_processes.allgather_objects(obj)
        return gathered if self.rank == dst else None

    def barrier(self) -> None:
        across_processes.barrier("jaxmoe lm-eval")

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.path.replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens=None, **kwargs) -> list[int]:
        """The text's ids; an encoder-decoder's input ends with EOS (as T5's tokenizer and
        jaxmoe's training add it) unless lm-eval asks for no special tokens."""
        del kwargs
        eos = self.encoder_decoder and add_special_tokens is not False
        return self.tokenizer.encode(string) + ([self.eot_token_id] if eos else [])

    def tok_decode(self, tokens) -> str:
        return self.tokenizer.decode(tokens)

    def _loglikelihood_tokens(
        self, requests, disable_tqdm: bool = False, kind: str = "loglikelihood", **kwargs
    ):
        """[(key, context ids, continuation ids)] -> [(sum log p(continuation), greedy)]."""
        sequences = []
        for _, context, continuation in requests:
            if not continuation:
                raise ValueError("lm-eval asked to score an empty continuation")
            if len(continuation) > self.max_length:
                raise ValueError(
                    f"a continuation of {len(continuation)} tokens does not fit in "
                    f"max_length={self.max_length} (--model_args max_length=N)"
                )
            if self.encoder_decoder:  # the encoder reads the context's last max_length ids
                sequences.append((context[-self.max_length :], continuation))
            else:  # as lm-eval's HF backend: the last max_length + 1 ids, the final one unfed
                whole = (context + continuation)[-(self.max_length + 1) :]
                sequences.append((whole, len(continuation)))
        tokens = sum(len(s[0]) + (len(s[1]) if self.encoder_decoder else 0) for s in sequences)
        with self._phase(kind, requests=len(sequences), tokens=tokens):
            scores = self._score_sequences(sequences, disable_tqdm)
        for (key, _, _), score in zip(requests, scores, strict=True):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, score)
        return scores

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owners = [], []
        for index, request in enumerate(requests):
            (text,) = request.args
            for context, continuation in map(
                make_disjoint_window,
                get_rolling_token_windows(
                    token_list=self.tok_encode(text),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                ),
            ):
                windows.append((None, context, continuation))
                owners.append(index)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(
            owners,
            self._loglikelihood_tokens(windows, disable_tqdm, kind="loglikelihood_rolling"),
            strict=True,
        ):
            totals[owner] += logprob
        for request, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    @contextlib.contextmanager
    def _phase(self, name: str, **counts):
        """Log how long the phase took on this process, and how much of it was compile: a
        readable line, and a timing line for benchmarks (across_processes.log_timing)."""
        compiled, begin, wall = CompileClock.seconds, time.time(), time.perf_counter()
        yield
        seconds = time.perf_counter() - wall
        compile_s = CompileClock.seconds - compiled
        rank, world = jax.process_index(), jax.process_count()
        requests = counts.get("requests")
        if requests:
            _lm_eval_log.info(
                "process %d/%d: %d %s requests in %.2f s, %.2f s of it compiling "
                "(%.1f ms each without)",
                rank, world, requests, name, seconds, compile_s,
                1e3 * (seconds - compile_s) / requests,
            )  # fmt: skip
        across_processes.log_timing(name, begin, seconds, compile_seconds=compile_s, **counts)

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        tokens = sum(len(self.tok_encode(request.args[0])) for request in requests)
        with self._phase("generate_until", requests=len(requests), tokens=tokens):
            return self._generate_until(requests, disable_tqdm)

    def _generate_until(self, requests, disable_tqdm: bool) -> list[str]:
        eos_text = self.tokenizer.decode([self.eot_token_id])
        groups: dict[str, list[int]] = {}
        for index, request in enumerate(requests):
            groups.setdefault(repr(sorted(request.args[1].items())), []).append(index)
        results: list[str | None] = [None] * len(requests)
        bar = tqdm(total=len(requests), disable=disable_tqdm, desc="jaxmoe generate_until")
        for indices in groups.values():
            kwargs = normalize_gen_kwargs(requests[indices[0]].args[1], self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos_text)
            max_new = int(kwargs.pop("max_gen_toks"))
            if max_new >= self.max_length:
                raise ValueError(
                    f"max_gen_toks={max_new} leaves no room for a context within "
                    f"max_length={self.max_length}"
                )
            sampling = Sampling(
                temperature=float(kwargs.get("temperature", 0.0)) if kwargs["do_sample"] else 0.0,
                top_k=int(kwargs.get("top_k") or 0),
                top_p=float(kwargs.get("top_p") or 1.0),
            )
            # A decoder's context and new tokens share max_length; an encoder's input has it.
            room = self.max_length if self.encoder_decoder else self.max_length - max_new
            prompts = {
                i: (self.tok_encode(requests[i].args[0]) or [self.prefix_token_id])[-room:]
                for i in indices
            }
            stop = StopStrings(until, self.tokenizer, self.generator.vocab_limit)
            order = sorted(indices, key=lambda i: -len(prompts[i]))
            for start in range(0, len(order), self.rows):
                chunk = order[start : start + self.rows]
                # Filler rows keep every batch at `rows` rows: one compile per length bucket.
                batch = [prompts[i] for i in chunk]
                batch += [[self.eot_token_id]] * (self.rows - len(chunk))
                generation = self.generator.generate(batch, max_new, sampling, start, stop)
                for i, new in zip(chunk, generation.tokens, strict=False):
                    new, _ = without_stop(new, self.generator.stop_ids)
                    text = postprocess_generated_text(self.tok_decode(new), until, None)
                    results[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
                bar.update(len(chunk))
        bar.close()
        return results

    # ------------------------------------------------------------------ batched scoring

    def _score_sequences(self, sequences, disable_tqdm: bool) -> list[tuple[float, bool]]:
        """Decoder: [(token ids, n scored at the end)]; encoder-decoder: [(encoder ids,
        decoder targets)]. -> [(sum of the scored log p, all of them greedy)]."""
        length_of = (lambda s: len(s[1])) if self.encoder_decoder else (lambda s: len(s[0]) - 1)
        order = sorted(range(len(sequences)), key=lambda i: -length_of(sequences[i]))
        results: list[tuple[float, bool] | None] = [None] * len(sequences)
        sharding = NamedSharding(self.mesh, batch_spec(self.mesh, 2, self.rows))
        batches = range(0, len(order), self.rows)
        for start in tqdm(batches, disable=disable_tqdm, desc="jaxmoe loglikelihood"):
            chunk = order[start : start + self.rows]
            batch, scored = self._batch([sequences[i] for i in chunk])
            self.compiled_shapes.add(tuple(v.shape for v in batch.values()))
            with jax.set_mesh(self.mesh):
                logp, greedy = jax.device_get(
                    self._score(self.params, jax.device_put(batch, sharding))
                )
            for row, (i, span) in enumerate(zip(chunk, scored, strict=True)):
                results[i] = (float(logp[row, span].sum()), bool(greedy[row, span].all()))
        return results

    def _batch(self, sequences) -> tuple[dict, list[slice]]:
        """Arrays of `rows` rows right-padded to power-of-two lengths, and each row's span
        of scored positions. An encoder-decoder's decoder reads its targets shifted right
        with 0 (T5's start token); its encoder padding (id 0) is masked by the model."""
        if self.encoder_decoder:
            enc_len = bucket(max(len(enc) for enc, _ in sequences))
            dec_len = bucket(max(len(dec) for _, dec in sequences))
            encoder = np.zeros((self.rows, enc_len), np.int32)
            inputs = np.zeros((self.rows, dec_len), np.int32)
            targets = np.zeros((self.rows, dec_len), np.int32)
            for row, (enc, dec) in enumerate(sequences):
                encoder[row, : len(enc)] = enc
                inputs[row, 1 : len(dec)] = dec[:-1]
                targets[row, : len(dec)] = dec
            batch = {"encoder_inputs": encoder, "inputs": inputs, "targets": targets}
            return batch, [slice(0, len(dec)) for _, dec in sequences]
        length = bucket(max(len(ids) - 1 for ids, _ in sequences))
        inputs = np.zeros((self.rows, length), np.int32)
        targets = np.zeros((self.rows, length), np.int32)
        for row, (ids, _) in enumerate(sequences):
            inputs[row, : len(ids) - 1] = ids[:-1]
            targets[row, : len(ids) - 1] = ids[1:]
        spans = [slice(len(ids) - 1 - n, len(ids) - 1) for ids, n in sequences]
        return {"inputs": inputs, "targets": targets}, spans


def check_model_args(argv: list[str]) -> None:
    """The token counts in `--model_args`, read as lm-eval reads them, checked before lm-eval
    loads its tasks: a bad one is then the only line printed."""
    import argparse

    from jaxmoe.compat.private_apis import lm_eval_merge_dict_action

    parser = argparse.ArgumentParser(add_help=False)
    action = lm_eval_merge_dict_action()
    parser.add_argument("--model_args", "-a", nargs="+", action=action, default=None)
    try:
        model_args = parser.parse_known_args(argv)[0].model_args or {}
    except (SystemExit, ValueError):  # lm-eval's own parser reports it in its words
        return
    for name in ("max_length", "max_gen_toks"):
        _check_positive(name, model_args.get(name))
    checkpoint = model_args.get("checkpoint")
    if checkpoint and model_args.get("max_length") and "model.max_len" not in model_args:
        from jaxmoe.config.stored import read_config

        max_len = read_config(checkpoint, tokenizer=False).model.max_len
        _check_context(model_args["max_length"], max_len)


def run_lm_eval(argv: list[str]) -> int:
    """`jaxmoe lm-eval [lm-eval run flags]`: lm-eval's own command line, `--model jaxmoe`."""
    from lm_eval.__main__ import cli_evaluate

    args = list(argv)
    if args[:1] == ["run"]:
        args = args[1:]
    for flag in ("--model", "-M"):
        if flag in args or any(a.startswith(f"{flag}=") for a in args):
            raise ValueError("--model is implied (jaxmoe); pass the checkpoint in --model_args")
    if args[:1] in (["ls"], ["validate"]):
        sys.argv = ["jaxmoe lm-eval", *args]
        cli_evaluate()
        return 0
    check_model_args(args)
    check_paths(args)
    sys.argv = ["jaxmoe lm-eval", "run", "--model", "jaxmoe", *args]
    with builtin_tasks_skipped(included_tasks_only(args)):
        cli_evaluate()
    return 0


def included_tasks_only(argv: list[str]) -> bool:
    """Whether every `--tasks` name is a task (not a group or tag) of `--include_path`'s
    own: lm-eval's index of its built-in task configs (14683 of them, 10-12 s of every
    process's start-up on this host) is then not needed. Task files, globs, groups and tags
    keep lm-eval's full index."""
    import argparse

    from lm_eval.tasks import TaskManager

    from jaxmoe.compat.private_apis import lm_eval_single_task_kinds

    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--tasks", "-t", nargs="+", default=None)
    parser.add_argument("--include_path", default=None)
    try:
        flags = parser.parse_known_args(argv)[0]
    except SystemExit:  # lm-eval's own parser reports it in its words
        return False
    if not flags.tasks or not flags.include_path:
        return False
    names = [name for text in flags.tasks for name in text.split(",") if name]
    index = TaskManager(include_path=flags.include_path, include_defaults=False).task_index
    kinds = lm_eval_single_task_kinds()
    return all(name in index and index[name].kind in kinds for name in names)


@contextlib.contextmanager
def builtin_tasks_skipped(skip: bool):
    """While on (`skip`), lm-eval's command line builds its TaskManager without the built-in
    tasks (it has no flag for that: its `TaskManager(include_defaults=...)` argument)."""
    import lm_eval.tasks

    if not skip:
        yield
        return
    full = lm_eval.tasks.TaskManager

    class IncludedOnly(full):
        def __init__(self, *args, include_defaults: bool = False, **kwargs):
            super().__init__(*args, include_defaults=include_defaults, **kwargs)

    lm_eval.tasks.TaskManager = IncludedOnly
    try:
        yield
    finally:
        lm_eval.tasks.TaskManager = full
