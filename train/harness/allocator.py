"""The GPU memory allocator the training CLIs run on: CUDA's stream-ordered allocator (``cudaMallocAsync``) unless
``$XLA_PYTHON_CLIENT_ALLOCATOR`` names another.

Why: XLA launches a step as one CUDA graph and, before each launch, re-records every command whose buffers moved
since the last one; a custom call or GEMM is re-recorded by capturing it again. Under JAX's default allocator (BFC)
the step's temporary buffer comes back at a new address nearly every step, so every command of the graph is
re-recorded every step. Measured on one H200 (transformer-big, 8192 tokens, ``train.wmt --backend ffi``, XLA's log
of its updates): the fp8 step's 957 commands took 7-14 ms to re-record a step, bf16's 544 3-7 ms; under the
stream-ordered allocator the same buffers return at the same addresses, XLA leaves about 520 of the 957 commands
as they were, and an update takes 3.8 ms in fp8 and 0.7 ms in bf16 (docs/results/README.md, "Through the CLIs").
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

ALLOCATOR_VAR = "XLA_PYTHON_CLIENT_ALLOCATOR"
STREAM_ORDERED = "cuda_async"


def choose_allocator(environ: MutableMapping[str, str] = os.environ) -> str:
    """Sets ``$XLA_PYTHON_CLIENT_ALLOCATOR`` to `STREAM_ORDERED` unless it is set; returns the allocator in effect.

    JAX reads the variable when it creates its GPU client, so this must run before anything touches a device; other
    platforms ignore it. A set value, even an empty one, is the user's choice and stays.
    """
    return environ.setdefault(ALLOCATOR_VAR, STREAM_ORDERED)
