"""Per-example gradient norms and clipped sums straight from (layer inputs, output gradients).

Flat clipping needs only each example's squared gradient norm and the weighted sum Σ_i w_i g_i, so
for the layers below both are computed from the activations ``a`` and backprops ``δ`` (the gradient
of the layer's output, already scaled to per-example) without materialising the [B, *param.shape]
per-example gradients ("ghost clipping", Li et al. ICLR 2022; "book-keeping", Bu et al. ICML 2023):

* Linear / Conv (unfolded patches as a sequence of length T): ‖Σ_t δ_t a_tᵀ‖²_F equals
  Σ_{t,s} (a_t·a_s)(δ_t·δ_s) (Gram trick, O(T²) memory) and is used when T² < d_in·d_out;
  otherwise that layer's per-example gradient is materialised for the norm only.
* Embedding: the per-example gradient is a sparse row sum, squared norm Σ_{t,s} [i_t = i_s] δ_t·δ_s.
* LayerNorm / GroupNorm: per-example gradients are tiny and materialised (Opacus's formulas).

``weighted_grad`` is one ordinary reduction over the batch with the weights folded into the
backprops: a matmul (Linear), the layer's own weight-gradient convolution (Conv, equal to the
matmul of the unfolded patches but without unfolding) or ``index_add_`` (Embedding). All results
are fp32 whatever the input dtype. Each layer's formula assumes the layer is called once per forward
pass: a shared layer's norm is not the sum of its calls' norms, so the engine must materialise those.

Norms never understate (:func:`.certified.certified_sq_norms`): every norm formed from sums over positions (Gram
identities, per-example gradients summed over positions, bias sums) comes with a bound on its fp32
rounding error from the magnitudes of its terms; where the terms cancel so much that the bound exceeds
:data:`.certified.GUARD_FRACTION` of the value (crafted inputs), that example is recomputed exactly in fp64,
elsewhere the value plus its bound is returned. DP is a worst case over data sets: one example whose
per-position gradients nearly cancel must not pass as a small norm and be summed unclipped.

``registry`` holds the registry, the kernels' contract (``KernelPair``: ``sq_norms(call)`` and
``weighted_grad(call, weights)`` on one ``KernelCall``) and the entry points (re-exported here); one module per family registers its pair on import
(``linear``, ``conv`` with ``conv_methods`` and ``conv_autotune``, ``embedding``, ``norm``; ``ecosystem``
for timm/Hugging Face layers once their library is loaded).
"""

from __future__ import annotations

# The kernel families register themselves on import.
from lightning_dp.per_example.kernels import conv, embedding, linear, norm  # noqa: F401
from lightning_dp.per_example.kernels.registry import (
    FAST_CLIPPERS,
    Cache,
    FastClipper,
    Grads,
    KernelCall,
    KernelPair,
    SqNormsFn,
    WeightedGradFn,
    is_supported,
    register_fast_clipper,
    sq_norms,
    weighted_grad,
)

__all__ = [
    "FAST_CLIPPERS",
    "Cache",
    "FastClipper",
    "Grads",
    "KernelCall",
    "KernelPair",
    "SqNormsFn",
    "WeightedGradFn",
    "is_supported",
    "register_fast_clipper",
    "sq_norms",
    "weighted_grad",
]
