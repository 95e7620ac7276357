"""Router replay of another engine's routing: transformers runs a tiny Qwen3-MoE in bfloat16
(as a rollout engine would), its routers' top-k choices are recorded from the modules
themselves (forward hooks on `mlp.gate`), and jaxmoe evaluates the converted checkpoint in
float32 on the same tokens. Its own routing differs from the bf16 one on some token-layers
(the mismatch the issue is about); replaying the record (model.moe.replay) makes every
token's experts transformers', the record going through the routing-record file format."""

import jax
import numpy as np
import pytest
import torch

from jaxmoe.cli import main
from jaxmoe.data.routing_record import Record, read_record, write_record
from jaxmoe.inference.trained_model import TrainedModel
from jaxmoe.training.steps import forward

EXPERTS, K = 8, 2


def build_hf(folder):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=EXPERTS,
        num_experts_per_tok=K, moe_intermediate_size=16, norm_topk_prob=True,
        tie_word_embeddings=False,
    )  # fmt: skip
    model = Qwen3MoeForCausalLM(config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            noise = torch.randn(p.shape, generator=generator)
            p.copy_(1.0 + 0.2 * noise if p.ndim == 1 else noise * p.shape[-1] ** -0.5)
            if p.ndim == 2 and p.shape == (EXPERTS, 32):  # a router: near-ties between experts
                p.mul_(0.2)
    model.save_pretrained(folder)
    return model


def hf_bf16_routing(model, tokens) -> np.ndarray:
    """int [B, L, M, K]: the experts transformers' bf16 routers chose, slot 0 the top."""
    model = model.to(torch.bfloat16).eval()
    chosen = []
    hooks = [
        layer.mlp.gate.register_forward_hook(lambda _m, _i, out: chosen.append(out[2]))
        for layer in model.model.layers
    ]
    with torch.no_grad():
        model(torch.tensor(tokens))
    for hook in hooks:
        hook.remove()
    b, length = tokens.shape
    return np.stack([c.reshape(b, length, K).numpy() for c in chosen], axis=2)


def mismatch(ours, theirs) -> float:
    """Share of (token, layer) pairs whose expert sets differ."""
    return float(np.mean(np.any(np.sort(ours, -1) != np.sort(theirs, -1), axis=-1)))


@pytest.mark.slow  # ~25 s: a transformers model, a conversion, two jaxmoe forward passes
def test_replaying_transformers_bf16_routing_removes_the_mismatch(tmp_path):
    hf = build_hf(tmp_path / "hf")
    assert main(["convert", "hf", str(tmp_path / "hf"), str(tmp_path / "ckpt")]) == 0
    tokens = np.random.default_rng(0).integers(0, 128, (4, 32)).astype(np.int32)
    theirs = hf_bf16_routing(hf, tokens)
    path = str(tmp_path / "hf_bf16.safetensors")
    write_record(path, Record([s.astype(np.int16) for s in theirs], (0, 1), EXPERTS, K))
    record = read_record(path)
    replayed = np.stack(record.sequences).astype(np.int32)

    def experts(overrides, batch):
        model = TrainedModel.open(str(tmp_path / "ckpt"), overrides=overrides, tokenizer=False)
        with jax.set_mesh(model.mesh):
            _, aux = forward(model.spec.graphdef, model.params, batch, train=False,
                             rest=model.spec.rest, record_routing=True)  # fmt: skip
        return np.stack([np.asarray(a["experts"]) for a in aux.values()], axis=2)

    live = experts(["model.dtype=float32"], {"inputs": tokens})
    assert 0 < mismatch(live, theirs) < 0.5  # bf16 flips some choices, not most
    replay = ["model.moe.replay=true", "data.format=prompt_completion"]
    ours = experts(replay, {"inputs": tokens, "routing": replayed})
    assert mismatch(ours, theirs) == 0.0
    assert np.array_equal(ours, theirs)  # slot order too: the top expert first


def hf_routing(model, ids) -> np.ndarray:
    """int [L, M, K]: the experts transformers' routers (float32) chose for one sequence."""
    chosen = []
    hooks = [
        layer.mlp.gate.register_forward_hook(lambda _m, _i, out: chosen.append(out[2]))
        for layer in model.model.layers
    ]
    with torch.no_grad():
        model(torch.tensor([ids]))
    for hook in hooks:
        hook.remove()
    return np.stack([c.reshape(len(ids), -1).numpy() for c in chosen], axis=1)


@pytest.mark.slow  # ~25 s: a decode (prefill + loop compiles) and a transformers forward
def test_decode_records_the_experts_transformers_chooses(tmp_path):
    """`decode --record_routing`: the record covers each prompt's tokens (from the prefill)
    and its new tokens but the last (from the decode loop), and holds the experts
    transformers (float32) chooses on the same ids, in its slot order."""
    from transformers import AutoModelForCausalLM

    from jaxmoe.inference.decode_text import decode_main
    from tests import tiny_chat_model

    tiny_chat_model.build_checkpoint(tmp_path / "hf")
    assert main(["convert", "hf", str(tmp_path / "hf"), str(tmp_path / "ckpt")]) == 0
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("reverse: red green blue\nreverse: pink gray\n")
    path = str(tmp_path / "decoded.safetensors")
    out = decode_main(str(tmp_path / "ckpt"), prompts_file=str(prompts), max_new_tokens=6,
                      record_routing=path, print_fn=lambda *_: None)  # fmt: skip
    record = read_record(path)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    tokenizer = reference_tokenizer(tmp_path / "hf")
    texts = prompts.read_text().splitlines()
    assert len(record.sequences) == 2
    for text, new, recorded in zip(texts, out["tokens"], record.sequences, strict=True):
        ids = tokenizer.encode(text) + [int(t) for t in new]
        assert len(recorded) == len(ids) - 1  # the last id is never fed to the model
        theirs = hf_routing(reference, ids[:-1])
        assert np.array_equal(np.asarray(recorded), theirs)


def reference_tokenizer(folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


@pytest.mark.slow  # ~15 s: an eval pass and transformers forwards
def test_eval_records_the_experts_transformers_chooses(tmp_path, capsys):
    """`eval --record_routing` on jsonl text: one sequence per line, each line's ids but the
    last, with the experts transformers (float32) chooses on them."""
    import json

    from transformers import AutoModelForCausalLM

    from tests import tiny_chat_model

    tiny_chat_model.build_checkpoint(tmp_path / "hf")
    assert main(["convert", "hf", str(tmp_path / "hf"), str(tmp_path / "ckpt")]) == 0
    texts = ["red green blue black", "pink gray", "white brown red green blue pink"]
    data = tmp_path / "texts.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    path = str(tmp_path / "scored.safetensors")
    argv = ["eval", "--checkpoint", str(tmp_path / "ckpt"), "--data", f"jsonl:{data}",
            "--record_routing", path]  # fmt: skip
    assert main(argv) == 0
    record = read_record(path)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    tokenizer = reference_tokenizer(tmp_path / "hf")
    assert len(record.sequences) == len(texts)
    for text, recorded in zip(texts, record.sequences, strict=True):
        ids = tokenizer.encode(text)
        assert len(recorded) == len(ids) - 1, (len(recorded), len(ids))
        assert np.array_equal(np.asarray(recorded), hf_routing(reference, ids[:-1]))


@pytest.mark.slow  # ~40 s: an eval pass and two one-step training runs
def test_training_replays_the_routing_eval_recorded(tmp_path, capsys):
    """The whole path: `eval --record_routing` on prompt/completion jsonl, the record's
    sequences written back as each line's `routing` field, and `jaxmoe train` on those lines
    with model.moe.replay=true gives the first step's loss of the same run without replay
    (the model's own routing, replayed through the data pipeline, packing included)."""
    import json

    from tests import tiny_chat_model

    tiny_chat_model.build_checkpoint(tmp_path / "hf")
    assert main(["convert", "hf", str(tmp_path / "hf"), str(tmp_path / "ckpt")]) == 0
    rng = np.random.default_rng(0)
    lines = []
    for _ in range(40):
        words = list(rng.choice(tiny_chat_model.COLORS, rng.integers(2, 5), replace=False))
        lines.append({"prompt": "reverse: " + " ".join(words) + "\n",
                      "completion": " ".join(reversed(words))})  # fmt: skip
    plain = tmp_path / "plain.jsonl"
    plain.write_text("".join(json.dumps(line) + "\n" for line in lines))
    path = str(tmp_path / "record.safetensors")
    pc = "--config.data.format=prompt_completion"
    argv = ["eval", "--checkpoint", str(tmp_path / "ckpt"), "--data", f"jsonl:{plain}", pc,
            "--record_routing", path]  # fmt: skip
    assert main(argv) == 0
    record = read_record(path)

    def with_routing(name, shift):  # each expert id moved by `shift` (mod 4)
        out = tmp_path / name
        rows = []
        for i, line in enumerate(lines):
            recorded = record.as_lists(i)
            routing = [[[(e + shift) % 4 for e in ids] for ids in pos] for pos in recorded]
            rows.append(json.dumps(line | {"routing": routing}) + "\n")
        out.write_text("".join(rows))
        return out

    def first_loss(name, routed, *extra):
        argv = ["train", "--workdir", str(tmp_path / name),
                f"--config.train.init_from={tmp_path / 'ckpt'}",
                f"--config.data.source=jsonl:{routed}", pc,
                f"--config.data.cache_dir={tmp_path / ('cache_' + name)}",
                "--config.train.steps=1", "--config.train.batch_size=8",
                "--config.train.seq_len=64", "--config.train.log_every=1",
                "--config.train.eval_every=0", "--no_progress", *extra]  # fmt: skip
        assert main(argv) == 0
        rows = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        return next(json.loads(r) for r in rows if '"split": "train"' in r)["loss"]

    own, other = with_routing("own.jsonl", 0), with_routing("other.jsonl", 1)
    live = first_loss("live", own)
    replay = "--config.model.moe.replay=true"
    assert first_loss("replayed", own, replay) == live
    assert abs(first_loss("other_experts", other, replay) - live) > 1e-3  # the record is read
