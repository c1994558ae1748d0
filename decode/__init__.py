"""Decoding: lean engine, plain, chain, tree and staged speculative decoding.

    from decode import SpeculativeDecoder
"""
from decode.api import DecoderBusy, DecoderOptions, Result, SpeculativeDecoder

__all__ = ["DecoderBusy", "DecoderOptions", "Result", "SpeculativeDecoder"]
