"""LoRA end to end on a converted tiny Qwen3-MoE (tests/tiny_chat_model.py), through the
commands: `jaxmoe train` with train.lora (rank 4 on attention and every expert), the
checkpoint it writes (the adapters and their optimizer state, nothing of the base), `eval
--base` (base + adapters, unmerged), `jaxmoe merge`, `export hf --peft` and `export hf
--base`, and a resume on another base refused in one line.

The reference is peft + transformers: the PEFT folder loaded by `PeftModel.from_pretrained`
onto the original transformers checkpoint (the base, converted exactly) must give every
held-out conversation the completion NLL jaxmoe's unmerged eval gives (relative 1e-4), and
the merged export loaded by transformers alone the same logits.
"""

import json

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from jaxmoe.checkpoints.manager import _stored_shapes
from jaxmoe.cli import main
from tests import tiny_chat_model
from tests.test_fine_tuning import completion_losses

TRAIN = [
    "--config.data.format=chat", "--config.train.steps=6", "--config.train.batch_size=8",
    "--config.train.seq_len=64", "--config.optimizer.learning_rate=0.02",
    "--config.optimizer.warmup_steps=1", "--config.train.lora.rank=4",
    "--config.train.lora.targets=attention,experts", "--no_progress",
]  # fmt: skip


def run(capsys, *argv) -> str:
    capsys.readouterr()
    assert main([str(a) for a in argv]) == 0, argv
    return capsys.readouterr().out


@pytest.mark.slow  # ~40 s cold: a LoRA train step, eval and merge compiles, transformers + peft
def test_lora_checkpoint_eval_merge_and_peft_export(tmp_path, capsys):
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tiny_chat_model.build(tmp_path / "tiny")
    hf = tmp_path / "tiny" / "qwen3_moe_chat"
    held_out = tmp_path / "tiny" / "chat_held_out.jsonl"
    base, run_dir = tmp_path / "base", tmp_path / "run"
    run(capsys, "convert", "hf", hf, base)
    data = f"--config.data.source=jsonl:{tmp_path / 'tiny' / 'chat_train.jsonl'}"
    cache = f"--config.data.cache_dir={tmp_path / 'cache'}"
    run(capsys, "train", "--workdir", run_dir, f"--config.train.init_from={base}", data, cache,
        *TRAIN)  # fmt: skip

    # The checkpoint: adapters only (and their Adam moments), with the base's fingerprint.
    step = run_dir / "checkpoints" / "6"
    stored = _stored_shapes(step / "params")
    assert stored and all(name.endswith(("_lora_a", "_lora_b")) for name in stored)
    adapter_values = sum(int(np.prod(s)) for s in stored.values())
    moments = sum(int(np.prod(s)) for s in _stored_shapes(step / "opt_state").values())
    assert moments <= 2 * adapter_values + 16  # + Adam's step counters
    # The array bytes (float32, compressed) in the merged OCDBT store, plus Orbax's JSON of
    # each array (sharding, metadata; ~1 KB each). Orbax also leaves each process's own
    # store (ocdbt.process_N: the same bytes again, in a number of files that varies).
    merged_bytes = sum(f.stat().st_size for f in (step / "params" / "d").iterdir())
    assert merged_bytes <= 4 * adapter_values + 1024
    files = [f for f in (step / "params").rglob("*") if f.is_file()]
    outside = [f for f in files if not any(p.startswith("ocdbt.process_") for p in f.parts)]
    assert sum(f.stat().st_size for f in outside) <= 4 * adapter_values + 2048 * len(stored)
    meta = json.loads((step / "meta" / "metadata").read_text())
    assert len(meta["lora_base"]["fingerprint"]) == 64

    # Unmerged (eval --base), merged (jaxmoe merge) and PEFT + transformers agree.
    scored = json.loads(
        run(capsys, "eval", "--checkpoint", run_dir, "--base", base, "--data",
            f"jsonl:{held_out}", "--per_example").splitlines()[-1]
    )  # fmt: skip
    ours = np.array([e["loss"] for e in scored["per_example"]])
    merged = tmp_path / "merged"
    run(capsys, "merge", run_dir, merged, "--base", base)
    scored_merged = json.loads(
        run(capsys, "eval", "--checkpoint", merged, "--data", f"jsonl:{held_out}",
            "--per_example").splitlines()[-1]
    )  # fmt: skip
    np.testing.assert_allclose([e["loss"] for e in scored_merged["per_example"]], ours, rtol=1e-5)

    run(capsys, "export", "hf", run_dir, tmp_path / "peft", "--peft")
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert (
        config["r"] == 4 and "model.layers.1.mlp.experts.down_proj" in config["target_parameters"]
    )
    tensors = load_file(tmp_path / "peft" / "adapter_model.safetensors")
    assert tensors["base_model.model.model.layers.0.mlp.experts.lora_A.weight"].shape == (16, 16)
    tokenizer = AutoTokenizer.from_pretrained(hf)
    reference = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    before = completion_losses(reference.eval(), tokenizer, held_out)
    with_adapters = peft.PeftModel.from_pretrained(reference, tmp_path / "peft").eval()
    theirs = completion_losses(with_adapters, tokenizer, held_out)
    assert np.max(np.abs(theirs - before)) > 0.1  # the adapters change the model
    np.testing.assert_allclose(ours, theirs, rtol=1e-4)

    run(capsys, "export", "hf", run_dir, tmp_path / "hf_merged", "--base", base)
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf_merged", dtype=torch.float32)
    np.testing.assert_allclose(completion_losses(exported.eval(), tokenizer, held_out), ours,
                               rtol=1e-4)  # fmt: skip

    # Another base: resuming and evaluating are refused in one line.
    other = tmp_path / "other"
    tiny_chat_model.build_checkpoint(tmp_path / "other_hf", seed=7)
    run(capsys, "convert", "hf", tmp_path / "other_hf", other)
    capsys.readouterr()
    argv = ["eval", "--checkpoint", run_dir, "--base", other, "--data", f"jsonl:{held_out}"]
    assert main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "its adapters were trained on a base" in err
    argv = ["train", "--workdir", run_dir, f"--config.train.init_from={other}", data, cache,
            *TRAIN[:1], "--config.train.steps=8", *TRAIN[2:]]  # fmt: skip
    assert main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "its adapters were trained on a base" in err
    # Without a base: one line naming the flag.
    assert main(["eval", "--checkpoint", str(run_dir), "--data", f"jsonl:{held_out}"]) == 2
    assert "--base CKPT" in capsys.readouterr().err
