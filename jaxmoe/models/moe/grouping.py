"""How the dropless dispatch groups a layer's assignments, chosen from its shapes.

With many small experts (Qwen3-MoE: 128 experts, 8 per token) each expert gets few rows
per step: A / E = tokens * k / E, 256 at 4096 tokens, 64 on a 1024-token shard. Padding
each expert's group to whole blocks of `model.moe.block_size` rows would then cost more
than the rows themselves, so:

- "blocks" (the CPU choice): the block size is halved from `model.moe.block_size` until a
  full block is at most an expert's average share of rows (and its tail block, a quarter
  of it, at most that share), never below MIN_BLOCK_ROWS while the share allows; padding
  is then under a quarter block per expert, at most ~1/8 of an average group. Measured
  (E=128 top-8, D 512, expert FFN 128, 1024 tokens = 64 rows/expert, fwd+bwd, loaded
  2-core host): 256/64-row blocks 856 ms, 64/16-row blocks 649 ms.
- "ragged" (the GPU/TPU choice when dropless): rows sorted by expert into one buffer and
  `jax.lax.ragged_dot` over exact group sizes: no padding at all. XLA:CPU lowers
  ragged_dot to a dense product per group over the whole buffer (E times the work), which
  is why CPU keeps the blocks.
- "dense" (every expert on every token) costs E / k times the routed work: never chosen
  by "auto"; a reference for tests and tiny models.

On GPU the "ragged" groups start on whole row tiles (`group_rows`): each expert's group is
padded with zero rows to a multiple of GPU_GROUP_ROWS, the M tile of the GPU's grouped
matmul kernels, so no tile spans two experts and each group's first row sits on a tile
boundary (the layout the GPU's grouped GEMMs ask for: DeepGEMM's contiguous layout takes
128-row expert segments, Megatron pads each expert's block for grouped_mm, cuDNN's grouped
weight gradient has needed aligned offsets). With few rows per expert (fine-grained
experts, a small shard) the tile is halved while it exceeds a quarter of an expert's
average share, so the padding stays under a quarter of a group (an eighth on average);
below MIN_GPU_GROUP_ROWS (decoding) the groups stay exact: an expert's few rows take one
tile either way. Not yet measured on a GPU (docs/gpu.md).
"""

# Below this many rows a block's loop overhead outweighs its padding; the decoding case
# (2 rows per expert) measured 8-row blocks as fast as 2-row ones (grouped_ffn.py).
MIN_BLOCK_ROWS = 8


GPU_GROUP_ROWS = 128
MIN_GPU_GROUP_ROWS = 16


def group_rows(num_assign: int, num_experts: int, platform: str) -> int:
    """The multiple of rows the ragged dispatch pads each expert's group to: 1 (exact groups)
    off GPU; on GPU GPU_GROUP_ROWS, halved while over a quarter of an expert's average
    share of the `num_assign` rows, and 1 once under MIN_GPU_GROUP_ROWS."""
    if platform != "gpu":
        return 1
    share = -(-num_assign // num_experts)
    rows = GPU_GROUP_ROWS
    while rows >= MIN_GPU_GROUP_ROWS and rows > share // 4:
        rows //= 2
    return rows if rows >= MIN_GPU_GROUP_ROWS else 1


def tail_rows(block: int) -> int:
    """Tail block size for an expert's remainder: a quarter block (at least 1 row)."""
    return max(block // 4, 1)


def block_rows(num_assign: int, num_experts: int, block_size: int) -> int:
    """The full-block size the block dispatch runs for A assignments over E experts.

    Halved from `block_size` while a tail block exceeds an expert's average share of rows,
    while a full block exceeds that share (but not below MIN_BLOCK_ROWS), or while a block
    exceeds the row buffer.
    """
    share = -(-num_assign // num_experts)
    while block_size > 1 and (
        tail_rows(block_size) > share
        or block_size > max(share, MIN_BLOCK_ROWS)
        or block_size > num_assign + num_experts * tail_rows(block_size)
    ):
        block_size //= 2
    return block_size


def grouping_summary(
    impl: str, *, tokens: int, slots: int, num_experts: int, block_size: int, platform: str = "cpu"
):
    """One line naming the grouping `impl` runs for `tokens` tokens on one device/shard."""
    share = tokens * slots / num_experts
    where = f"{tokens} tokens x {slots} slots / {num_experts} experts = {share:.0f} rows/expert"
    if impl == "blocks":
        block = block_rows(tokens * slots, num_experts, block_size)
        return f"blocks of {block} + tails of {tail_rows(block)} rows ({where})"
    if impl == "ragged":
        tile = group_rows(tokens * slots, num_experts, platform)
        if tile > 1:
            return f"ragged_dot over expert groups padded to {tile}-row tiles ({where})"
        return f"ragged_dot over exact expert groups, no padding ({where})"
    if impl == "dense":
        return f"dense: every expert on every token ({num_experts / slots:.0f}x the routed work)"
    return f"{impl} ({where})"
