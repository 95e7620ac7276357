"""DPO's place in a training run (train.objective=dpo; the objective itself is dpo.py): its
frozen reference and its held-out evaluation."""

from jaxmoe.checkpoints.manager import restore_params
from jaxmoe.errors import ConfigError
from jaxmoe.training.dpo import dpo_eval_step, dpo_metrics
from jaxmoe.training.steps import forward


def dpo_reference(config, lora_run, abstract_state, layouts) -> dict:
    """The reference as a tree like the train state's params: under train.lora the
    adapters at zero (so base + adapters is the base) with the groups trained in full at
    their base values; else the `train.init_from` checkpoint, restored apart from the state
    (which is donated to every step)."""
    if lora_run is not None:
        return lora_run.reference()
    if not config.train.init_from:
        raise ConfigError(
            "train.objective=dpo needs train.init_from: the reference model (and the start) "
            "is that checkpoint, typically a supervised fine-tune"
        )
    return restore_params(config.train.init_from, abstract_state["params"], layouts)


def dpo_evaluation(spec, config):
    """(step, summarize) of the training loop's Evaluator under train.objective=dpo: sums over
    held-out pairs of (policy, reference) parameter pairs, and their means."""
    beta, smoothing = config.train.dpo_beta, config.train.dpo_label_smoothing

    def logits(params, batch):
        return forward(spec.graphdef, params, batch, train=False, rest=spec.rest)[0]

    def step(both, batch):
        return dpo_eval_step(both[0], both[1], batch, logits, beta, smoothing)

    def summarize(totals) -> dict:
        pairs = max(float(totals["pairs"]), 1.0)
        means = {k: float(v) for k, v in dpo_metrics(totals, pairs).items()}
        reference = float(totals["reference_prefers"]) / pairs
        return means | {"pairs": int(totals["pairs"]), "reference_logps_accuracy": reference}

    return step, summarize
