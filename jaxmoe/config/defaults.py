"""The complete default configuration: every key jaxmoe knows, with its default.

`configs/default.py` (the default main job) and the converters start from `base_config()`,
so the installed package never needs the repository's `configs/` directory at run time.
"""

from ml_collections import ConfigDict


def base_config() -> ConfigDict:
    """Every config key with its default value and a one-line comment."""
    c = ConfigDict()

    c.model = m = ConfigDict()
    m.arch = "decoder"  # decoder | encoder_decoder
    m.vocab_size = 0  # 0: take the tokenizer's vocabulary size
    m.num_layers = 4  # decoder layers (encoder_decoder: also the encoder's, unless set below)
    m.num_encoder_layers = 0  # encoder_decoder only; 0: same as num_layers
    m.encoder_num_kv_heads = 0  # encoder_decoder: encoder KV heads; 0: num_heads (MHA)
    m.d_model = 128  # width of the residual stream
    m.num_heads = 4  # query heads
    m.num_kv_heads = 2  # key/value heads: = num_heads is MHA, 1 is MQA, between is GQA
    m.head_dim = 32  # width of one attention head
    m.ffn_dim = 512  # hidden size of a dense (gated) FFN
    m.activation = "silu"  # gated FFN activation: silu (SwiGLU) | gelu (T5.1.1) | relu
    m.norm_eps = 1e-6  # RMSNorm epsilon
    m.rope_theta = 10000.0  # rotary base; 0 disables rotary positions
    m.rope_type = "default"  # rotary frequency scaling: default (none) | linear | llama3
    m.rope_factor = 1.0  # linear / llama3: context-extension factor frequencies divide by
    m.rope_low_freq_factor = 1.0  # llama3: wavelengths over original_max_len / this scaled
    m.rope_high_freq_factor = 4.0  # llama3: wavelengths under original_max_len / this kept
    m.rope_original_max_len = 8192  # llama3: the context length before the extension
    m.qkv_bias = False  # biases on the query/key/value projections (Qwen2); none on the output
    m.tie_embeddings = False  # share the input embedding with the output layer
    m.ffn_gated = True  # act(x wi_0) * (x wi_1) wo; False: act(x wi) wo (T5 v1.0, Switch Base)
    m.dtype = "float32"  # compute dtype (float32 | bfloat16); parameters stay float32
    m.attention_block = -1  # causal self-attention query block; -1 auto (CPU only), 0 dense
    m.remat = "none"  # backward-pass recompute: none | full | dots_saveable | offload_dots
    m.scan_layers = False  # run the blocks under one scan (compile time independent of depth)
    m.relpos_buckets = 32  # encoder_decoder: T5 relative-position buckets
    m.relpos_max_distance = 128  # encoder_decoder: T5 relative-position max distance
    m.dropout_rate = 0.0  # training only: embeddings, attention and FFN outputs, final norm
    m.max_len = 0  # context: longest sequence trained on (train sets it); 0 = unknown

    m.moe = moe = ConfigDict()
    moe.num_experts = 8  # experts per MoE layer; 0 = dense model
    moe.every = 1  # an MoE FFN in every `every`-th layer (others dense)
    moe.ffn_dim = 256  # hidden size of one expert
    moe.gating = "adaptive"  # top1 | top2 | topk | adaptive | top_p
    moe.threshold = 0.1  # adaptive: two experts when the gap (gap_normalization) < threshold
    moe.top_k = 2  # topk: experts per token
    moe.top_p = 0.4  # top_p: smallest expert set whose probabilities pass p
    moe.max_k = 2  # top_p: at most this many experts per token (static shapes)
    moe.eval_gating = ""  # gate at evaluation time; "" = same as `gating`
    moe.gap_normalization = "top2"  # adaptive gap on: top2 (p1,p2 renormalised) | none (raw)
    moe.renormalize = False  # renormalise the chosen experts' weights to sum to one
    moe.single_weight = "prob"  # weight of a one-expert token: prob | one
    moe.capacity_factor = 0.0  # 0 = dropless; > 0 = fixed capacity that drops overflow
    moe.balance_loss_weight = 0.01  # load-balancing loss coefficient
    moe.balance_fractions = "auto"  # balance loss counts: auto (adaptive top1) | top1 | chosen
    moe.z_loss_weight = 0.001  # router z-loss coefficient
    moe.jitter = 0.0  # multiplicative router-input noise in training (0 = off)
    moe.router_bias = False  # a router bias [E] (Flaxformer RouterWeights use_bias)
    moe.block_size = 256  # rows per expert block in the block dispatch
    moe.dispatch = "auto"  # auto | blocks | ragged | dense | capacity (GShard fixed buffers)
    # Expert-parallel token exchange: ragged (sized to the routing, ragged_all_to_all) |
    # padded (worst-case all_to_all) | auto (padded on CPU, ragged on GPU/TPU).
    moe.ep_exchange = "auto"
    # ragged: receive buffer = this x the balanced load (local tokens x slots); overflow
    # goes in further rounds through it (dropless) or is dropped (capacity).
    moe.ep_buffer_factor = 2.0

    c.train = t = ConfigDict()
    t.steps = 600  # optimizer steps
    t.batch_size = 16  # global batch (sequences per step)
    t.seq_len = 128  # tokens per sequence
    t.seed = 0  # parameter init and data order
    t.grad_accum = 1  # micro-batches per step (batch_size must divide by it)
    t.log_every = 20  # steps between train lines in metrics.jsonl
    t.eval_every = 200  # steps between evaluations (0 = only at the end)
    t.eval_batches = 0  # validation batches per evaluation (0 = the whole split)
    t.checkpoint_every = 200  # steps between checkpoints (and one at the end)
    t.max_to_keep = 3  # checkpoints kept on disk
    t.init_from = ""  # checkpoint to take parameters from (fresh optimizer state)
    t.init_optimizer = False  # with init_from: also take its optimizer state (moments, steps)
    t.nonfinite = "stop"  # on a non-finite loss or gradient: stop | skip (the step)
    t.max_skipped_steps = 10  # nonfinite=skip: stop after this many skipped steps in a row
    t.profile_steps = ""  # "START:END": trace steps START+1..END into WORKDIR/profile
    t.peak_flops = 0.0  # FLOP/s of one device for `mfu` (0 = from the device kind, if known)
    t.wandb = ""  # Weights & Biases PROJECT[/RUN_NAME] ("" = off; WANDB_MODE=offline works)
    t.logits_z_loss = 0.0  # output z-loss: coef * mean(logsumexp(logits)^2) over targets

    c.optimizer = o = ConfigDict()
    o.name = "adamw"  # adamw | adafactor (optax's) | t5x_adafactor (T5X's, T5.1.1's)
    o.learning_rate = 3e-3  # peak learning rate (t5x_rsqrt: the numerator)
    o.schedule = "cosine"  # cosine | rsqrt | constant | t5x_rsqrt (lr / sqrt(max(step, warmup)))
    o.warmup_steps = 50  # linear warmup steps (t5x_rsqrt: flat until this step)
    o.min_lr_ratio = 0.1  # cosine: final learning rate / peak
    o.start_step = 0  # the schedule starts at this step (uptraining: where the source stopped)
    o.schedule_steps = 0  # cosine: length of the whole schedule; 0 = start_step + train.steps
    o.weight_decay = 0.1  # decoupled weight decay (adamw)
    o.b1 = 0.9  # first-moment decay
    o.b2 = 0.95  # second-moment decay
    o.eps = 1e-8  # adam epsilon
    o.grad_clip_norm = 1.0  # clip the global gradient norm (0 = off)
    o.decay_rate = 0.8  # t5x_adafactor: second-moment decay 1 - (t + 1)^-decay_rate
    o.clipping_threshold = 1.0  # t5x_adafactor: clip each update matrix to this RMS (0 = off)
    o.momentum = 0.0  # t5x_adafactor: first-moment decay (0 = none, as T5.1.1)

    c.mesh = ms = ConfigDict()
    ms.data = -1  # data-parallel axis (-1 = the remaining devices)
    ms.fsdp = 1  # parameter-sharded data-parallel axis
    ms.tensor = 1  # tensor-parallel axis (heads, FFN hidden)
    ms.expert = 1  # expert-parallel axis (also splits the batch)
    ms.dcn_data = -1  # multislice: slices the data axis spans (-1 = the remaining slices)
    ms.dcn_fsdp = 1  # multislice: slices the fsdp axis spans

    c.data = d = ConfigDict()
    d.source = "embedded"  # embedded | text:GLOB | jsonl:GLOB | parquet:GLOB | tfds:NAME
    # Several sources with weights, "SOURCE=WEIGHT,SOURCE=WEIGHT" ("" = data.source alone).
    d.mixture = ""
    d.train_split = "train"  # tfds split for training
    d.eval_split = "validation"  # tfds split for evaluation
    d.validation_fraction = 0.05  # local sources: share of documents held out for evaluation
    d.text_key = "text"  # tfds feature, jsonl field or parquet column holding the text
    d.vocab_size = 1024  # SentencePiece vocabulary when training one
    d.tokenizer = ""  # SentencePiece .model, HF tokenizer.json or its folder ("" = train one)
    # EOS of a tokenizer.json without tokenizer_config.json ("" = its </s>, <|endoftext|>...).
    d.eos_token = ""
    d.cache_dir = ""  # tokenizer / token cache ("" = ~/.cache/jaxmoe)
    d.prepare_timeout_s = 3600  # other processes wait this long for process 0 to prepare
    d.data_dir = ""  # TFDS data_dir ("" = under cache_dir)
    d.streaming = False  # train split tokenized and packed as read (no token cache; LM only)
    d.prefetch = 2  # batches built ahead on a background thread (0 = on the training thread)
    d.shuffle = True  # shuffle examples each epoch (by train.seed and epoch)
    d.curriculum = "none"  # none | paper | magnitude
    d.curriculum_source = "previous_epoch"  # routing from: previous_epoch | scoring_pass
    d.noise_density = 0.15  # encoder_decoder span corruption: share of tokens masked out
    d.mean_noise_span = 3.0  # encoder_decoder span corruption: mean masked span length
    return c
