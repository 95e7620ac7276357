"""`decode --record_routing`: the experts a generation ran each position through, as the
prefill and the decode loop chose them (decode.py), for router replay (data/routing_record.py)."""

import time

import numpy as np


def generate_recorded(generator, prompts, max_new_tokens, sampling, seed):
    """Generator.generate that also returns the experts of every position it ran
    (Generation.routing, per prompt [n - 1, M, K]): a prompt's from the prefill (its last P
    slots: prompts are left-padded), the new tokens fed back from the loop (all but the
    last)."""
    from jaxmoe.inference.decode import Generation, bucket, cut_at_stop

    generator.check_prompts(prompts, max_new_tokens)
    generator.check_fits(len(prompts), max(len(p) for p in prompts), max_new_tokens)
    new_bucket = bucket(max_new_tokens)
    start = time.perf_counter()
    state, _, compile_prefill = generator.prefill(prompts, new_bucket, record=True)
    prompt_experts = np.asarray(state["experts_BPMK"])
    prefill_s = time.perf_counter() - start - compile_prefill
    start = time.perf_counter()
    tokens, steps, compile_decode, new_experts = generator.decode(
        state, len(prompts), max_new_tokens, sampling, seed, record=True
    )
    decode_s = time.perf_counter() - start - compile_decode
    rows = tokens[: len(prompts), :max_new_tokens].tolist()
    out = [cut_at_stop(row, generator.stop_ids) for row in rows]
    width = prompt_experts.shape[1]
    routing = [
        np.concatenate([prompt_experts[i, width - len(p) :], new_experts[i, : len(new) - 1]])
        for i, (p, new) in enumerate(zip(prompts, out, strict=True))
    ]
    compile_s = compile_prefill + compile_decode
    return Generation(out, prefill_s, decode_s, compile_s, steps, routing=routing)
