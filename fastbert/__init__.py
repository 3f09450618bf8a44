"""fastbert: BERT whose hot paths are Triton kernels, a drop-in for HuggingFace transformers' BERT."""
from fastbert.config import BertConfig

__version__ = "0.1.0"
__all__ = ["BertConfig", "__version__"]
