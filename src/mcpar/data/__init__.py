"""Training data: corpora and their tokenizers, ``mcpar prepare``'s token shards, batch streams.

``corpus`` loads a ``data.source`` (text, ``.bin``, prepared shards or a blend of them);
``stream`` serves its seeded, layout-independent batches; ``prepare``, ``shards`` and
``prepared_corpus`` write and read token shards; ``bpe``, ``tokenizer_file`` and ``text_files``
are the tokenizers and the text sources.
"""
