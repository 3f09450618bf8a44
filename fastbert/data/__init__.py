"""Pretraining data: corpus -> WordPiece -> MLM + NSP (or MLM-only) examples -> memory-mapped shards ->
masked batches.

corpus.py reads documents and cuts the corpus into byte-bounded chunks, tokenizer.py trains or loads
WordPiece, examples.py cuts documents into NSP pairs as the paper (or packs full sentences across
documents for the MLM-only objective, as RoBERTa), shards.py stores them, sharding.py
turns one chunk into its shards (in a worker), prepare.py is `fastbert prepare-data`, masking.py and
loader.py build each rank's batches.
"""
