"""Model construction from the `model` config."""

from flax import nnx


def build_model(model_cfg, *, rngs: nnx.Rngs):
    """The model named by `model.arch` (decoder | encoder_decoder)."""
    if model_cfg.arch == "encoder_decoder":
        from jaxmoe.models.t5 import EncoderDecoderLM

        return EncoderDecoderLM(model_cfg, rngs=rngs)
    from jaxmoe.models.transformer import DecoderLM

    return DecoderLM(model_cfg, rngs=rngs)
