"""Decoding: lean engine, plain, chain, tree and staged speculative decoding."""
