"""Op names as the cost models read them: any spelling of an op (an aten overload, a torch function, an
operator dunder, an in-place variant) to its base name, and the elementwise ops among them. Below
compute.py (kernel kinds) and overhead.py (host work per op), which both classify by it."""

from __future__ import annotations

import re

# Ops that touch every element once; anything with these prefixes too. Copies (clone, contiguous,
# _to_copy, cat) move bytes like an elementwise op.
ELEMENTWISE_NAMES = set("""
    add sub rsub mul div true_divide floor_divide remainder fmod neg abs sign relu relu6 gelu silu
    sigmoid tanh exp exp2 expm1 log log1p log2 log10 pow sqrt rsqrt reciprocal square sin cos tan
    erf erfc erfinv clamp clamp_min clamp_max clip where masked_fill dropout native_dropout
    feature_dropout alpha_dropout copy clone _to_copy to contiguous fill zero zeros ones full
    zeros_like ones_like full_like rand randn rand_like randn_like randint bernoulli uniform normal
    arange linspace tril triu threshold hardtanh leaky_relu elu selu celu mish softplus softsign
    hardswish hardsigmoid logsigmoid glu prelu _prelu_kernel addcmul addcdiv lerp maximum minimum
    fmax fmin eq ne lt le gt ge logical_and logical_or logical_not logical_xor bitwise_and
    bitwise_or bitwise_not bitwise_xor isnan isinf isfinite nan_to_num cat concat concatenate stack
    hstack vstack constant_pad_nd pad reflection_pad1d reflection_pad2d replication_pad1d
    replication_pad2d upsample_nearest1d upsample_nearest2d upsample_bilinear2d upsample_bicubic2d
    repeat repeat_interleave roll flip tile floor ceil round trunc frac lift_fresh_copy type_as bool
    float half bfloat16 _foreach_add _foreach_mul _foreach_div _foreach_addcmul _foreach_addcdiv
    _foreach_sqrt _foreach_lerp view_copy permute_copy transpose_copy expand_copy slice_copy
    select_copy t_copy unsqueeze_copy squeeze_copy alias_copy detach_copy as_strided_copy split_copy
    slice_scatter select_scatter diagonal_scatter as_strided_scatter masked_fill_ polar heaviside
    hypot atan2 xlogy sgn angle logit sinh cosh asin acos atan asinh acosh atanh digamma lgamma
    fill_diagonal new_zeros new_ones new_full scalar_tensor_copy _fused_dropout _masked_scale
    native_dropout_backward rrelu
""".split())

_STRIP = re.compile(r"^(?:torch\.ops\.)?(?:aten(?:::|\.))?")


def base_name(target: str) -> str:
    """'aten.addmm.default' / 'aten::addmm' / 'torch.ops.aten.add_.Tensor' -> 'addmm' / 'add';
    other dotted names ('torch.nn.functional.gelu', '<built-in function add>') -> the last part."""
    raw = str(target).strip()
    s = _STRIP.sub("", raw)
    aten = s != raw
    if s.startswith("<built-in function ") or s.startswith("<function "):
        s = s.split(" ", 2)[-1].rstrip(">")
        s = s.split(" at ")[0]
    if "." in s:
        s = s.split(".")[0] if aten else s.rsplit(".", 1)[-1]
    s = s.lower()
    if s.startswith("__") and s.endswith("__"):  # operator dunders: __add__, __getitem__
        s = s.strip("_")
        s = {"truediv": "div", "floordiv": "floor_divide", "matmul": "matmul"}.get(s, s)
        s = s[1:] if s.startswith("i") and s[1:] in ELEMENTWISE_NAMES else s  # __iadd__
    if s.endswith("_") and not s.endswith("__") and s[:-1]:
        s = s[:-1]  # in-place variant: add_ -> add
    return s


__all__ = ["ELEMENTWISE_NAMES", "base_name"]
