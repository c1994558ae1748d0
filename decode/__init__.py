"""Decoding: lean engine, plain, chain, tree and staged speculative decoding.

    from decode import SpeculativeDecoder
"""
from decode.api import DecoderOptions, Result, SpeculativeDecoder

__all__ = ["DecoderOptions", "Result", "SpeculativeDecoder"]
