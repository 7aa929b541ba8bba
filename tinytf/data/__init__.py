"""Training data: parallel text files and token batches grouped by length
(:mod:`batches`), the corpus encoded once into memory-mapped flat files (:mod:`prepare`,
:mod:`corpus_file`)."""
