"""The mixture-of-experts FFN: the layer (layer.py), gates (gates.py), dispatch of tokens to
experts (dispatch.py), the grouped expert FFN (grouped_ffn.py) and the expert-parallel
exchange across devices (expert_parallel.py)."""
