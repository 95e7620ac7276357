"""Data: corpora, TFDS, tokenizer, packing and batches. Entry point:
`jaxmoe.data.pipeline.build_data(config, process_index, process_count) -> DataBundle`.

Modules: corpus (local text sources and their split), tfds_text (TFDS builder and reading),
tokenizer (SentencePiece), packing (token cache and windows), sources (config -> cached
artifacts), pipeline (epoch order, train/eval batches). Nothing here imports jax.
"""
