"""Model construction from the `model` config."""

from flax import nnx


def build_model(model_cfg, *, rngs: nnx.Rngs, lora=None):
    """The model named by `model.arch` (decoder | encoder_decoder); `lora` (LoraOptions
    with rank > 0, models/lora.py): with adapters beside the weights it targets."""
    if model_cfg.arch == "encoder_decoder":
        if lora is not None and lora.enabled:
            raise ValueError("train.lora is implemented for decoder models (model.arch=decoder)")
        from jaxmoe.models.t5 import EncoderDecoderLM

        return EncoderDecoderLM(model_cfg, rngs=rngs)
    from jaxmoe.models.transformer import DecoderLM

    return DecoderLM(model_cfg, rngs=rngs, lora=lora if lora is not None and lora.enabled else None)
