"""Pretraining data: corpus -> WordPiece -> MLM + NSP examples -> memory-mapped shards -> masked batches.

corpus.py reads documents, tokenizer.py trains or loads WordPiece, examples.py cuts documents into
NSP pairs as the paper, shards.py stores them, masking.py and loader.py build each rank's batches,
prepare.py is `fastbert prepare-data`.
"""
