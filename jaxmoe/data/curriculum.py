"""Routing-complexity curriculum (Li et al., EMNLP 2023): ordering policies, in pure numpy.

The complexity of training example d is C_d = [r_1 .. r_M]: r_i is the fraction of its
tokens the gate sent to two experts in MoE layer i (layers in model order). Collected
vectors are float32 [N, M] plus a bool `seen` [N] (no vector yet); see curriculum_hooks.py
for how they are collected and complexity_store.py for how they are stored.

`data.curriculum` picks the policy:
- `none`: the default shuffled order (pipeline.default_epoch_order).
- `magnitude`: mean of C_d over layers, ascending (least two-expert routing first).
- `paper`: the reference is the seen example with the fewest top-2 tokens, summed over
  the MoE layers (`data.curriculum_reference = count`, the paper's "fewest top-2 tokens"),
  or with the smallest mean fraction (`mean`); lowest id on ties. The two differ when
  examples have different numbers of real tokens (padding, variable lengths): a short
  example with 3 of 4 tokens on two experts has fewer top-2 tokens than a long one with 10
  of 100, but the larger fraction. Examples are sorted by cosine similarity to the
  reference, most similar first. Cosine is
  undefined for an all-zero reference (an example that never needed two experts, common
  with a confident router): then similarity is the Euclidean distance to the reference,
  i.e. the vector's norm, ascending, so zero vectors come first. Fractions are >= 0, so a
  non-zero reference (smallest mean > 0) implies that no seen vector is zero.

Rules shared by the policies (`epoch_order`):
- Ties keep the order of the epoch's seeded permutation (the default shuffle of
  (train.seed, epoch)); sort keys are rounded to 1e-6 first (the vectors are float32, good
  to ~7 digits) so that mathematically equal keys (equal or parallel vectors, or equal
  means such as (0.1 + 0.3) / 2 and 0.2, which differ by 4e-9 in float32) tie exactly.
- The last N mod B ids of that permutation are the ones TrainBatches drops after the last
  full batch, as without a curriculum. They are set aside before sorting and appended at
  the end: otherwise the most complex examples would be the dropped ones, every epoch.
- Unseen examples (no vector yet) follow the seen ones, in permutation order: their
  complexity is unknown, so they are kept out of the sorted run, yet they are trained (and
  measured) in this epoch.
- Shard-aware by construction: TrainBatches cuts the order into consecutive chunks of B
  (one global step each); process p takes rows [p*B/P, (p+1)*B/P) of a chunk and its
  devices contiguous slices of those, so every data-parallel shard of a step holds ranks
  from the same window of B consecutive complexities.
"""

import numpy as np

from jaxmoe.data.options import CURRICULUM_POLICIES as POLICIES
from jaxmoe.data.pipeline import default_epoch_order

_KEY_DECIMALS = 6  # complexities are float32: ~7 significant digits
_ROWS_PER_CHUNK = 1 << 18


def _check_vectors(vectors_NM, seen_N) -> tuple[np.ndarray, np.ndarray]:
    vectors_NM = np.asarray(vectors_NM)
    seen_N = np.asarray(seen_N, dtype=bool)
    if vectors_NM.ndim != 2 or seen_N.shape != vectors_NM.shape[:1]:
        raise ValueError(
            f"complexity vectors must be [N, M] with seen [N]; got {vectors_NM.shape} and "
            f"{seen_N.shape}"
        )
    valid_N = _map_rows(lambda v: np.all((v >= 0) & (v <= 1), axis=1), vectors_NM) | ~seen_N
    if not valid_N.all():
        bad = int(np.argmin(valid_N))
        raise ValueError(
            f"complexity vector of example {bad} is {vectors_NM[bad].tolist()}: fractions of "
            f"tokens must lie in [0, 1]"
        )
    return vectors_NM, seen_N


def _map_rows(fn, vectors_NM) -> np.ndarray:
    """fn over float64 chunks of rows, concatenated: bounded memory for memmapped [N, M]."""
    n = vectors_NM.shape[0]
    chunks = [
        fn(np.asarray(vectors_NM[s : s + _ROWS_PER_CHUNK], dtype=np.float64))
        for s in range(0, n, _ROWS_PER_CHUNK)
    ]
    return np.concatenate(chunks) if chunks else np.zeros((0,))


def magnitude_keys(vectors_NM: np.ndarray) -> np.ndarray:
    """Sort keys float64 [N] of `magnitude`: mean top-2 fraction over layers."""
    return _map_rows(lambda v: np.mean(v, axis=1), vectors_NM)


def paper_reference(
    vectors_NM: np.ndarray, seen_N: np.ndarray, counts_NM: np.ndarray | None = None
) -> int | None:
    """Id of the seen example with the fewest top-2 tokens over all layers (`counts_NM`,
    top-2 tokens per example and MoE layer), or without counts the smallest mean fraction;
    lowest id on ties. None if none seen."""
    seen_N = np.asarray(seen_N, dtype=bool)
    if not seen_N.any():
        return None
    if counts_NM is None:
        keys_N = magnitude_keys(vectors_NM)
    else:  # counts are whole numbers stored as float32: exact sums
        keys_N = _map_rows(lambda c: np.sum(c, axis=1), counts_NM)
    return int(np.argmin(np.where(seen_N, keys_N, np.inf)))


def paper_keys(vectors_NM: np.ndarray, reference: int) -> np.ndarray:
    """Sort keys float64 [N] of `paper` (ascending = most similar to the reference first).

    -cosine(C_d, C_ref); for an all-zero reference, ||C_d|| (see the module docstring).
    """
    ref_M = np.asarray(vectors_NM[reference], dtype=np.float64)
    ref_norm = float(np.linalg.norm(ref_M))
    if ref_norm == 0.0:
        return _map_rows(lambda v: np.linalg.norm(v, axis=1), vectors_NM)

    def negative_cosine(v_NM):
        # A zero C_d cannot occur next to a non-zero reference (fractions are >= 0); guard
        # the division anyway so such a row gets similarity 0 rather than NaN.
        norms_N = np.maximum(np.linalg.norm(v_NM, axis=1) * ref_norm, np.finfo(np.float64).tiny)
        return -(v_NM @ ref_M) / norms_N

    return _map_rows(negative_cosine, vectors_NM)


def rank_seen(policy: str, vectors_NM, seen_N, tie_order: np.ndarray, counts_NM=None) -> np.ndarray:
    """`tie_order` (int ids) re-ranked by `policy`: seen ids sorted, then unseen ids.

    Stable sort on keys rounded to 1e-6, so equal keys keep their `tie_order` order.
    `counts_NM` (top-2 tokens per example and layer, or None): the paper's reference.
    """
    if policy not in POLICIES:
        raise ValueError(f"data.curriculum={policy!r} is not one of {list(POLICIES)}")
    tie_order = np.asarray(tie_order, dtype=np.int64)
    if policy == "none":
        return tie_order
    vectors_NM, seen_N = _check_vectors(vectors_NM, seen_N)
    if policy == "magnitude":
        keys_N = magnitude_keys(vectors_NM)
    else:
        reference = paper_reference(vectors_NM, seen_N, counts_NM)
        if reference is None:
            return tie_order
        keys_N = paper_keys(vectors_NM, reference)
    keys_N = np.round(keys_N, _KEY_DECIMALS)
    is_seen = seen_N[tie_order]
    seen_ids, unseen_ids = tie_order[is_seen], tie_order[~is_seen]
    return np.concatenate([seen_ids[np.argsort(keys_N[seen_ids], kind="stable")], unseen_ids])


def epoch_order(
    policy: str,
    vectors_NM: np.ndarray,
    seen_N: np.ndarray,
    *,
    epoch: int,
    seed: int,
    batch_size: int,
    shuffle: bool = True,
    counts_NM: np.ndarray | None = None,
) -> np.ndarray:
    """The ids of an epoch, int64 [N]: ranked by `policy`, the dropped tail kept last.

    A pure function of (policy, seed, epoch, complexities). Every id appears exactly once.
    `counts_NM`: top-2 token counts [N, M] for the paper's reference (None: smallest mean).
    """
    num_examples = int(np.shape(seen_N)[0])
    if batch_size < 1:
        raise ValueError(f"train.batch_size={batch_size} must be positive")
    permutation = default_epoch_order(epoch, num_examples=num_examples, seed=seed, shuffle=shuffle)
    kept = num_examples - num_examples % batch_size
    ranked = rank_seen(policy, vectors_NM, seen_N, permutation[:kept], counts_NM)
    return np.concatenate([ranked, permutation[kept:]]).astype(np.int64)
