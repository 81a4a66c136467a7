"""Opt-in conversions of a model for speed: C++ kernels, quantized weights, the fused decode
step, and training's fused passes. The model's own layers (glassformer.model) never import
this package; each conversion is applied explicitly and the C++ build happens there:

- `quantize_model(model, fmt)` (quantize.py, applied by `glassformer.load(quantize=...)`):
  every linear layer a QuantizedLinear in a `WeightFormat`, and the model given its fused
  decode step (fast_decode.py), which it owns: `model.fused_step()`.
- `use_fast_training(model)` (fast_training.py, applied by the training loop): fused RMSNorm,
  RoPE and SwiGLU passes (fused.py) and oneDNN products (onednn.py).

Fast matrix-vector products for decoding, with weights in fp32, bf16, int8 or int4.

Decoding one token reads every weight once, so its speed is set by how fast weights stream
from memory. The C++ kernels here (AVX2 + FMA + OpenMP, AVX-512 VNNI where present;
`csrc/matvec.cpp`, `csrc/quantized.cpp`) read them at the memory bandwidth; the same products
written in PyTorch remain the reference and the fallback (no compiler, non-x86 CPU, CUDA
tensors, or `GLASSFORMER_KERNELS=torch`).
The extension is compiled on first use (a one-line notice on stderr) and cached under
`<home>/kernels` (glassformer/home.py: `$GLASSFORMER_HOME`, else `$XDG_CACHE_HOME/glassformer`,
else `~/.cache/glassformer`).

Use in a model::

    from glassformer.accel import QuantizedLinear, WeightFormat
    layer = QuantizedLinear.from_linear(linear, WeightFormat.INT8)  # or "fp32", "bf16", "int4"
    y = layer(x)                                           # x (..., in_features) -> (..., out)

- int8/int4 layers quantize the activations per block of 32 to int8 (like llama.cpp) and
  run the C++ kernels on any number of rows, so their outputs differ from
  `x @ layer.dequantized_weight().T` by that rounding (bounded in tests/accel/test_kernels.py)
  and each row's result is the same whatever shares the call. fp32/bf16 layers send up to
  `kernels.ROW_TILE` (8) rows to the C++ kernels in one call (about 2 µs of Python) and more
  rows (prefill) to `torch.matmul` on the float32 weight, or, made with `row_invariant()`,
  every row to the kernels (the serving engine). The fp32 kernel sums in a different order
  than `F.linear`: equal up to float rounding, not bit for bit.
- Inputs that require a gradient take the dense PyTorch product (rounding has no gradient);
  the weights never get one. Move a layer with `.to(device)`, never `.to(dtype)`: its
  buffers' dtypes are the format.
- `QuantizedLinear.from_gguf(...)` builds int8/int4 layers from GGUF Q8_0/Q4_0/Q4_1 blocks
  without requantizing (see gguf_blocks.py); `from_weight(w, mode, bias)` from a tensor.
- `kernels.py` is the one caller of the compiled extension (a typed function per C++ entry
  point); `capabilities.py` the table type each fast path declares what it computes with.
- `fused.py` holds training's fused RMSNorm, RoPE and SwiGLU passes (`train_ops.cpp`);
  `onednn.py` routes training's float32 products through oneDNN on CPUs whose AVX-512 MKL
  leaves unused (AMD Zen 4/5), about twice MKL's speed there.
- The functional kernels (`ops.linear_fp32/bf16/int8/int4`) take (M, K) float32 x and a
  `backend` of "auto", "cpp" or "torch"; the weight formats are described in
  weight_formats.py.
"""

from .fast_training import use_fast_training
from .quantize import quantize_model
from .quantized_linear import QuantizedLinear
from .weight_formats import (
    WeightFormat,
    dequantize_int4,
    dequantize_int8,
    quantize_activations,
    quantize_int4,
    quantize_int8,
)

__all__ = [
    "QuantizedLinear",
    "WeightFormat",
    "dequantize_int4",
    "dequantize_int8",
    "quantize_activations",
    "quantize_int4",
    "quantize_int8",
    "quantize_model",
    "use_fast_training",
]
