"""Attention kernels for kvjax: Pallas kernels, their pure-jnp f32 references, and implementation dispatch.

Every public function takes `implementation=` (None = "pallas" on GPU, `active_cpu_implementation()` elsewhere:
"native" where the native CPU kernel builds, else "xla"; or one of "xla", "pallas", "pallas_interpret",
"pallas_debug", "native"). See README.md for the backend choice and each kernel's masking rule.
"""

from pallas_kernels.attention import (attend, compressed_attention, decode_attention, verify_attention,
                                      window_attention)
from pallas_kernels.backend import IMPLEMENTATIONS, active_cpu_implementation, resolve
from pallas_kernels.linear import bf16_weights_supported, linear
from pallas_kernels.online_softmax import combine, finalize
from pallas_kernels.quantized import quantized_attention
from pallas_kernels.sparse import sparse_attention

__all__ = ["IMPLEMENTATIONS", "active_cpu_implementation", "attend", "bf16_weights_supported", "combine",
           "compressed_attention", "decode_attention", "finalize", "linear", "quantized_attention", "resolve",
           "sparse_attention", "verify_attention", "window_attention"]
