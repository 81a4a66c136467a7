"""QuantizedLinear: an inference-only nn.Linear whose weight is stored in one of four formats."""

from __future__ import annotations

import torch
from torch import nn

from ..errors import InputError
from . import kernels, kquants, ops
from . import weight_formats as quant
from .gguf_blocks import from_gguf_blocks
from .tile_order import BLOCK_TENSORS, TileOrdered, in_order, to_tile_order
from .weight_formats import GGUF_FORMATS, WeightFormat

# the block tensors of each block format, as a layer (and an embedding sharing them) holds them
BLOCK_NAMES = {WeightFormat.INT8: ("qweight", "scales"), WeightFormat.INT4: ("qweight", "scales", "mins"),
               **{fmt: ("qweight",) for fmt in GGUF_FORMATS}}


class QuantizedLinear(TileOrdered):
    """y = x @ W^T (+ bias) with W held as fp32, bf16, int8 or int4 blocks (weight_formats.py).

    `mode` is a WeightFormat (its name is accepted too). Building a layer builds the C++
    kernels (once per process, with a notice), so that no forward ever starts a compile.
    Buffers by mode (all saved in the state dict): fp32 `weight` (N, K) float32; bf16
    `weight` (N, K) bfloat16; int8 `qweight` (N, nb·32) int8 + `scales` (N, nb) fp16;
    int4 `qweight` (N, nb·16) uint8 + `scales`, `mins` (N, nb) fp16; GGUF's K-quant and Q5_x
    blocks (GGUF_FORMATS, only from a file: `from_gguf`) `qweight` (N, row bytes) uint8, the
    file's bytes (kquants.py); and `bias` (N,) float32 or None. Where the C++ kernels run (they
    read tile order), an int8 / int4 layer holds its block tensors in it (`tiled`,
    tile_order.py) instead of block order, and gives block order to its state dict, `blocks()`
    and everything that reads the blocks themselves. No gradients flow to the weight. A block
    layer (int8, int4, GGUF's) gives each row the same bits whatever shares its call; a float
    layer does up to ROW_TILE rows (ops.py), or at any number of rows with `invariant` (the C++
    kernels then take prefills too, which torch.matmul computes faster but in an order that
    depends on the number of rows).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        mode: WeightFormat | str,
        tensors: dict[str, torch.Tensor],
        bias: torch.Tensor | None = None,
        backend: str = "auto",
        invariant: bool = False,
    ) -> None:
        super().__init__()
        mode = WeightFormat.parse(mode)
        if backend not in ops.BACKENDS:
            raise InputError(None, f"backend must be one of {ops.BACKENDS}, got {backend!r}")
        self.in_features, self.out_features, self.mode, self.backend = (
            in_features, out_features, mode, backend
        )
        self.invariant = invariant
        expected = _shapes(mode, out_features, in_features)
        if set(tensors) != set(expected):
            raise InputError(None, f"mode {mode} needs tensors {sorted(expected)}, got {sorted(tensors)}")
        for name, (shape, dtype) in expected.items():
            t = tensors[name]
            if tuple(t.shape) != shape or t.dtype != dtype:
                raise InputError(None,
                    f"{name} must be {dtype} of shape {shape}, got {t.dtype} {tuple(t.shape)}"
                )
            self.register_buffer(name, t.contiguous())
        self.tiled = (mode in (WeightFormat.INT8, WeightFormat.INT4) and backend != "torch"
                      and kernels.available())
        if self.tiled:  # the block-order tensors are replaced, not kept beside
            for name in BLOCK_NAMES[mode]:
                setattr(self, name, to_tile_order(getattr(self, name), BLOCK_TENSORS[name]))
        if bias is not None and tuple(bias.shape) != (out_features,):
            raise InputError(None, f"bias must have shape ({out_features},), got {tuple(bias.shape)}")
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())
        self._fast: tuple | None = None  # (C++ entry point, its arguments), found on first use
        if backend != "torch":
            kernels.available()  # the build, if one is due, happens here rather than in a forward

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, mode: WeightFormat | str, backend: str = "auto"
    ) -> QuantizedLinear:
        """Quantizes an nn.Linear's weight once (the bias stays float32)."""
        return cls.from_weight(linear.weight, mode, linear.bias, backend)

    @classmethod
    def from_weight(
        cls,
        weight: torch.Tensor,
        mode: WeightFormat | str,
        bias: torch.Tensor | None = None,
        backend: str = "auto",
    ) -> QuantizedLinear:
        """From a float (out_features, in_features) weight."""
        w, mode = weight.detach(), WeightFormat.parse(mode)
        if mode in GGUF_FORMATS:
            raise InputError("mode", f"{mode} blocks are kept from GGUF files only (from_gguf)")
        if mode == WeightFormat.FP32:
            tensors = {"weight": w.float()}
        elif mode == WeightFormat.BF16:
            tensors = {"weight": w.to(torch.bfloat16)}
        elif mode == WeightFormat.INT8:
            tensors = dict(zip(("qweight", "scales"), _by_rows(quant.quantize_int8, w), strict=True))
        else:
            tensors = dict(zip(("qweight", "scales", "mins"), _by_rows(quant.quantize_int4, w), strict=True))
        return cls(w.shape[1], w.shape[0], mode, tensors, bias, backend)

    @classmethod
    def from_gguf(
        cls,
        data,
        qtype,
        shape: tuple[int, int],
        bias: torch.Tensor | None = None,
        backend: str = "auto",
    ) -> QuantizedLinear:
        """From the raw GGUF blocks (gguf_blocks.KEPT_TYPES) of an (out, in) = `shape` matrix."""
        mode, tensors = from_gguf_blocks(data, qtype, shape)
        return cls(shape[1], shape[0], mode, tensors, bias, backend)

    def row_invariant(self) -> QuantizedLinear:
        """This layer computing each row alike at any number of rows: itself where it already
        does (the block formats), else a float layer sharing its tensors with `invariant` set."""
        if self.invariant or self.mode in BLOCK_NAMES:
            return self
        tensors = {name: buffer for name, buffer in self.named_buffers() if name != "bias"}
        return QuantizedLinear(self.in_features, self.out_features, self.mode, tensors, self.bias,
                               self.backend, invariant=True)

    def dequantized_weight(self) -> torch.Tensor:
        """The (out_features, in_features) float32 weight this layer multiplies by."""
        if self.mode in (WeightFormat.FP32, WeightFormat.BF16):
            return self.weight.float()
        if self.mode == WeightFormat.INT8:
            return quant.dequantize_int8(*self.blocks(), self.in_features)
        if self.mode in GGUF_FORMATS:
            return ops.dequantize_gguf(self.qweight, self.mode, self.in_features, self.backend)
        return quant.dequantize_int4(*self.blocks(), self.in_features)

    def blocks(self) -> tuple[torch.Tensor, ...]:
        """An int8 (qweight, scales), int4 (qweight, scales, mins) or GGUF-block (qweight,)
        layer's tensors in block order (weight_formats.py), whatever order they are held in."""
        held = {name: getattr(self, name) for name in BLOCK_NAMES[self.mode]}
        return tuple(in_order(False, self.tiled, **held))

    def kernel_weights(self) -> kernels.LinearWeights:
        """This layer's format, tensors and bias as the fused decode step reads them (int8 /
        int4: in the order the kernels read)."""
        names = BLOCK_NAMES.get(self.mode, ("weight",))
        return kernels.LinearWeights(self.mode, [getattr(self, name) for name in names], self.bias)

    def _fast_path(self) -> tuple:
        """The kernels' try_* entry point and its arguments, or () where there is none."""
        if self.backend == "torch" or not kernels.available() or self.mode in GGUF_FORMATS:
            return ()  # GGUF's blocks: ops.linear_gguf, the kernels at any number of rows
        if self.mode in (WeightFormat.FP32, WeightFormat.BF16):
            kernel = kernels.try_f32 if self.mode == WeightFormat.FP32 else kernels.try_bf16
            return kernel, (self.weight, self.bias)
        if self.mode == WeightFormat.INT8:
            return kernels.try_q8, (self.qweight, self.scales, self.bias, self.in_features)
        return kernels.try_q4, (self.qweight, self.scales, self.mins, self.bias, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fast = self._fast
        if fast is None:
            fast = self._fast = self._fast_path()
        if fast:  # one C++ call for a few float32 rows on the CPU (decode)
            y = fast[0](x, *fast[1])
            if y is not None:
                return y
        if x.shape[-1] != self.in_features:
            raise InputError(None, f"expected {self.in_features} input features, got {x.shape[-1]}")
        x2 = x.reshape(-1, self.in_features).float().contiguous()  # (M, K)
        mode, backend = self.mode, self.backend
        if mode == WeightFormat.FP32:
            y = ops.linear_fp32(x2, self.weight, self.bias, backend, self.invariant)
        elif mode == WeightFormat.BF16:
            y = ops.linear_bf16(x2, self.weight, self.bias, backend, self.invariant)
        elif mode == WeightFormat.INT8:
            y = ops.linear_int8(x2, self.qweight, self.scales, self.bias, backend, self.tiled)
        elif mode in GGUF_FORMATS:
            y = ops.linear_gguf(x2, self.qweight, mode, self.bias, backend)
        else:
            y = ops.linear_int4(x2, self.qweight, self.scales, self.mins, self.bias, backend,
                                self.tiled)
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)  # (..., N)

    def _apply(self, fn, recurse=True):
        self._fast = None  # the buffers may be replaced (.to(), .cuda())
        return super()._apply(fn, recurse)

    def _load_from_state_dict(self, *args, **kwargs):
        self._fast = None
        super()._load_from_state_dict(*args, **kwargs)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, mode={self.mode}"


def _by_rows(quantize, w: torch.Tensor, rows: int = 4096) -> tuple[torch.Tensor, ...]:
    """`quantize(w)` a block of rows at a time (each row's blocks are its own), so that its
    float temporaries stay a few MB for a (49152, 576) head instead of several times its size."""
    parts = [quantize(w[start:start + rows]) for start in range(0, w.shape[0], rows)]
    return tuple(torch.cat(column) for column in zip(*parts, strict=True))


def _shapes(mode: WeightFormat, n: int, k: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    nb = quant.n_blocks(k)
    if mode == WeightFormat.FP32:
        return {"weight": ((n, k), torch.float32)}
    if mode == WeightFormat.BF16:
        return {"weight": ((n, k), torch.bfloat16)}
    if mode == WeightFormat.INT8:
        return {"qweight": ((n, nb * quant.BLOCK), torch.int8), "scales": ((n, nb), torch.float16)}
    if mode in GGUF_FORMATS:
        try:
            return {"qweight": ((n, kquants.row_bytes(mode, k)), torch.uint8)}
        except ValueError as error:
            raise InputError(None, str(error)) from None
    return {
        "qweight": ((n, nb * quant.BLOCK // 2), torch.uint8),
        "scales": ((n, nb), torch.float16),
        "mins": ((n, nb), torch.float16),
    }
