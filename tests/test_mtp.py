"""Multi-token prediction (model.mtp_depth): DeepSeek-V3 checkpoints with their MTP layer
`model.layers.{N}` convert both ways, and the converted module's logits equal a reference
built from transformers' own DeepseekV3DecoderLayer and RMSNorm (transformers keeps the MTP
tensors but never runs them: it computes the block; the glue is DeepSeek's, in torch);
the training objective is the main NLL plus lambda times the MTP NLL of that reference;
speculative decoding with the module as draft (`decode --speculative mtp`) gives plain
greedy decoding's tokens, on the converted model and on a small one trained with MTP
whose drafts are accepted in part.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.numpy import load_file, save_file
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3DecoderLayer,
    DeepseekV3RMSNorm,
)

from jaxmoe.checkpoints.manager import CheckpointError
from jaxmoe.config.stored import read_config
from jaxmoe.conversions.hf.exporter import export_hf
from jaxmoe.conversions.hf.importer import convert_hf
from jaxmoe.inference.decode import Generator, Sampling
from jaxmoe.inference.speculative import MTPGenerator
from jaxmoe.models import build_model
from jaxmoe.models.layers import head_logits
from jaxmoe.models.spec import merge_model, model_params, model_rngs, model_spec
from jaxmoe.parallel.mesh import make_mesh
from jaxmoe.parallel.options import MeshOptions
from jaxmoe.training.optimizer import make_optimizer
from jaxmoe.training.state import init_state, state_shardings
from jaxmoe.training.steps import _loss, jit_train_step, mtp_totals, step_fns
from tests.helpers import tiny_config
from tests.test_hf import VOCAB, load_converted, randomize
from tests.test_hf_deepseek import SMALL
from tests.test_hf_moe_families import ROUTER_SCALE, nll_per_example

N = SMALL["num_hidden_layers"]  # the MTP layer is model.layers.3
IDS = np.random.default_rng(5).integers(1, VOCAB, size=(3, 12))
LAMBDA = 0.3


def build_with_mtp(tmp_path):
    """A tiny DeepSeek-V3 (low-rank queries, groups, a dense first layer) saved with one
    MTP layer: a random decoder layer N and the module's own norms and projection, its
    embed_tokens / shared_head.head copies of the main ones. Returns (model, mtp modules)."""
    config = DeepseekV3Config(
        **SMALL, q_lora_rank=12, n_group=4, topk_group=2, num_nextn_predict_layers=1
    )
    model = randomize(DeepseekV3ForCausalLM(config), seed=11)
    gen = torch.Generator().manual_seed(12)
    block = randomize(DeepseekV3DecoderLayer(config, layer_idx=N), seed=13)
    d = SMALL["hidden_size"]
    mtp = {
        "block": block,
        "enorm": randomize(DeepseekV3RMSNorm(d, eps=config.rms_norm_eps), seed=14),
        "hnorm": randomize(DeepseekV3RMSNorm(d, eps=config.rms_norm_eps), seed=15),
        "head_norm": randomize(DeepseekV3RMSNorm(d, eps=config.rms_norm_eps), seed=16),
        "eh_proj": torch.randn(d, 2 * d, generator=gen) * (2 * d) ** -0.5,
    }
    with torch.no_grad():
        for layer in (*model.model.layers, block):
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None:
                gate.weight.mul_(ROUTER_SCALE)
                gate.e_score_correction_bias.copy_(0.3 * torch.randn(8, generator=gen))
    model.save_pretrained(tmp_path, safe_serialization=True)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    hf = f"model.layers.{N}."
    for name, value in block.state_dict().items():
        value = value.numpy()
        if name.endswith("experts.gate_up_proj"):  # [E, 2F, D] in memory: saved per expert
            f = value.shape[1] // 2
            for e in range(value.shape[0]):
                tensors[f"{hf}mlp.experts.{e}.gate_proj.weight"] = value[e, :f].copy()
                tensors[f"{hf}mlp.experts.{e}.up_proj.weight"] = value[e, f:].copy()
        elif name.endswith("experts.down_proj"):  # [E, D, F]
            for e in range(value.shape[0]):
                tensors[f"{hf}mlp.experts.{e}.down_proj.weight"] = value[e].copy()
        else:
            tensors[hf + name] = value
    tensors[hf + "enorm.weight"] = mtp["enorm"].weight.detach().numpy()
    tensors[hf + "hnorm.weight"] = mtp["hnorm"].weight.detach().numpy()
    tensors[hf + "shared_head.norm.weight"] = mtp["head_norm"].weight.detach().numpy()
    tensors[hf + "eh_proj.weight"] = mtp["eh_proj"].numpy()
    tensors[hf + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].copy()
    tensors[hf + "shared_head.head.weight"] = tensors["lm_head.weight"].copy()
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    return model, mtp


def reference_mtp_logits(model, mtp, ids) -> np.ndarray:
    """DeepSeek's MTP module in torch: logits [B, L, V] of the token two ahead at each
    position (the last position's input token is id 0, as jaxmoe pads it)."""
    ids_t = torch.tensor(ids)
    with torch.no_grad():
        h0 = model.model(ids_t).last_hidden_state  # after model.norm
        ahead = torch.cat([ids_t[:, 1:], torch.zeros_like(ids_t[:, :1])], dim=1)
        both = torch.cat([mtp["enorm"](model.model.embed_tokens(ahead)), mtp["hnorm"](h0)], dim=-1)
        x = both @ mtp["eh_proj"].T
        length = ids_t.shape[1]
        positions = torch.arange(length)[None]
        mask = torch.full((length, length), float("-inf")).triu(1)[None, None]
        x = mtp["block"](
            x,
            attention_mask=mask,
            position_ids=positions,
            position_embeddings=model.model.rotary_emb(x, positions),
        )
        return model.lm_head(mtp["head_norm"](x)).float().numpy()


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    src = tmp_path_factory.mktemp("hf_mtp")
    model, mtp = build_with_mtp(src)
    dst = src.parent / f"{src.name}_jaxmoe"
    convert_hf(str(src), str(dst))
    return src, model, mtp, dst


def jaxmoe_mtp_logits(loaded, ids):
    def fn(params, tokens):
        model = merge_model(loaded.graphdef, params)
        hidden, _ = model(tokens, head=False)
        states, _ = model.mtp_states(hidden, tokens)
        return head_logits(states[0], *model.output_weights())

    return np.asarray(jax.jit(fn)(loaded.params, jnp.asarray(ids)))


def test_mtp_logits_match_the_reference(converted):
    _, model, mtp, dst = converted
    assert read_config(str(dst)).model.mtp_depth == 1
    want = reference_mtp_logits(model, mtp, IDS)
    got = jaxmoe_mtp_logits(load_converted(dst), IDS)
    assert np.std(want) > 0.1
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    # Per example: the NLL of the tokens two ahead, where they exist.
    np.testing.assert_allclose(
        nll_per_example(got[:, :-1], IDS[:, 1:]), nll_per_example(want[:, :-1], IDS[:, 1:]),
        rtol=1e-4,
    )  # fmt: skip


def test_training_loss_is_main_plus_lambda_mtp(converted):
    """steps._loss of the converted model = transformers' main NLL + lambda x the reference
    MTP NLL, each the mean over its target tokens."""
    _, model, mtp, dst = converted
    loaded = load_converted(dst)
    cfg = tiny_config()
    cfg = cfg.replace(model=read_config(str(dst)).model.replace(mtp_weight=LAMBDA))
    spec = model_spec(cfg.model, make_mesh(cfg.mesh, jax.devices()[:1]))
    fns = step_fns(cfg.train, cfg.optimizer, cfg.model, spec, None, lambda step: 0.0)
    ids = jnp.asarray(IDS)
    batch = {
        "inputs": ids[:, :-1],
        "targets": ids[:, 1:],
        "weights": jnp.ones(ids[:, 1:].shape, jnp.float32),
    }
    total = jnp.sum(batch["weights"])
    loss_fn = jax.jit(lambda params, batch: _loss(
        params, batch, total, jax.random.key(0), fns, mtp_totals(batch, 1)
    ))  # fmt: skip
    loss, extra = loss_fn(loaded.params, batch)
    with torch.no_grad():
        main = model(torch.tensor(IDS[:, :-1])).logits.float().numpy()
    main_nll = nll_per_example(np.concatenate([main, main[:, -1:]], 1), IDS).mean()
    ref = reference_mtp_logits(model, mtp, IDS[:, :-1])[:, :-1]  # positions with a target
    mtp_nll = nll_per_example(np.concatenate([ref, ref[:, -1:]], 1), IDS[:, 1:]).mean()
    assert abs(float(extra["nll_sum"]) / float(total) - main_nll) < 1e-4 * main_nll
    np.testing.assert_allclose(float(loss), main_nll + LAMBDA * mtp_nll, rtol=1e-4)


def test_export_writes_the_same_tensors(converted, tmp_path):
    src, _, _, dst = converted
    export_hf(str(dst), str(tmp_path / "hf"))
    hf_config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert hf_config["num_nextn_predict_layers"] == 1
    want = load_file(str(src / "model.safetensors"))
    got = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert set(got) == set(want)
    assert any(name.startswith(f"model.layers.{N}.shared_head") for name in got)
    for name, value in want.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)


def test_copies_that_differ_and_unannounced_layers_are_refused(converted, tmp_path):
    src, _, _, _ = converted
    tensors = load_file(str(src / "model.safetensors"))
    bad = tmp_path / "differs"
    bad.mkdir()
    for name in ("config.json",):
        (bad / name).write_text((src / name).read_text())
    changed = dict(tensors)
    changed[f"model.layers.{N}.embed_tokens.weight"] = tensors["model.embed_tokens.weight"] + 1
    save_file(changed, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=f"model.layers.{N}.embed_tokens.weight differs"):
        convert_hf(str(bad), str(tmp_path / "out1"))
    unannounced = tmp_path / "unannounced"
    unannounced.mkdir()
    config = json.loads((src / "config.json").read_text()) | {"num_nextn_predict_layers": 0}
    (unannounced / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(unannounced / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as info:
        convert_hf(str(unannounced), str(tmp_path / "out2"))
    assert f"model.layers.{N}" in str(info.value) and "\n" not in str(info.value)


def test_speculative_decoding_of_the_converted_model(converted):
    """Drafted by the converted MTP module, the tokens are transformers' greedy `generate`
    (left-padded prompts of two lengths through the latent cache)."""
    _, model, _, dst = converted
    loaded = load_converted(dst)
    mesh = make_mesh(MeshOptions(data=1), jax.devices()[:1])
    prompts = [list(map(int, IDS[0, :5])), list(map(int, IDS[1, :9]))]
    model.generation_config.eos_token_id = None  # no early stop: every token compared
    want = []
    for prompt in prompts:
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False)
        want.append(out[0, len(prompt) :].tolist())
    drafted = MTPGenerator(loaded.cfg, loaded.params, mesh, eos_id=-1).generate(prompts, 10)
    assert drafted.tokens == want


PERIOD = 7


def pattern_batch(rng, batch=8, length=16):
    """Sequences counting through one of three runs of PERIOD ids: learned in a few steps."""
    starts = rng.integers(0, 100, (batch, 1))
    ids = ((starts + np.arange(length + 1)[None]) % PERIOD + 10 * (starts % 3)).astype(np.int32)
    return {
        "inputs": ids[:, :-1],
        "targets": ids[:, 1:],
        "weights": np.ones((batch, length), np.float32),
    }


@pytest.fixture(scope="module")
def half_trained():
    """A tiny dense decoder with one MTP module, 6 steps into learning the pattern: its drafts
    are right part of the time, so decoding both accepts and rejects."""
    cfg = tiny_config(
        "model.mtp_depth=1",
        "model.moe.num_experts=0",  # compiles faster; the converted case has experts
        "optimizer.learning_rate=0.01",
        "optimizer.warmup_steps=5",
        "train.steps=60",
        "mesh.data=1",
        "mesh.fsdp=1",
    )
    mesh = make_mesh(cfg.mesh, jax.devices()[:1])
    spec = model_spec(cfg.model, mesh)
    optimizer, schedule = make_optimizer(cfg.optimizer, 60, spec.param_axes)
    _, shardings = state_shardings(mesh, spec, optimizer)
    state = init_state(cfg.model, 0, optimizer, shardings, mesh)
    rng = np.random.default_rng(0)
    losses = []
    with jax.set_mesh(mesh):
        step = jit_train_step(
            step_fns(cfg.train, cfg.optimizer, cfg.model, spec, optimizer, schedule),
            shardings,
            None,
        )
        for _ in range(6):
            state, metrics = step(state, pattern_batch(rng))
            losses.append((float(metrics["loss"]), float(metrics["mtp_loss"])))
    return cfg, mesh, state["params"], losses


def test_mtp_trains_as_an_auxiliary_loss(half_trained):
    _, _, _, losses = half_trained
    (main_0, mtp_0), (main_6, mtp_6) = losses[0], losses[-1]
    assert main_6 < 0.7 * main_0 and mtp_6 < 0.9 * mtp_0


def test_speculative_equals_greedy_with_accepted_and_rejected_drafts(half_trained):
    cfg, mesh, params, _ = half_trained
    plain = Generator(cfg.model, params, mesh, eos_id=-1)
    drafted = MTPGenerator(cfg.model, params, mesh, eos_id=-1)
    prompts = [[3, 4, 5], [10, 11, 12, 13], [1, 50, 7, 99, 3]]
    want = plain.generate(prompts, 20)
    got = drafted.generate(prompts, 20)
    assert got.tokens == want.tokens
    assert 0 < got.accepted < got.steps
    assert got.num_new_tokens == want.num_new_tokens


def test_packed_documents_score_as_if_alone():
    """A row packing two documents (segment ids, per-document positions): each MTP module's
    NLL sum and target count equal those of the documents trained one per row."""
    cfg = tiny_config("model.mtp_depth=2", "model.moe.num_experts=0")
    mesh = make_mesh(cfg.mesh, jax.devices()[:1])
    spec = model_spec(cfg.model, mesh)
    fns = step_fns(cfg.train, cfg.optimizer, cfg.model, spec, None, lambda step: 0.0)
    _, params = model_params(build_model(cfg.model, rngs=model_rngs(jax.random.key(0))))
    rng = np.random.default_rng(1)
    first, second = rng.integers(1, 128, 7), rng.integers(1, 128, 9)

    def row(ids):  # a document alone, right-padded to 16 inputs
        inputs = np.zeros(16, np.int32)
        targets, weights = np.zeros(16, np.int32), np.zeros(16, np.float32)
        inputs[: len(ids) - 1], targets[: len(ids) - 1] = ids[:-1], ids[1:]
        weights[: len(ids) - 1] = 1.0
        return inputs, targets, weights

    alone = [row(first), row(second)]
    packed_inputs = np.concatenate([first[:-1], second[:-1]])
    packed = {
        "inputs": np.pad(packed_inputs, (0, 16 - len(packed_inputs)))[None],
        "targets": np.pad(np.concatenate([first[1:], second[1:]]), (0, 2))[None],
        "weights": np.pad(np.ones(14, np.float32), (0, 2))[None],
        "segment_ids": np.pad(np.repeat([1, 2], [6, 8]), (0, 2))[None].astype(np.int32),
        "positions": np.pad(np.concatenate([np.arange(6), np.arange(8)]), (0, 2))[None].astype(
            np.int32
        ),
    }
    separate = {
        "inputs": np.stack([a[0] for a in alone]),
        "targets": np.stack([a[1] for a in alone]),
        "weights": np.stack([a[2] for a in alone]),
        "segment_ids": np.stack([(a[2] > 0).astype(np.int32) for a in alone]),
        "positions": np.tile(np.arange(16, dtype=np.int32), (2, 1)),
    }
    # One batch shape for both (one compile): the packed row beside an empty one.
    packed = {k: np.concatenate([v, np.zeros_like(v)]) for k, v in packed.items()}

    @jax.jit
    def sums(params, batch):
        totals = mtp_totals(batch, 2)
        _, extra = _loss(params, batch, jnp.sum(batch["weights"]), jax.random.key(0), fns, totals)
        return extra["mtp_nll_sum_D"], totals

    got, got_totals = sums(params, jax.tree.map(jnp.asarray, packed))
    want, want_totals = sums(params, jax.tree.map(jnp.asarray, separate))
    np.testing.assert_allclose(got_totals, want_totals)  # 5 + 7 targets at depth 1, 4 + 6 at 2
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_model_flops_count_the_modules():
    """MFU's numerator: one MTP module adds a dense block's multiply-adds (GQA projections,
    scores, gated FFN), its [2D, D] projection and the output layer once more, by hand."""
    from jaxmoe.models.flops import train_flops_per_step

    cfg = tiny_config("model.moe.num_experts=0").model
    d, h, k, dh, f, v, length = 32, 4, 2, 8, 64, 128, 16
    block = 2 * d * h * dh + 2 * d * k * dh + 3 * d * f  # q/out, k/v, wi_0/wi_1/wo
    module = length * (block + 2 * d * d + d * v) + 2 * h * dh * length * length
    without = train_flops_per_step(cfg, 8, length)
    cfg = cfg.replace(mtp_depth=1)
    assert train_flops_per_step(cfg, 8, length) - without == 3 * 2 * 8 * module


def test_speculative_refuses_what_plain_decoding_refuses(half_trained):
    cfg, mesh, params, _ = half_trained
    drafted = MTPGenerator(cfg.model, params, mesh, eos_id=-1)
    for prompts, words in (([[3, 10**6]], "outside the model's vocabulary"), ([[]], "empty")):
        with pytest.raises(ValueError, match=words):
            drafted.generate(prompts, 4)
    with pytest.raises(ValueError, match="greedily"):
        drafted.generate([[3, 4]], 4, Sampling(temperature=0.7))


def test_split_context_matches_unsplit():
    """mesh.context = 2: the MTP modules run in the split layout like the main
    stack; the main and MTP losses and their gradients equal the unsplit model's."""
    from jaxmoe.models.transformer import DecoderLM
    from jaxmoe.parallel.options import MeshOptions

    cfg = tiny_config("model.mtp_depth=1", "model.moe.num_experts=0", "model.attention_block=0")
    graphdef, params = nnx.split(DecoderLM(cfg.model, rngs=model_rngs(jax.random.key(0))))
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 1, 128)

    @jax.jit
    @jax.value_and_grad
    def loss(params):
        model = nnx.merge(graphdef, params)
        hidden, _ = model(tokens, head=False)
        (h1,), _ = model.mtp_states(hidden, tokens)
        w = model.output_weights()
        main = jax.nn.log_softmax(head_logits(hidden, *w)[:, :-1])
        ahead = jax.nn.log_softmax(head_logits(h1, *w)[:, :-2])
        nll = -jnp.take_along_axis(main, tokens[:, 1:, None], -1).mean()
        return nll - 0.3 * jnp.take_along_axis(ahead, tokens[:, 2:, None], -1).mean()

    want, want_grads = loss(params)
    for context in (2,):
        with jax.set_mesh(make_mesh(MeshOptions(context=context))):
            got, grads = loss(params)
        np.testing.assert_allclose(got, want, rtol=1e-5, err_msg=f"context={context}")
        for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
            np.testing.assert_allclose(g, w, rtol=2e-4, atol=2e-6, err_msg=f"context={context}")
