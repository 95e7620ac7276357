"""Data: corpora, TFDS, tokenizers, packing and batches. Entry point:
`jaxmoe.data.pipeline.build_data(data, train, spans=..., ...) -> DataBundle`: the `data`
section (options.DataOptions), what it reads of `train` (options.TrainSection: seq_len,
batch_size, seed) and whether the model reads span corruption (options.span_corruption);
never the whole config.

Modules: corpus (local text sources and their split), tfds_text (TFDS builder and reading),
tokenizer (SentencePiece, and `tokenizer.json` through hf_tokenizer), packing (token cache
and windows), seq2seq (T5 span corruption), sources (data section -> cached artifacts), mixture
(weighted mixtures of sources), stream (tokenize-as-you-read training data), multihost
(prepare once, trace each process's rows), prefetch (batches on a background thread),
curriculum and complexity_store (routing-complexity orderings), pipeline (epoch order,
train/eval batches). Nothing here imports training code.
"""
