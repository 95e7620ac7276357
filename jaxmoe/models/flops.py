"""Model FLOPs of one training step, from the config: the numerator of MFU.

Counted as PaLM's MFU does: matmul FLOPs only (2 per multiply-add), forward plus backward
(3x forward): attention projections, attention scores (QK^T and PV over the full key
length, not halved by the causal mask), dense FFNs, router and experts, the output layer.
Embedding lookups, norms, softmax and remat recomputation are not model FLOPs.

Why not XLA's cost analysis: it counts a while loop's body once (a `scan` over micro-batches
or the MoE block loops with their traced trip counts), so it undercounts such programs.
"""

from jaxmoe.models.layer_kinds import is_moe_layer
from jaxmoe.models.moe.gates import num_slots
from jaxmoe.models.options import MoEOptions


def experts_per_token(moe: MoEOptions) -> float:
    """Experts each token runs. Adaptive and top-p gates send a data-dependent share of tokens
    to a second (or k-th) expert; they are counted at their maximum, an upper bound."""
    return float(num_slots(moe.gate))


def ffn_macs_per_token(cfg, layer_index: int) -> float:
    """Multiply-adds per token of the FFN slot of layer `layer_index` (gated: 3 matrices,
    ungated: 2; the model's FLOPs, not the extra matmul ungated experts run, moe.py)."""
    matrices = 3 if cfg.ffn_gated else 2
    if is_moe_layer(cfg, layer_index):
        moe = cfg.moe
        router = cfg.d_model * moe.num_experts
        routed = experts_per_token(moe) * matrices * cfg.d_model * moe.ffn_dim
        # Shared experts (one FFN every token runs) and Qwen2-MoE's [D, 1] gate on them.
        shared_width = moe.num_shared_experts * (moe.shared_ffn_dim or moe.ffn_dim)
        shared = matrices * cfg.d_model * shared_width
        if moe.shared_expert_gate:
            shared += cfg.d_model
        return router + routed + shared
    return matrices * cfg.d_model * cfg.ffn_dim


def _projection_macs(cfg, kv_heads: int) -> float:
    """q and out ([D, H*d]) plus k and v ([D, K*d]) multiply-adds per token."""
    if cfg.attention == "mla":
        return _latent_projection_macs(cfg)
    return (
        2 * cfg.d_model * cfg.num_heads * cfg.head_dim + 2 * cfg.d_model * kv_heads * cfg.head_dim
    )


def _latent_projection_macs(cfg) -> float:
    """MLA (models/mla.py): the query path, the latent + rotary-key projection, the key/value
    up-projection of the latent and the output, per token, as training computes them."""
    h, qk = cfg.num_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    rank, q_rank = cfg.kv_lora_rank, cfg.q_lora_rank
    query = cfg.d_model * q_rank + q_rank * h * qk if q_rank else cfg.d_model * h * qk
    latent = cfg.d_model * (rank + cfg.qk_rope_head_dim)
    up = rank * h * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    return query + latent + up + h * cfg.v_head_dim * cfg.d_model


def _score_macs(cfg, query_len: int, key_len: int) -> float:
    """QK^T and PV multiply-adds of one sequence: 2 * H * d * L * S."""
    if cfg.attention == "mla":  # q.k over dn + dr dims, p.v over dv
        widths = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim
        return cfg.num_heads * widths * query_len * key_len
    return 2 * cfg.num_heads * cfg.head_dim * query_len * key_len


def forward_macs_per_sequence(cfg, seq_len: int, encoder_seq_len: int | None = None) -> float:
    """Forward multiply-adds of one sequence (decoder tokens `seq_len`, encoder tokens
    `encoder_seq_len` for model.arch = encoder_decoder)."""
    length = seq_len
    output_layer = length * cfg.d_model * cfg.vocab_size
    if cfg.arch != "encoder_decoder":
        macs = output_layer
        # Multi-token prediction (models/mtp.py): module k is one more block (layer
        # num_layers + k), its [2D, D] projection and another pass of the output layer.
        depth = cfg.mtp_depth
        for i in range(cfg.num_layers + depth):
            per_token = _projection_macs(cfg, cfg.num_kv_heads) + ffn_macs_per_token(cfg, i)
            macs += length * per_token + _score_macs(cfg, length, length)
        return macs + depth * (output_layer + length * 2 * cfg.d_model * cfg.d_model)
    source = encoder_seq_len or seq_len
    encoder_kv_heads = cfg.encoder_num_kv_heads or cfg.num_heads
    macs = output_layer
    for i in range(cfg.num_encoder_layers or cfg.num_layers):
        per_token = _projection_macs(cfg, encoder_kv_heads) + ffn_macs_per_token(cfg, i)
        macs += source * per_token + _score_macs(cfg, source, source)
    q_and_out = 2 * cfg.d_model * cfg.num_heads * cfg.head_dim
    k_and_v = 2 * cfg.d_model * cfg.num_kv_heads * cfg.head_dim
    for i in range(cfg.num_layers):
        self_attention = length * _projection_macs(cfg, cfg.num_kv_heads)
        self_attention += _score_macs(cfg, length, length)
        # Cross-attention: queries from decoder tokens, keys/values from encoder tokens.
        cross = length * q_and_out + source * k_and_v + _score_macs(cfg, length, source)
        macs += self_attention + cross + length * ffn_macs_per_token(cfg, i)
    return macs


def train_flops_per_step(
    model_cfg, batch_size: int, seq_len: int, encoder_seq_len: int | None = None
) -> float:
    """Model FLOPs of one optimizer step over `batch_size` sequences (forward + backward)."""
    forward = forward_macs_per_sequence(model_cfg, seq_len, encoder_seq_len)
    return 3 * 2 * forward * batch_size
