"""ggml quantization formats: block layouts, numpy reference (de)quantizers.

    dequantize(data, qtype, shape=None) -> float32   # raw uint8 blocks in
    quantize(x, qtype) -> uint8 (..., row_bytes)      # float32 (..., k) in
    widen_to_q8_0(data, qtype) -> uint8                # Q4_0 / Q5_0 bytes as Q8_0, exactly

Every fast kernel elsewhere is tested against these references.
"""
from .activations import quantize_q8_0, quantize_q8_1, quantize_q8_K
from .codec import DEQUANTIZABLE, QUANTIZABLE, dequantize, quantize, widen_to_q8_0
from .formats import FORMATS, QuantFormat, format_for
from .iquants import IQ4_LEVELS
from .types import LAYOUTS, QK_K, BlockLayout, GGMLType, layout

__all__ = [
    "BlockLayout", "DEQUANTIZABLE", "FORMATS", "GGMLType", "IQ4_LEVELS", "LAYOUTS", "QK_K",
    "QUANTIZABLE", "QuantFormat", "dequantize", "format_for", "layout", "quantize",
    "quantize_q8_0", "quantize_q8_1", "quantize_q8_K", "widen_to_q8_0",
]
