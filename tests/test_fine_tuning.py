"""Fine-tuning a converted Hugging Face MoE on a chat jsonl, end to end: the commands of
docs/fine_tuning.md, as typed.

tests/tiny_chat_model.py builds a tiny transformers Qwen3-MoE (random, every weight
perturbed, the output layer scaled so its NLL is far from log V) with a byte-level BPE
tokenizer and a ChatML chat template, and chat jsonl files. The docs' commands convert it
(`jaxmoe convert hf`), fine-tune it with `jaxmoe train --workdir RUN
--config.train.init_from=CKPT` and no --config (the model and tokenizer come from CKPT),
score held-out conversations (`jaxmoe eval --per_example`, reading them with the format the
checkpoint was trained on) and export it (`jaxmoe export hf`). The reference is transformers:
the export, loaded by its own class, must give every held-out conversation the same
completion loss (relative 1e-4), with the ids and the assistant mask `apply_chat_template`
gives for the same template marked with `{% generation %}`.
"""

import json
import shlex
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from jaxmoe.cli import main
from jaxmoe.config.stored import read_config
from jaxmoe.errors import ConfigError
from tests import tiny_chat_model

ROOT = Path(__file__).resolve().parents[1]
# The tiny model's ChatML with the assistant's text marked: transformers' own assistant mask.
CHATML_MARKED = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + "
    "'<|im_end|>' }}{% endgeneration %}{% else %}{{ message['content'] + '<|im_end|>' }}"
    "{% endif %}{{ '\\n' }}{% endfor %}"
)
REL_TOL = 1e-4


def docs_commands() -> list[list[str]]:
    """The first bash block of docs/fine_tuning.md, one argv per line."""
    text = (ROOT / "docs" / "fine_tuning.md").read_text()
    block = text.split("```bash\n", 1)[1].split("```", 1)[0]
    return [shlex.split(line) for line in block.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def hf_source(tmp_path_factory):
    return tiny_chat_model.build_checkpoint(tmp_path_factory.mktemp("tiny") / "qwen3_moe_chat")


def completion_losses(model, tokenizer, path) -> np.ndarray:
    """transformers' mean NLL of each held-out conversation's assistant tokens."""
    losses = []
    for line in path.read_text().splitlines():
        messages = json.loads(line)["messages"]
        out = tokenizer.apply_chat_template(
            messages, chat_template=CHATML_MARKED, return_dict=True,
            return_assistant_tokens_mask=True,
        )  # fmt: skip
        plain = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
        assert out["input_ids"] == plain  # the marked template renders the same ids
        ids, mask = torch.tensor([out["input_ids"]]), np.array(out["assistant_masks"])
        with torch.no_grad():
            logits = model(ids).logits[0, :-1].double()
        nll = -torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0].numpy()
        losses.append(float((nll * mask[1:]).sum() / mask[1:].sum()))
    return np.array(losses)


def jaxmoe(*argv) -> None:
    """Runs a jaxmoe command in this process."""
    assert main([str(a) for a in argv]) == 0


@pytest.mark.slow  # ~15 s with a warm compile cache, ~45 s cold (CI's clean clone)
def test_the_guides_commands_fine_tune_a_converted_qwen3_moe(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    commands = docs_commands()
    assert commands[0] == ["python", "-m", "tests.tiny_chat_model", "tiny"]
    tiny_chat_model.build(Path("tiny"))
    outputs = {}
    for argv in commands[1:]:
        assert argv[0] == "jaxmoe"
        extra = [f"--config.data.cache_dir={tmp_path / 'cache'}", "--no_progress"]
        capsys.readouterr()
        assert main(argv[1:] + (extra if argv[1] == "train" else [])) == 0, argv
        outputs[argv[1]] = capsys.readouterr().out
    stored = read_config("runs/chat")
    assert (stored.data.format, stored.model.d_model, stored.model.moe.num_experts) == (
        "chat",
        32,
        4,
    )
    after = json.loads(outputs["eval"].strip().splitlines()[-1])
    # The converted checkpoint reads text; asked for chat, it scores the random model.
    capsys.readouterr()
    held_out = "jsonl:tiny/chat_held_out.jsonl"
    main(
        [
            "eval",
            "--checkpoint",
            "ckpt/qwen3_moe_chat",
            "--data",
            held_out,
            "--config.data.format=chat",
        ]
    )
    before = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    print("held-out completion loss", before["loss"], "->", after["loss"])
    assert after["loss"] < before["loss"] - 0.3, (before["loss"], after["loss"])
    hf = AutoModelForCausalLM.from_pretrained("hf/qwen3_moe_chat_tuned").eval()
    assert type(hf).__name__ == "Qwen3MoeForCausalLM"
    tokenizer = AutoTokenizer.from_pretrained("hf/qwen3_moe_chat_tuned")
    want = completion_losses(hf, tokenizer, Path("tiny/chat_held_out.jsonl"))
    got = np.array([e["loss"] for e in after["per_example"]])
    np.testing.assert_allclose(got, want, rtol=REL_TOL)
    assert all(e["num_tokens"] > 0 for e in after["per_example"])


def test_init_from_refuses_a_model_key_that_disagrees(hf_source, tmp_path):
    from jaxmoe.config.loading import load_config
    from jaxmoe.training.init_from import adopt_checkpoint_model, config_from_checkpoint

    jaxmoe("convert", "hf", hf_source, tmp_path / "ckpt")
    init = f"train.init_from={tmp_path / 'ckpt'}"
    config = config_from_checkpoint([init, "model.moe.gating=adaptive", "train.steps=3"])
    assert (config.model.d_model, config.model.moe.gate.gating, config.train.steps) == (
        32,
        "adaptive",
        3,
    )
    assert config.data.tokenizer.startswith(str(tmp_path / "ckpt"))
    with pytest.raises(ConfigError, match=r"^model.d_model=64 disagrees with train.init_from"):
        config_from_checkpoint([init, "model.d_model=64"])
    file_config = load_config("configs/default.py", [init, "model.num_layers=3"])
    with pytest.raises(ConfigError, match=r"^model.num_layers=3 disagrees .* \(2\)"):
        adopt_checkpoint_model(file_config, {"model.num_layers"})
    # Defaults take the checkpoint's values.
    file_config = adopt_checkpoint_model(load_config("configs/default.py", [init]), set())
    vocab = json.loads((hf_source / "config.json").read_text())["vocab_size"]
    assert (file_config.model.num_layers, file_config.model.vocab_size) == (2, vocab)


def test_the_guide_documents_every_format_key():
    from jaxmoe.data.options import FORMAT_KEYS

    text = (ROOT / "docs" / "fine_tuning.md").read_text()
    missing = [key for key in FORMAT_KEYS if f"| `data.{key}` |" not in text]
    assert not missing, missing
