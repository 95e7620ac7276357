"""Nested parameter dicts <-> flat {path tuple: leaf} maps (what converters walk)."""


def flatten(tree: dict, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], object]:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(flatten(value, (*prefix, key)))
        else:
            flat[(*prefix, key)] = value
    return flat


def unflatten(flat: dict[tuple[str, ...], object]) -> dict:
    tree: dict = {}
    for path, value in flat.items():
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return tree


def select(tree: dict, keep) -> dict:
    """The subtree of the leaves whose path `keep(path)` accepts (emptied dicts dropped)."""
    return unflatten({path: leaf for path, leaf in flatten(tree).items() if keep(path)})


def join(*trees: dict) -> dict:
    """One tree of the leaves of `trees` (disjoint subtrees of one model, e.g. a frozen
    base and its trained adapters); a later tree's leaf wins a shared path."""
    flat: dict = {}
    for tree in trees:
        flat.update(flatten(tree))
    return unflatten(flat)
