"""Fine-tuning a converted Hugging Face MoE on a chat jsonl, end to end through the CLI.

A tiny transformers Qwen3-MoE (random, every weight perturbed, the output layer scaled so
its NLL is far from log V) is saved with a byte-level BPE tokenizer and a ChatML chat
template, converted (`jaxmoe convert hf`), fine-tuned with `jaxmoe train --workdir RUN
--config.train.init_from=CKPT` and no --config (the model and tokenizer come from CKPT),
scored on held-out conversations (`jaxmoe eval --per_example`, which reads them with the
format the checkpoint was trained on) and exported (`jaxmoe export hf`). The reference is
transformers: the export, loaded by its own class, must give every held-out conversation
the same completion loss (relative 1e-4), with the ids and the assistant mask that
`apply_chat_template` gives for the same template marked with `{% generation %}`.
"""

import json

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3MoeConfig, Qwen3MoeForCausalLM

from jaxmoe.checkpoints.manager import read_config
from jaxmoe.cli import main
from jaxmoe.errors import ConfigError
from tests.test_chat_template import SPECIALS
from tests.test_hf import randomize

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# The same rendering with the assistant's text marked: transformers' own assistant mask.
CHATML_MARKED = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + "
    "'<|im_end|>' }}{% endgeneration %}{% else %}{{ message['content'] + '<|im_end|>' }}"
    "{% endif %}{{ '\\n' }}{% endfor %}"
)
COLORS = ["red", "green", "blue", "black", "white", "pink", "gray", "brown"]
REL_TOL = 1e-4


def conversation(rng) -> dict:
    """Name the colors back in reverse: a task a tiny model learns a little of in 24 steps."""
    words = list(rng.choice(COLORS, rng.integers(2, 5)))
    return {
        "messages": [
            {"role": "user", "content": "reverse: " + " ".join(words)},
            {"role": "assistant", "content": " ".join(reversed(words))},
        ]
    }


def write_chats(path, n: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    path.write_text("".join(json.dumps(conversation(rng)) + "\n" for _ in range(n)))


@pytest.fixture(scope="module")
def hf_source(tmp_path_factory):
    """A random Qwen3-MoE with a chat tokenizer, saved as a Hugging Face checkpoint."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    src = tmp_path_factory.mktemp("qwen3_moe_chat")
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=SPECIALS, initial_alphabet=alphabet
    )
    tok.train_from_iterator([" ".join(COLORS) + " reverse: user assistant"] * 8, trainer)
    tok.save(str(src / "tokenizer.json"))
    special = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHATML}
    (src / "tokenizer_config.json").write_text(json.dumps({**tokenizer_config, **special}))
    config = Qwen3MoeConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=48,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True,
        rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
        eos_token_id=tok.token_to_id("<|im_end|>"), pad_token_id=tok.token_to_id("<|endoftext|>"),
    )  # fmt: skip
    model = randomize(Qwen3MoeForCausalLM(config), seed=44)
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)  # peaked predictions: far from log V
    model.save_pretrained(src)
    return src


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


def eval_json(capsys, checkpoint, data, *overrides) -> dict:
    capsys.readouterr()
    jaxmoe("eval", "--checkpoint", checkpoint, "--data", f"jsonl:{data}", "--per_example",
           *overrides)  # fmt: skip
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.slow  # ~15 s with a warm compile cache, ~45 s cold (CI's clean clone)
def test_fine_tune_a_converted_qwen3_moe_on_chat_and_export(hf_source, tmp_path, capsys):
    write_chats(tmp_path / "train.jsonl", 160, seed=0)
    write_chats(tmp_path / "held_out.jsonl", 6, seed=1)
    ckpt, run, export = tmp_path / "ckpt", tmp_path / "run", tmp_path / "hf"
    jaxmoe("convert", "hf", hf_source, ckpt)
    jaxmoe(
        "train", "--workdir", run, "--no_progress",
        f"--config.train.init_from={ckpt}",
        f"--config.data.source=jsonl:{tmp_path / 'train.jsonl'}",
        "--config.data.format=chat",
        f"--config.data.cache_dir={tmp_path / 'cache'}",
        "--config.train.steps=24", "--config.train.batch_size=8", "--config.train.seq_len=64",
        "--config.train.eval_every=0", "--config.train.checkpoint_every=24",
        "--config.optimizer.learning_rate=0.01", "--config.optimizer.warmup_steps=2",
        "--config.model.moe.balance_loss_weight=0",
    )  # fmt: skip
    stored = read_config(str(run))
    assert (stored.data.format, stored.model.d_model, stored.model.moe.num_experts) == (
        "chat",
        32,
        4,
    )
    # The converted checkpoint reads text; the fine-tuned one chat, as it was trained.
    before = eval_json(capsys, ckpt, tmp_path / "held_out.jsonl", "--config.data.format=chat")
    after = eval_json(capsys, run, tmp_path / "held_out.jsonl")
    print("held-out completion loss", before["loss"], "->", after["loss"])
    assert after["loss"] < before["loss"] - 0.3, (before["loss"], after["loss"])
    jaxmoe("export", "hf", run, export)
    hf = AutoModelForCausalLM.from_pretrained(export).eval()
    assert type(hf).__name__ == "Qwen3MoeForCausalLM"
    want = completion_losses(hf, AutoTokenizer.from_pretrained(export), tmp_path / "held_out.jsonl")
    got = np.array([e["loss"] for e in after["per_example"]])
    np.testing.assert_allclose(got, want, rtol=REL_TOL)
    assert all(e["num_tokens"] > 0 for e in after["per_example"])


def test_init_from_refuses_a_model_key_that_disagrees(hf_source, tmp_path):
    from jaxmoe.config.loading import load_config
    from jaxmoe.training.init_from import adopt_checkpoint_model, config_from_checkpoint

    jaxmoe("convert", "hf", hf_source, tmp_path / "ckpt")
    init = f"train.init_from={tmp_path / 'ckpt'}"
    config = config_from_checkpoint([init, "model.moe.gating=adaptive", "train.steps=3"])
    assert (config.model.d_model, config.model.moe.gating, config.train.steps) == (
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
    file_config = load_config("configs/default.py", [init])
    adopt_checkpoint_model(file_config, set())  # defaults take the checkpoint's values
    vocab = json.loads((hf_source / "config.json").read_text())["vocab_size"]
    assert (file_config.model.num_layers, file_config.model.vocab_size) == (2, vocab)
