"""Embeddings without an encoder, for index tests and benches: `build_index(..., precomputed=HashVectors())` gives
every chunk a unit vector seeded by a hash of its id (deterministic, any process), so an index builds in
milliseconds and its BM25 and commit logic are what is exercised."""

from __future__ import annotations

import hashlib

import numpy as np

DIM = 384  # all-MiniLM-L6-v2's width: the index's collection takes vectors of the encoder it names


class HashVectors(dict):
    """`precomputed` for build_index that knows every chunk."""

    def __bool__(self) -> bool:
        return True

    def __contains__(self, key: object) -> bool:
        return True

    def __getitem__(self, key: str) -> np.ndarray:
        return hash_vector(key)


def hash_vector(text: str) -> np.ndarray:
    seed = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")
    vector = np.random.default_rng(seed).standard_normal(DIM).astype(np.float32)
    return vector / np.linalg.norm(vector)
