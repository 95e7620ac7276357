"""experiments/gqa_ablation.py's summary over seeds, against hand-computed values: the gap to
the MHA control, the share of it closed by uptraining, and the seeds where the paper's
ordering (mean < first < random) holds."""

import pytest

from experiments import gqa_ablation


def rows(mha, mean, first, random):
    """One seed's rows: (alpha 0, alpha 0.05) losses per variant (GQA-4 only)."""

    def row(variant, method, losses):
        return {"variant": variant, "method": method, "alpha_0": {"loss": losses[0]},
                "alpha_0.05": {"loss": losses[1]}}  # fmt: skip

    return {"rows": [row("MHA", "-", mha), row("GQA-4", "mean", mean),
                     row("GQA-4", "first", first), row("GQA-4", "random", random)]}  # fmt: skip


def test_summary_by_hand():
    seeds = {
        # seed 0: gaps 0.4 -> 0.1 (75% closed); the ordering holds at both alphas
        "0": rows((3.0, 2.9), (3.4, 3.0), (3.5, 3.1), (3.6, 3.2)),
        # seed 1: gaps 0.2 -> 0.1 (50% closed); first beats mean at alpha 0
        "1": rows((3.0, 2.9), (3.2, 3.0), (3.1, 3.05), (3.3, 3.2)),
    }
    got = gqa_ablation.summarize(seeds, [0.0, 0.05])
    mean = got["cells"]["GQA-4 mean"]
    assert mean["alpha_0"]["loss_mean"] == pytest.approx(3.3)
    assert mean["alpha_0"]["gaps_to_mha"] == pytest.approx([0.4, 0.2])
    assert mean["alpha_0.05"]["gap_closed"] == pytest.approx([0.75, 0.5])
    assert got["cells"]["MHA -"]["alpha_0"]["gap_to_mha_mean"] == 0.0
    order = got["ordering"]["GQA-4"]
    assert order["alpha_0"] == {"mean<first<random": 1, "first<mean": 1, "seeds": 2}
    assert order["alpha_0.05"] == {"mean<first<random": 2, "first<mean": 0, "seeds": 2}
    assert "GQA-4 | mean | 3.300 ± 0.141 (+0.300)" in gqa_ablation.markdown(
        {
            "setup": {
                "alphas": [0.05],
                "uptrain_steps": {"0.05": 15},
                "seeds": [0, 1],
                "seconds": 1.0,
                "model": {"num_layers": 2, "d_model": 64, "num_heads": 8, "head_dim": 16},
                "train": {"steps": 300, "batch_size": 16, "seq_len": 64},
            },
            "summary": got,
        }
    )
