"""Per-op compute time: a roofline with size-dependent efficiencies, calibrated per device type.

    time = launches * overhead + max(flops / (peak(dtype) * eff_f), nbytes / (bandwidth * eff_b))

Conventions (calibration measures with the same ones, so a caller must follow them):
- `flops`: 2*M*N*K for a matmul, 2 * out * C_in * k*k for a conv, 4*b*h*s_q*s_k*d for attention
  (half that when causal); elementwise and softmax ops: `pointwise_flops(target, numel)`.
- `nbytes`: the bytes of every tensor the op reads and writes (inputs + outputs, whole tensors, as a
  graph pass sees them); for an embedding lookup only the rows touched: 2 * output + indices.
- backward: the same curves, called with the backward kernels' FLOPs (2x forward for a matmul or
  conv, 2.5x for flash attention, which recomputes the scores) and bytes (grad outputs, saved
  tensors, grad inputs). `launches` is the number of kernels an estimate stands for (3 for a linear
  layer's backward: two matmuls and the bias-grad sum): each costs the per-kernel overhead, which
  dominates small ops.
- `out_bytes`: freshly allocated output bytes; only CPUs' page faults on large blocks use it.

Each op kind has a `flop` curve and a `bw` curve (see `Profile`):
- `{"eff_max": e, "half": h, "ai_half": a}`: eff = e * s / (s + h) * ai / (ai + a), with `s` the
  op's FLOPs (flop curve) or bytes (bw curve) and `ai` = flops / nbytes; `half_s` instead of `half`
  gives the half-efficiency point as seconds at peak (h = half_s * peak), which carries across
  devices. `ai_half` (default 0: no term) models kernels, like skinny CPU matmuls, that lose
  efficiency at low arithmetic intensity before memory bandwidth is the limit.
- `{"table": [[log10(size), eff], ...]}`: measured efficiencies, interpolated in log size and
  clamped at the ends. CPU calibration writes bandwidth tables, because a CPU's bandwidth is that of
  L2, L3 or DRAM (plus page faults for fresh allocations) depending on the working set.
Kinds without a flop curve (norm, reduction, embedding, gather, other) are modelled bandwidth-bound: their
FLOPs are ignored. Elementwise and softmax ops do have one, for transcendentals (GELU, softmax's
exp) that are compute-bound on CPUs: count their FLOPs with `pointwise_flops`, the per-element
scale calibration uses.

Default efficiencies for devices without a calibration profile (GPU figures, tensor-core peak for
bf16/fp16/tf32, CUDA-core peak for fp32):
- matmul: 75% of peak for large GEMMs (cuBLAS reaches 70-80% of the A100/H100 dense tensor peak on
  large bf16 GEMMs; Megatron-LM's 52% model FLOPs utilisation includes everything else), half of that
  when the GEMM would take 3 us at peak (small GEMMs cannot fill all SMs: wave quantisation).
- attention: 50% (FlashAttention-2 forward reaches 50-70% of A100 peak, backward less), half at 5 us.
- conv: 60% (cuDNN convolutions run 50-70% of tensor peak), half at 5 us.
- elementwise: 80% of HBM bandwidth (STREAM-like kernels reach 80-90%), half at 1 us.
- norm, softmax, reduction: 70% (two passes or a cross-thread reduction); embedding (a gather of
  scattered rows) and other: 50%; gather (index_select / scatter-add of rows at random positions, as in
  message passing; scatter-adds serialise on colliding rows): 30%.
- overhead: 6 us per kernel (eager PyTorch launch + dispatch is 5-10 us; CUDA launch alone ~3-5 us).
With eff = e * s / (s + h), time = overhead + (s + h) / (peak * e): an empty op still costs
h / (peak * e), the kernel's minimum latency (4 us for a GEMM, ~1.3 us for an elementwise kernel).
Edge devices (Jetson, kind "edge") get 85% of these efficiencies and 15 us overhead (slower host
cores issue the launches). CPUs without a profile get efficiencies relative to the measured figures
of `host.cpu_spec()` (which come from a 512^3 matmul and a large copy) and 3 us overhead; run
`calibrate()` for a fitted profile.
"""

from __future__ import annotations

import json
import math
import os
import re
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .gpu_profiles import GPU_FACTS, MEMEFF_SOURCE, gemm_half, has_tf32, kind_peak
from .op_names import ELEMENTWISE_NAMES as _ELEMENTWISE_NAMES
from .op_names import base_name
from .overhead import HOST_PATH_FILE, HostOverhead, default_host, host_overhead

if TYPE_CHECKING:
    from ..catalog import DeviceSpec

OP_KINDS = ("matmul", "attention", "conv", "elementwise", "norm", "softmax", "reduction", "embedding", "gather",
            "view", "other")
COMPUTE_KINDS = ("matmul", "attention", "conv")

# ---- op classification ------------------------------------------------------------------------

_KIND_NAMES: dict[str, set[str]] = {
    "matmul": set("""
        mm addmm bmm baddbmm addbmm matmul linear addmv mv dot vdot einsum outer ger tensordot
        _addmm_activation _int_mm _scaled_mm mkldnn_linear _mkl_linear bilinear _trilinear
        chain_matmul linalg_multi_dot inner kron
    """.split()),
    "attention": set("""
        scaled_dot_product_attention _scaled_dot_product_attention_math
        _scaled_dot_product_flash_attention _scaled_dot_product_efficient_attention
        _scaled_dot_product_cudnn_attention _scaled_dot_product_flash_attention_for_cpu
        _scaled_dot_product_fused_attention_overrideable _flash_attention_forward
        _efficient_attention_forward _native_multi_head_attention multi_head_attention_forward
        flex_attention _fused_sdp_choice
    """.split()),
    "conv": set("""
        convolution _convolution conv1d conv2d conv3d conv_transpose1d conv_transpose2d
        conv_transpose3d convolution_overrideable mkldnn_convolution cudnn_convolution
        cudnn_convolution_transpose _slow_conv2d_forward slow_conv3d slow_conv_dilated2d
        slow_conv_transpose2d _conv_depthwise2d conv_depthwise3d _convolution_mode conv_tbc
        _nnpack_spatial_convolution
    """.split()),
    "norm": set("""
        layer_norm native_layer_norm batch_norm native_batch_norm _native_batch_norm_legit
        _native_batch_norm_legit_no_training _native_batch_norm_legit_functional
        _batch_norm_impl_index _batch_norm_with_update _batch_norm_no_update cudnn_batch_norm
        miopen_batch_norm group_norm native_group_norm instance_norm rms_norm _fused_rms_norm
        local_response_norm batch_norm_backward batch_norm_backward_elemt
        batch_norm_backward_reduce normalize weight_norm _weight_norm_interface fused_rms_norm
    """.split()),
    "softmax": set("""
        softmax _softmax log_softmax _log_softmax _softmax_backward_data
        _log_softmax_backward_data _safe_softmax cross_entropy_loss cross_entropy
        _masked_softmax special_softmax special_log_softmax
    """.split()),
    "reduction": set("""
        sum mean amax amin max min aminmax argmax argmin prod var std var_mean std_mean norm
        linalg_vector_norm linalg_norm frobenius_norm logsumexp cumsum cumprod cummax cummin all
        any nll_loss nll_loss_forward nll_loss2d_forward nll_loss_nd mse_loss l1_loss
        smooth_l1_loss huber_loss binary_cross_entropy binary_cross_entropy_with_logits kl_div
        nansum count_nonzero max_pool1d max_pool2d max_pool3d max_pool2d_with_indices
        max_pool3d_with_indices avg_pool1d avg_pool2d avg_pool3d adaptive_avg_pool1d
        adaptive_avg_pool2d adaptive_avg_pool3d _adaptive_avg_pool2d _adaptive_avg_pool3d
        adaptive_max_pool2d adaptive_max_pool3d mkldnn_max_pool2d topk sort median mode kthvalue
        _fused_adam _fused_adamw _foreach_norm dist cdist _cdist_forward
    """.split()),
    "embedding": set("""
        embedding embedding_bag _embedding_bag _embedding_bag_forward_only
        embedding_dense_backward embedding_backward embedding_sparse_backward
    """.split()),
    # indexed reads and writes of rows at random positions (message passing in GNNs, scatter-adds)
    "gather": set("""
        index_select gather index _index_put_impl index_put index_add index_copy index_fill take
        take_along_dim scatter scatter_add scatter_reduce masked_select masked_scatter nonzero
        _unsafe_index _unsafe_index_put put
    """.split()),
    "view": set("""
        view _unsafe_view reshape _reshape_alias permute expand expand_as slice select t
        transpose unsqueeze squeeze detach alias as_strided narrow split split_with_sizes
        unsafe_split unsafe_split_with_sizes chunk unsafe_chunk unbind flatten unflatten view_as
        movedim moveaxis diagonal swapaxes swapdims numpy_t mt mh adjoint lift_fresh lift real
        imag view_as_real view_as_complex unfold tensor_split hsplit vsplit dsplit getitem
        sym_size sym_stride sym_numel sym_storage_offset size stride numel dim empty empty_like
        empty_strided new_empty new_empty_strided _unsafe_view_copy output placeholder get_attr
        _assert_async _assert_scalar _assert_tensor_metadata sym_constrain_range
        sym_constrain_range_for_size _functional_sym_constrain_range set resize resize_as
        prim_layout _local_scalar_dense item scalar_tensor _make_dep_token record_stream
        requires_grad_ retain_grad _has_compatible_shallow_copy_type is_same_size
        _shape_as_tensor contiguous_view _nested_view_from_buffer squeeze_copy_view
    """.split()),
}
_NAME_TO_KIND = {n: k for k, names in _KIND_NAMES.items() for n in names}

# Elementwise ops' backward kernels (the forward ones: op_names.ELEMENTWISE_NAMES).
_ELEMENTWISE_BACKWARD = set("""
    threshold_backward gelu_backward silu_backward sigmoid_backward tanh_backward hardtanh_backward
    leaky_relu_backward elu_backward softplus_backward mish_backward hardswish_backward
    hardsigmoid_backward glu_backward logsigmoid_backward native_dropout_backward prelu_backward
    _prelu_kernel_backward
""".split())


def classify(target: str) -> str:
    """The kind (one of OP_KINDS) of an aten op name like 'aten.mm.default' or a call target."""
    name = base_name(target)
    kind = _NAME_TO_KIND.get(name)
    if kind:
        return kind
    if name in _ELEMENTWISE_NAMES or name in _ELEMENTWISE_BACKWARD:
        return "elementwise"
    if name.endswith("_backward") or name.endswith("_backward_data") or name.endswith("_backward_input"):
        stem = re.sub(r"_backward(_data|_input|_weight)?$", "", name)
        kind = _NAME_TO_KIND.get(stem) or _NAME_TO_KIND.get(stem.lstrip("_"))
        if kind and kind != "view":
            return kind
        if stem in _ELEMENTWISE_NAMES:
            return "elementwise"
        if "attention" in stem:
            return "attention"
        if "conv" in stem:
            return "conv"
        if "norm" in stem:
            return "norm"
        if "pool" in stem:
            return "reduction"
        return "other"
    if "attention" in name:
        return "attention"
    if name.startswith("_foreach_"):
        return "elementwise"
    if name.startswith(("conv", "_conv", "cudnn_conv", "mkldnn_conv", "slow_conv")):
        return "conv"
    if name.endswith("_copy") and _NAME_TO_KIND.get(name[: -len("_copy")]) == "view":
        return "elementwise"
    return "other"


# FLOPs per element of pointwise ops (elementwise and softmax), relative to one add. Transcendentals
# cost tens of instructions per element (polynomial approximations), which makes them, and softmax's
# exp, compute-bound on CPUs.
POINTWISE_FLOPS_PER_ELEMENT: dict[str, float] = {
    "gelu": 20.0, "gelu_backward": 28.0, "tanh": 16.0, "tanh_backward": 3.0, "erf": 16.0, "erfc": 16.0,
    "exp": 10.0, "exp2": 10.0, "expm1": 12.0, "log": 10.0, "log1p": 12.0, "log2": 10.0, "log10": 10.0,
    "sigmoid": 12.0, "sigmoid_backward": 3.0, "silu": 14.0, "silu_backward": 18.0, "mish": 30.0,
    "mish_backward": 40.0, "softplus": 22.0, "softplus_backward": 14.0, "elu": 12.0, "elu_backward": 12.0,
    "selu": 12.0, "celu": 12.0, "logsigmoid": 22.0, "sin": 16.0, "cos": 16.0, "tan": 20.0, "pow": 12.0,
    "sqrt": 4.0, "rsqrt": 4.0, "div": 2.0, "reciprocal": 2.0, "atan2": 20.0, "hardswish": 4.0,
    "hardsigmoid": 3.0, "lerp": 3.0, "addcmul": 2.0, "addcdiv": 3.0, "native_dropout": 8.0, "bernoulli": 8.0,
    "rand": 8.0, "randn": 16.0, "uniform": 8.0, "normal": 16.0, "rand_like": 8.0, "randn_like": 16.0,
    "softmax": 14.0, "_softmax": 14.0, "log_softmax": 14.0, "_log_softmax": 14.0, "_safe_softmax": 14.0,
    "cross_entropy_loss": 16.0, "_softmax_backward_data": 3.0, "_log_softmax_backward_data": 12.0,
}


def kernel_flops(k: Any) -> float:
    """The FLOPs a recorded kernel (`graph.Kernel`) is priced at: elementwise and softmax kernels recorded
    without FLOPs are charged `pointwise_flops` over their elements (transcendentals cost more than adds)."""
    return pointwise_flops(k.op, k.elems) if k.kind in ("elementwise", "softmax") and not k.flops else k.flops


def pointwise_flops(target: str, numel: int | float) -> float:
    """FLOPs to charge an elementwise or softmax op over `numel` elements (1 per element for add,
    more for transcendentals and softmax's exp): the scale their flop curves are calibrated on."""
    name = base_name(target)
    per = POINTWISE_FLOPS_PER_ELEMENT.get(name)
    if per is None:
        per = POINTWISE_FLOPS_PER_ELEMENT.get(name.lstrip("_"), 1.0)
    return float(numel) * per


# ---- profiles ---------------------------------------------------------------------------------


@dataclass
class Profile:
    """Efficiency curves of one device type, fitted by `calibrate()` (or hand-written).

    curves: kind -> {"flop": curve | None, "bw": curve, "overhead_s": optional per-kind overhead}; curve
    formats are in the module docstring. Efficiencies are relative to `peak_flops` / `memory_bandwidth`
    when set (CPU profiles: the measured figures), else to the device spec's datasheet figures.
    meta: how the profile was made (dtype, threads, torch version, date, fit errors).
    """

    device: str
    curves: dict[str, dict] = field(default_factory=dict)
    overhead_s: float = 6e-6
    peak_flops: float | None = None
    memory_bandwidth: float | None = None
    meta: dict = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @staticmethod
    def from_json(s: str) -> Profile:
        d = json.loads(s)
        return Profile(device=str(d["device"]), curves=dict(d.get("curves") or {}),
                       overhead_s=float(d.get("overhead_s", 6e-6)),
                       peak_flops=_opt_float(d.get("peak_flops")),
                       memory_bandwidth=_opt_float(d.get("memory_bandwidth")), meta=dict(d.get("meta") or {}))

    def save(self, path: str | os.PathLike) -> Path:
        return write_atomic(path, self.to_json())

    @staticmethod
    def load(path: str | os.PathLike) -> Profile:
        return Profile.from_json(Path(path).read_text())


def _opt_float(x: Any) -> float | None:
    return None if x is None else float(x)


def write_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write `text` to `path` (its folder made) through a process-own temporary file and a rename: ranks
    starting together, or a concurrent reader, never see half a file."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f"{p.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    tmp.replace(p)
    return p


def profile_dir() -> Path:
    """Where profiles live: $AUTOPAR_PROFILE_DIR, else ~/.cache/autopar/profiles."""
    env = os.environ.get("AUTOPAR_PROFILE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "autopar" / "profiles"


def profile_path(device_name: str) -> Path:
    safe = re.sub(r"[^A-Za-z0-9_.+-]+", "_", device_name).strip("._") or "device"
    return profile_dir() / f"{safe}.json"


def check_profiles(profiles: Any, cluster: Any) -> dict[str, Profile]:
    """`profiles` (device type name -> Profile, or None) as a dict, checked against `cluster`'s device types:
    PlanError naming what is wrong (not a mapping, not a Profile, a type the cluster does not have)."""
    from ..errors import PlanError

    if profiles is None:
        return {}
    if not isinstance(profiles, dict):
        raise PlanError(f"profiles= must map device type names to autopar.cost_models.compute.Profile objects "
                        f"(as `autopar calibrate` writes them; Profile.load(path) reads one), got "
                        f"{type(profiles).__name__}.")
    types = cluster.device_types()
    for name, prof in profiles.items():
        if name not in types:
            raise PlanError(f"profiles= has a profile for {name!r}, which is not a device type of cluster "
                            f"{cluster.name!r} (its types: {', '.join(types)}).")
        if not isinstance(prof, Profile):
            raise PlanError(f"profiles[{name!r}] is a {type(prof).__name__}, not a Profile (Profile.load(path) "
                            f"reads a saved one).")
    return dict(profiles)


def load_profile(device_name: str) -> Profile | None:
    """The saved profile of a device type, or None when there is none (or it cannot be read)."""
    path = profile_path(device_name)
    if not path.is_file():
        return None
    try:
        return Profile.load(path)
    except (OSError, ValueError, KeyError, TypeError) as e:
        warnings.warn(f"ignoring unreadable compute profile {str(path)!r}: {e}; re-run calibration",
                      stacklevel=2)
        return None


def host_path_path() -> Path:
    """Where `autopar calibrate --host` keeps this host's measured host path (beside the profiles)."""
    return profile_dir() / HOST_PATH_FILE


def load_host_path() -> dict | None:
    """The saved host path (`calibrate.calibrate_host`), or None when there is none or it cannot be read."""
    path = host_path_path()
    if not path.is_file():
        return None
    try:
        d = json.loads(path.read_text())
        if isinstance(d, dict) and isinstance(d.get("framework"), dict):
            return d
        raise ValueError("no 'framework' figures")
    except (OSError, ValueError) as e:
        warnings.warn(f"ignoring unreadable host path {str(path)!r}: {e}; re-run `autopar calibrate --host`",
                      stacklevel=2)
        return None


# Each memory-bound kind's share of a STREAM-like kernel's achieved bandwidth (GPU defaults above: norm,
# softmax and reduction make two passes or reduce across threads; embedding gathers scattered rows; gather
# and scatter-add collide on rows). default_profile multiplies them with each device's STREAM fraction.
KIND_BW_SHARE: dict[str, float] = {"elementwise": 1.0, "norm": 0.875, "softmax": 0.875, "reduction": 0.875,
                                   "embedding": 0.625, "gather": 0.375, "other": 0.625}


def default_curves(kind: str = "gpu") -> tuple[dict[str, dict], float]:
    """(curves, overhead_s) for a device kind without a profile; reasoning in the module docstring."""
    if kind == "cpu":
        # Relative to cpu_spec()'s 512^3 matmul and large copy; small ops lose to threading startup.
        flop = {"matmul": (1.0, 2e-6), "attention": (0.5, 5e-6), "conv": (0.5, 5e-6)}
        bw = {"elementwise": 0.9, "norm": 0.6, "softmax": 0.5, "reduction": 0.7, "embedding": 0.3,
              "gather": 0.2, "other": 0.5}
        scale, overhead, bw_half_s = 1.0, 3e-6, 1e-6
    else:
        flop = {"matmul": (0.75, 3e-6), "attention": (0.5, 5e-6), "conv": (0.6, 5e-6)}
        bw = {k: 0.8 * share for k, share in KIND_BW_SHARE.items()}
        scale, overhead, bw_half_s = (0.85, 15e-6, 1e-6) if kind == "edge" else (1.0, 6e-6, 1e-6)
    curves: dict[str, dict] = {}
    for k in OP_KINDS:
        if k == "view":
            continue
        f = flop.get(k)
        curves[k] = {
            "flop": {"eff_max": f[0] * scale, "half_s": f[1]} if f else None,
            "bw": {"eff_max": bw.get(k, bw["elementwise"]) * scale, "half_s": bw_half_s},
        }
    # Transcendentals (pointwise_flops scale): vector units run them well below matmul peak.
    for k in ("elementwise", "softmax"):
        curves[k]["flop"] = {"eff_max": 0.5 * scale}
    return curves, overhead


# ---- the model --------------------------------------------------------------------------------


def _curve_eff(curve: dict | None, size: float, ai: float, ref: float) -> float:
    """Efficiency of one curve at `size` (FLOPs or bytes) and arithmetic intensity `ai`."""
    if not curve:
        return 0.0
    table = curve.get("table")
    if table:
        xs = [p[0] for p in table]
        ys = [p[1] for p in table]
        eff = _interp(math.log10(max(size, 1.0)), xs, ys)
    else:
        eff = float(curve.get("eff_max", 1.0))
        half = curve.get("half")
        if half is None:
            half = float(curve.get("half_s", 0.0)) * ref
        if half > 0:
            eff *= size / (size + half)
    a = float(curve.get("ai_half", 0.0) or 0.0)
    if a > 0 and math.isfinite(ai):
        eff *= ai / (ai + a)
    return max(eff, 1e-6)


def _interp(x: float, xs: list[float], ys: list[float]) -> float:
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    lo, hi = 0, len(xs) - 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if xs[mid] <= x:
            lo = mid
        else:
            hi = mid
    w = (x - xs[lo]) / (xs[hi] - xs[lo])
    return ys[lo] * (1 - w) + ys[hi] * w


class ComputeModel:
    """Predicts one op's run time on one device type from its kind, FLOPs and bytes moved."""

    def __init__(self, spec: DeviceSpec, profile: Profile | None = None, dtype: str = "fp32",
                 host_path: dict | None = None) -> None:
        """`host_path`: this host's measured host path (`load_host_path`, read from the profile directory for a
        GPU when not given), whose figures a GPU without its own prices its host time from (overhead.py)."""
        self.spec = spec
        self.dtype = dtype
        self.host_path = host_path if host_path is not None or spec.kind != "gpu" else load_host_path()
        if profile is None:
            profile = load_profile(spec.name)
        self.calibrated = profile is not None
        if profile is None:
            profile = default_profile(spec)  # catalog GPUs: kernel-level defaults (gpu_profiles.py)
        if profile is None:
            curves, overhead = default_curves(spec.kind)
            profile = Profile(device=spec.name, curves=curves, overhead_s=overhead,
                              meta={"source": f"defaults for kind {spec.kind!r}",
                                    "framework": default_host(spec.kind).to_meta()})
        self.profile = profile
        defaults, _ = default_curves(spec.kind)
        self._curves = {k: {**defaults.get(k, {}), **profile.curves.get(k, {})} for k in defaults}
        for c in self._curves.values():  # a curve measured for this precision replaces the generic one
            by_dtype = c.get("flop_by_dtype") or {}
            if dtype in by_dtype:
                c["flop"] = by_dtype[dtype]
        prof_dtype = profile.meta.get("dtype", "fp32")
        # Profile efficiencies are relative to the figures it was measured against; for another dtype
        # (say bf16 on tensor cores with an fp32 profile), assume they carry over to that dtype's peak.
        if profile.peak_flops and dtype == prof_dtype:
            self.peak = float(profile.peak_flops)
        elif profile.peak_flops and spec.kind == "cpu":
            self.peak = float(profile.peak_flops) * spec.flops(dtype) / spec.flops(prof_dtype)
        else:
            self.peak = spec.flops(dtype)
        # Per kind, the peak the op runs against under this precision (gpu_profiles.kind_peak: TF32 or
        # CUDA cores, fp32 pointwise math); profiles measured against their own peak use that one.
        self.peaks = {k: self.peak if profile.peak_flops or spec.kind == "cpu" else kind_peak(spec, k, dtype)
                      for k in OP_KINDS}
        self.bandwidth = float(profile.memory_bandwidth or spec.memory_bandwidth)
        self.overhead = float(profile.overhead_s)
        fault = profile.meta.get("page_fault") or {}
        self.fault_threshold = float(fault.get("threshold", math.inf))
        self.fault_bandwidth = float(fault.get("bandwidth", math.inf))
        self._host: HostOverhead | None = None

    def _curve(self, kind: str) -> dict:
        return self._curves.get(kind) or self._curves["other"]

    def _peak(self, kind: str) -> float:
        return self.peaks.get(kind) or self.peaks["other"]

    @property
    def host(self) -> HostOverhead:
        """Host/framework figures of this device's software stack (overhead.py): per kernel (= overhead),
        view, module call, autograd node, micro-batch and optimizer step."""
        if self._host is None:
            self._host = host_overhead(self)
        return self._host

    def efficiency(self, kind: str, flops: float, nbytes: float) -> tuple[float, float]:
        """(fraction of peak FLOP/s, fraction of memory bandwidth) an op of this size runs at."""
        if kind == "view":
            return 1.0, 1.0
        c = self._curve(kind)
        ai = flops / nbytes if nbytes > 0 else math.inf
        return (_curve_eff(c.get("flop"), flops, ai, self._peak(kind)),
                _curve_eff(c.get("bw"), nbytes, ai, self.bandwidth))

    def op_time(self, kind: str, flops: float, nbytes: float, launches: int = 1,
                out_bytes: float = 0.0) -> float:
        """Seconds one op (or `launches` equal kernels sharing these totals) takes. `out_bytes`, the
        op's freshly allocated outputs, adds page faults for compute kinds on CPUs: blocks over the
        profile's threshold (glibc: 32 MiB) come from mmap, faulted in anew each step. Bandwidth
        kinds' calibrated tables already include them."""
        if kind == "view":
            return 0.0
        flops, nbytes = max(float(flops), 0.0), max(float(nbytes), 0.0)
        n = max(int(launches), 1)
        c = self._curve(kind)
        eff_f, eff_b = self.efficiency(kind, flops / n, nbytes / n)
        t_f = flops / (self._peak(kind) * eff_f) if flops > 0 and c.get("flop") else 0.0
        t_b = nbytes / (self.bandwidth * eff_b) if nbytes > 0 else 0.0
        t = n * float(c.get("overhead_s", self.overhead)) + max(t_f, t_b)
        if out_bytes / n >= self.fault_threshold and kind in COMPUTE_KINDS:
            t += out_bytes / self.fault_bandwidth
        return t

    def describe(self) -> str:
        src = "calibrated" if self.calibrated else self.profile.meta.get("source", "defaults")
        return (f"{self.spec.name} ({src}): peak {self.peak / 1e12:.3g} TFLOP/s {self.dtype}, "
                f"bandwidth {self.bandwidth / 1e9:.3g} GB/s, overhead {self.overhead * 1e6:.3g} us")


def default_profile(spec: DeviceSpec) -> Profile | None:
    """The kernel-level default profile of a catalog GPU (None for other devices): per-precision GEMM
    and attention curves (`flop_by_dtype`), STREAM-like bandwidth, each figure with its source, plus the
    host-overhead figures of eager PyTorch on CUDA (overhead.py)."""
    facts = GPU_FACTS.get(spec.name)
    if facts is None or spec.kind != "gpu":
        return None
    clock, clock_src = facts.get("clock", (1.0, "full boost clock"))
    curves, _ = default_curves("gpu")
    stream, stream_src = facts["stream"]
    for kind, c in curves.items():
        c["bw"] = {**c["bw"], "eff_max": stream * KIND_BW_SHARE.get(kind, 1.0),
                   "source": f"{stream_src}; times the kind's share (compute.KIND_BW_SHARE)"}
    half = gemm_half(facts["sms"])
    g16, g16_src = facts["g16"]
    fp32, fp32_src = facts["fp32"]
    tf32, tf32_src = facts.get("tf32", facts["fp32"]) if has_tf32(spec) else facts["fp32"]
    gemm = {p: {"eff_max": e * clock, "half": half, "source": f"{src}; clock {clock:g} ({clock_src}); half: "
                                                                 f"one wave of tiles on {facts['sms']} SMs"}
            for p, (e, src) in {"bf16": (g16, g16_src), "fp16": (g16, g16_src), "tf32": (tf32, tf32_src),
                                "fp32": (fp32, fp32_src)}.items()}
    curves["matmul"]["flop_by_dtype"] = gemm
    a16, a16_src = facts["attn16"]
    a32 = (0.45, MEMEFF_SOURCE + "; 3xTF32 on sm80+") if has_tf32(spec) else (0.4, MEMEFF_SOURCE + "; SIMT fp32")
    curves["attention"]["flop_by_dtype"] = {
        p: {"eff_max": e * clock, "half_s": 5e-6, "source": f"{src}; clock {clock:g}"}
        for p, (e, src) in {"bf16": (a16, a16_src), "fp16": (a16, a16_src), "tf32": a32, "fp32": a32}.items()}
    host = default_host("gpu")
    return Profile(device=spec.name, curves=curves, overhead_s=host.kernel_s, meta={
        "source": f"kernel-level defaults for {spec.name} (cost_models/gpu_profiles.py)",
        "framework": host.to_meta(), "dtype": "per-dtype"})


__all__ = ["OP_KINDS", "ComputeModel", "Profile", "base_name", "check_profiles", "classify", "default_curves",
           "default_profile", "load_profile", "pointwise_flops", "profile_dir", "profile_path"]
