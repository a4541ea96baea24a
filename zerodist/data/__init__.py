"""Byte-level training data read from the Python standard library's own sources.

Nothing distributed here: the engine wraps :class:`TokenDataset` in a distributed sampler.
"""

from zerodist.data.corpus import MIN_CORPUS_BYTES, TokenDataset, split_corpus, stdlib_corpus
from zerodist.data.sampler import LayoutInvariantSampler

__all__ = ["MIN_CORPUS_BYTES", "LayoutInvariantSampler", "TokenDataset", "split_corpus", "stdlib_corpus"]
