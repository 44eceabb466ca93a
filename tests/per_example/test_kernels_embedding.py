"""Embedding kernels (kernels/embedding.py): both norm branches agree with materialised gradients."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")


from lightning_dp.per_example.kernels.embedding import embedding_use_gram


def test_embedding_branches() -> None:
    assert embedding_use_gram(3, 8)
    assert not embedding_use_gram(12, 4)
