"""experiments.adaptive_k_uptrain and its PyTorch pretraining: the learning-rate mirror of
jaxmoe's schedule, and the pretrain -> save -> `convert hf` -> evaluate link on a two-step
toy (transformers' eval loss equals the converted model's, and the kept-expert count is the
hand count of the gate swapped in)."""

import numpy as np
import pytest

from experiments import adaptive_k_uptrain as bench
from experiments import qwen3_moe_pretrain as hf
from experiments.adaptive_k_curve import evaluate_gate


@pytest.mark.parametrize(("warmup", "total"), [(4, 40), (1, 3), (0, 10)])
def test_torch_learning_rate_follows_jaxmoe_schedule(warmup, total):
    from jaxmoe.config.schema import JobConfig
    from jaxmoe.training.optimizer import learning_rate_schedule

    opt = JobConfig().optimizer.replace(warmup_steps=warmup)
    schedule = learning_rate_schedule(opt, total)
    want = [float(schedule(step)) for step in range(total + 2)]  # past the end: the floor
    got = [opt.learning_rate * hf.lr_factor(s, warmup, total, opt.min_lr_ratio) for s in
           range(total + 2)]  # fmt: skip
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-12)


def test_gates_train_with_their_knobs_and_swap_in_at_evaluation():
    assert bench.train_gate("top_p0.2") == [
        "model.moe.gating=top_p",
        "model.moe.top_p=0.2",
        "model.moe.max_k=8",
    ]
    assert bench.swapped_gate("adaptive_k8_T0.3") == [
        "model.moe.eval_gating=adaptive_k",
        "model.moe.threshold=0.3",
        "model.moe.max_k=8",
    ]


def test_adaptive_point_is_compared_with_the_curve_at_its_own_share_and_seed():
    def run(**points):  # name -> (share kept, eval loss)
        return {"gates": {n: {"share_kept": x, "eval_loss": y} for n, (x, y) in points.items()}}

    curve = ("top2", "top4", "top8")
    per_seed = {
        "0": run(top2=(0.25, 3.2), top4=(0.5, 3.1), top8=(1.0, 3.0), a=(0.375, 3.2)),
        "1": run(top2=(0.25, 3.4), top4=(0.5, 3.2), top8=(1.0, 3.0), a=(0.75, 3.0)),
        "2": run(top2=(0.25, 3.4), top4=(0.5, 3.2), top8=(1.0, 3.0), a=(0.2, 3.0)),
    }
    gaps = bench.paired_gaps(per_seed, "a", curve)
    # Seed 0: halfway between 3.2 and 3.1; seed 1: halfway between 3.2 and 3.0; seed 2: below
    # the curve's smallest share, so no comparison.
    assert gaps[0] == pytest.approx(0.05) and gaps[1] == pytest.approx(-0.1) and gaps[2] is None


def test_pretrained_model_converts_to_the_same_loss_and_counts_kept_experts(
    embedded_data_cache, tmp_path
):
    """Two pretraining steps on a smaller model; pretrain_and_convert asserts that the
    converted top-8 loss equals transformers' on the validation split. Top-2 keeps 2 of 8
    (share 0.25) and adaptive_k at T = 0 keeps the top-1 only, for every token."""
    args = bench.parse_args(["--out", str(tmp_path), "--quick", "--pretrain_steps", "2"])
    args.data = [*bench.QUICK_DATA, "train.batch_size=8", "data.vocab_size=512",
                 f"data.cache_dir={embedded_data_cache}"]  # fmt: skip
    args.size = {"seq_len": 32, "d_model": 32, "head_dim": 8, "num_experts": 16, "expert_dim": 8}
    base = bench.pretrain_and_convert(args, tmp_path)
    link = base["link"]
    assert link["jaxmoe_converted_eval_loss"] == pytest.approx(
        link["transformers_eval_loss"], rel=bench.LINK_RTOL
    )
    top2 = evaluate_gate(base["converted"], [*bench.EVAL, *bench.swapped_gate("top2")], 8)
    assert (top2["experts_per_token"], top2["share_kept"]) == (2.0, 0.25)
    top1 = bench.eval_gate("adaptive_k", threshold=0.0, max_k=8)
    assert evaluate_gate(base["converted"], [*bench.EVAL, *top1], 8)["experts_per_token"] == 1.0
