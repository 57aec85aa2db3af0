"""The CUDA backend's ops as small records (plans), each turning itself into kernel launches.

The backend builds one record per op call and runs its launches at once; while a step is
recorded it also keeps the records, so that _fuse can merge neighbours and the merged list can
be captured into a CUDA graph. Records refer to device arrays (CuPy), never to host data: step
inputs were uploaded before the record was made. One module per kind of op: matmul, attention,
rows (norms, activations, rope, the KV-cache write), sample, experts (mixture-of-experts layers).
"""
from .attention import Attention, QkvPost
from .base import MATRIX_TYPES, Copy, DeviceMatrix, Launch, quantized, xq_bytes
from .experts import ExpertMatmul, ExpertSum, RouteExperts, experts_module
from .matmul import MODE_GELU, MODE_RESIDUAL, MODE_SILU, MODE_STORE, Matmul, ResidualPrologue, SplitScratch, Tail
from .rows import (Add, AddRow, CopyPages, GatedAct, GatherRows, Gelu, GetRows, KvStore, LayerNorm, NormAdd, PosScale,
                   RmsNorm, Rope, RopeArgs, Scale, Softcap, Tanh)
from .sample import TopK

__all__ = ["Add", "AddRow", "Attention", "Copy", "CopyPages", "DeviceMatrix", "ExpertMatmul", "ExpertSum",
           "GatedAct", "GatherRows", "Gelu", "GetRows", "LayerNorm", "Tanh",
           "KvStore", "Launch", "MATRIX_TYPES", "MODE_GELU", "MODE_RESIDUAL", "MODE_SILU", "MODE_STORE", "Matmul",
           "NormAdd", "PosScale", "QkvPost", "ResidualPrologue", "RmsNorm", "Rope", "RopeArgs", "Scale", "Softcap", "SplitScratch", "Tail",
           "RouteExperts", "TopK", "experts_module", "quantized", "xq_bytes"]
