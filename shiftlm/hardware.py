"""Hardware catalog: what one accelerator and its links can do, from vendor datasheets.

All rates are dense (no 2:4 sparsity) peak numbers per GPU. Link bandwidths are per GPU and per
direction, which is what a ring collective's bus bandwidth is bounded by. "this" is not in the
catalog: `shiftlm calibrate` measures this machine and writes a profile that `load_profile` reads.

Sources (datasheet values; where a datasheet gives a range the SXM/OAM variant is used):
- A100: NVIDIA A100 Tensor Core GPU datasheet (2021): 312 TFLOP/s fp16/bf16, 156 tf32, 19.5 fp32;
  40 GB HBM2 at 1,555 GB/s, 80 GB HBM2e at 2,039 GB/s; NVLink 3 600 GB/s bidirectional.
  DGX A100: 8 GPUs/node, 8x 200 Gb/s HDR InfiniBand (25 GB/s per GPU).
- H100 SXM / PCIe: NVIDIA H100 datasheet (2023): SXM 989 TFLOP/s bf16, 1,979 fp8, 67 fp32, 80 GB
  HBM3 at 3.35 TB/s, NVLink 4 900 GB/s; PCIe 756 bf16, 1,513 fp8, 51 fp32, 80 GB HBM2e at 2.0 TB/s,
  PCIe Gen5 128 GB/s bidirectional. DGX H100: 8x 400 Gb/s NDR (50 GB/s per GPU).
- H200: NVIDIA H200 datasheet (2024): H100 SXM compute, 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s.
- B200: NVIDIA DGX B200 datasheet (2024): 72 PFLOP/s fp8 training per 8 GPUs with sparsity, i.e.
  4.5 PFLOP/s dense fp8 and 2.25 bf16 per GPU; 1,440 GB HBM3e per 8 GPUs at 8 TB/s each;
  NVLink 5 1.8 TB/s; 8x 400 Gb/s ConnectX-7.
- MI250X: AMD Instinct MI250X datasheet: 383 TFLOP/s fp16/bf16, 47.9 fp32 vector, 128 GB HBM2e at
  3.2 TB/s, up to 8 Infinity Fabric links (800 GB/s peak aggregate); 4 per node as in Frontier with
  4x 200 Gb/s Slingshot (25 GB/s per module).
- MI300X: AMD Instinct MI300X datasheet: 1,307 TFLOP/s bf16, 2,615 fp8, 163 fp32, 192 GB HBM3 at
  5.3 TB/s, 7 Infinity Fabric links (896 GB/s aggregate bidirectional), 8 per platform.

`matmul_fraction` (per dtype): the Maximum Achievable Matmul FLOPS (MAMF, the fastest shape of a
brute-force `torch.matmul` search, mean of 100 iterations) over the datasheet peak, measured by
S. Bekman et al., "Machine Learning Engineering", compute/accelerator/README.md, MAMF comparison
table (github.com/stas00/ml-engineering, CC BY-SA 4.0): bf16 A100 SXM 271.2/312 = 0.869, H100 SXM
794.5/989 = 0.803 ("H200 is the same"), B200 1,745/2,250 = 0.776, MI250X 147.0/191.5 per GCD = 0.767,
MI300X 668.4/1,300 = 0.514; fp8 H100 1,402.6/1,979 = 0.709, H200 1,453.4/1,979 = 0.734, B200
3,432.5/4,500 = 0.763. Newer generations reach a smaller share of a larger peak (clocks drop under
full tensor-core load). The simulator's fitted `gemm` is a fraction of this achievable rate, which
is how the A100 fit carries to H100/H200/B200 (validated on llm-foundry's H100 table, never fitted).
Entries without their own measurement take the same die's (A100 40GB: A100 SXM; H100 PCIe: H100 SXM).

`attention_fraction` (bf16/fp16): the best forward + backward rate FlashAttention-2 reaches over the
datasheet peak (Dao 2023, "FlashAttention-2", Sec. 4.1: up to 225 TFLOP/s on A100 = 0.72; the same
kernels on H100 up to 335 TFLOP/s = 0.34, without Hopper's TMA / wgmma). Attention kernels of
frameworks that predate FlashAttention-3 run at that share on Hopper; GPUs without a published
number take their matmul share.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

TERA, GIGA = 1e12, 1e9
# A GiB. HBM capacities on datasheets are binary: "80 GB" is what the device reports as 80 GiB, less a
# few hundred MiB the driver keeps (A100 80GB: 81,920 MiB; H100 SXM: 81,559 MiB; our H200, "141 GB":
# 143,771 MiB from nvidia-smi, bench/results/gpu/gpu_env.json). Reading them as 1e9 bytes
# understated every GPU's memory by 7% and refused layouts that fit.
GIB = 2**30

DTYPE_BYTES = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp8": 1}


GEMM_ROLES = ("forward", "dgrad", "wgrad")  # y = x W^T, dx = dy W, dW = dy^T x


@dataclass(frozen=True)
class Hardware:
    """One accelerator type in its usual node. Bandwidths in bytes/s per GPU per direction."""

    name: str
    peak_flops: dict[str, float]  # dtype -> dense FLOP/s
    hbm_bytes: float
    hbm_bandwidth: float
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    gpus_per_node: int
    intra_node_latency: float = 5e-6  # seconds per collective step (NCCL-tests small-message floor)
    inter_node_latency: float = 10e-6
    notes: str = ""
    extra: dict[str, float] = field(default_factory=dict)
    # measured GEMM rates (`shiftlm calibrate`): (role, m, k, n, FLOP/s), role one of GEMM_ROLES or
    # "inference" (the serving engine's own GEMM, `sim.costs.INFERENCE_ROLE`)
    gemm_table: tuple[tuple[str, int, int, int, float], ...] = ()
    # achievable matmul FLOP/s over the datasheet peak, per dtype (module docstring); a calibrated
    # profile's peaks are measured already (empty: 1.0)
    matmul_fraction: dict[str, float] = field(default_factory=dict)
    attention_fraction: float | None = None  # FlashAttention-2's best share of the peak (docstring)
    # measured all-reduce times inside one node (nccl-tests): (ranks, sizes in bytes ascending,
    # seconds); where a cluster has them, `sim.collectives` times an intra-node all-reduce of that
    # group size from them instead of from the link rate (vTrain's testbed, shiftlm/data/README.md)
    allreduce_table: tuple[tuple[int, tuple[float, ...], tuple[float, ...]], ...] = ()
    # the torch device type a training rank runs on: "cuda" for every catalog GPU (ROCm's too), "cpu"
    # for a profile `shiftlm calibrate` measured on the CPU (`shiftlm train` does not compile there)
    device_type: str = "cuda"

    def achievable_flops(self, dtype: str) -> float:
        """The fastest a large GEMM runs on this GPU: the datasheet peak x its measured MAMF share
        (fp16/tf32 take bf16's share where no own measurement exists)."""
        share = self.matmul_fraction
        fraction = share.get(dtype, share.get("bf16", 1.0) if dtype in ("fp16", "tf32") else 1.0)
        return self.flops(dtype) * fraction

    def attention_flops(self, dtype: str) -> float:
        """The fastest a fused (flash) attention kernel runs: FlashAttention-2's published share of
        the peak where there is one, else the achievable matmul rate."""
        if self.attention_fraction is None or dtype not in ("bf16", "fp16"):
            return self.achievable_flops(dtype)
        return self.flops(dtype) * self.attention_fraction

    def flops(self, dtype: str) -> float:
        """Peak dense FLOP/s for `dtype`; a clear error if the GPU has no such tensor cores."""
        if dtype not in self.peak_flops:
            supported = ", ".join(sorted(self.peak_flops))
            raise ValueError(f"{self.name} has no {dtype} peak in the catalog; use one of: {supported}")
        return self.peak_flops[dtype]

    def device_peak(self, dtype: str) -> float:
        """The most FLOP/s any kernel may run at: the datasheet peak of a catalog GPU; for a
        calibrated profile, the larger of its scalar peak (a median) and its fastest measured GEMM.
        MFU is model FLOPs over this, and `costs.kernels_time` never exceeds it."""
        fastest = max((row[4] for row in self.gemm_table), default=0.0)
        return max(self.flops(dtype), fastest)

    def gemm_rate(self, role: str, m: float, k: float, n: float) -> float | None:
        """The measured FLOP/s of the table's GEMM nearest to (m, k, n) in log space for `role`
        (a layer's forward, or the dgrad / wgrad of that forward GEMM), or None without a table.
        Rates depend on shape (a 128-row micro-batch through 1024-wide weights runs ~20% below a
        512-row one on a CPU core) and on the transposes of the backward GEMMs."""
        rows = [row for row in self.gemm_table if row[0] == role]
        if not rows:
            return None

        def distance(row: tuple) -> float:
            return sum(abs(math.log(max(a, 1.0) / b)) for a, b in zip((m, k, n), row[1:4]))

        return min(rows, key=distance)[4]


def _nvidia(bf16: float, fp8: float | None, fp32: float) -> dict[str, float]:
    """Dense TFLOP/s by dtype of an NVIDIA GPU: fp16 runs at the bf16 rate, tf32 at half of it."""
    peaks = {"bf16": bf16, "fp16": bf16, "fp32": fp32, "tf32": bf16 / 2}
    return peaks | ({"fp8": fp8} if fp8 else {})


def _gpu(
    name: str,
    tflops: dict[str, float],
    hbm_gb: float,
    hbm_gb_s: float,
    intra_gb_s: float,
    inter_gb_s: float,
    gpus_per_node: int,
    matmul_fraction: dict[str, float],
    attention_fraction: float | None = None,
) -> Hardware:
    """One catalog row in the datasheets' units (TFLOP/s, GB of HBM (binary), GB/s per GPU per direction)."""
    return Hardware(
        name,
        {dtype: rate * TERA for dtype, rate in tflops.items()},
        hbm_gb * GIB,
        hbm_gb_s * GIGA,
        intra_gb_s * GIGA,
        inter_gb_s * GIGA,
        gpus_per_node,
        matmul_fraction=matmul_fraction,
        attention_fraction=attention_fraction,
    )


# fmt: off
CATALOG: dict[str, Hardware] = {hw.name: hw for hw in [
    # name, dense TFLOP/s by dtype, HBM GB, HBM GB/s, intra- and inter-node GB/s, GPUs per node,
    # achievable-matmul share by dtype (MAMF), FlashAttention-2 share (sources: module docstring)
    _gpu("a100-40gb", _nvidia(312, None, 19.5),  40, 1555, 300, 25, 8, {"bf16": 0.869}, 0.72),
    _gpu("a100-80gb", _nvidia(312, None, 19.5),  80, 2039, 300, 25, 8, {"bf16": 0.869}, 0.72),
    _gpu("h100-sxm",  _nvidia(989, 1979, 67),    80, 3350, 450, 50, 8, {"bf16": 0.803, "fp8": 0.709}, 0.34),
    _gpu("h100-pcie", _nvidia(756, 1513, 51),    80, 2000,  64, 50, 8, {"bf16": 0.803, "fp8": 0.709}, 0.34),
    _gpu("h200",      _nvidia(989, 1979, 67),   141, 4800, 450, 50, 8, {"bf16": 0.803, "fp8": 0.734}, 0.34),
    _gpu("b200",      _nvidia(2250, 4500, 80),  180, 8000, 900, 50, 8, {"bf16": 0.776, "fp8": 0.763}),
    _gpu("mi250x", {"bf16": 383, "fp16": 383, "fp32": 47.9}, 128, 3200, 200, 25, 4, {"bf16": 0.767}),
    _gpu("mi300x", {"bf16": 1307, "fp16": 1307, "fp8": 2615, "fp32": 163}, 192, 5300, 448, 50, 8,
         {"bf16": 0.514}),
]}
# fmt: on

ALIASES = {"a100": "a100-80gb", "h100": "h100-sxm", "mi300": "mi300x", "mi250": "mi250x"}

# torch.cuda device name fragment -> catalog entry (first match wins: "pcie" before "h100")
_CATALOG_BY_DEVICE_NAME = [
    ("h100 pcie", "h100-pcie"),
    ("h100", "h100-sxm"),
    ("h200", "h200"),
    ("a100-sxm4-40gb", "a100-40gb"),
    ("a100", "a100-80gb"),
    ("b200", "b200"),
    ("mi300x", "mi300x"),
    ("mi250x", "mi250x"),
]


def device_peak_flops(device_name: str, dtype: str) -> float | None:
    """Peak dense FLOP/s of one device of this (torch.cuda) name from the catalog, or None if it is
    not known (any CPU): MFU then reads "n/a" rather than a guessed peak."""
    lowered = device_name.lower()
    for fragment, key in _CATALOG_BY_DEVICE_NAME:
        if fragment in lowered:
            return CATALOG[key].peak_flops.get(dtype)
    return None


DEFAULT_PROFILE = Path(os.environ.get("SHIFTLM_HARDWARE", Path.home() / ".cache/shiftlm/hardware.json"))


def save_profile(hardware: Hardware, path: Path) -> None:
    """Write a profile that `load_profile` reads back (written by `shiftlm calibrate`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(hardware), indent=2) + "\n")
    tmp.replace(path)  # atomic: never leave half a profile behind


def load_profile(path: Path) -> Hardware:
    """Read a hardware profile JSON (the fields of `Hardware`)."""
    if not path.exists():
        raise ValueError(f"no hardware profile at {path}; run `shiftlm calibrate --out {path}` first")
    try:
        fields = json.loads(path.read_text())
        fields["gemm_table"] = tuple(tuple(row) for row in fields.get("gemm_table", ()))
        fields["allreduce_table"] = tuple(
            (int(ranks), tuple(sizes), tuple(times))
            for ranks, sizes, times in fields.get("allreduce_table", ())
        )
        # written before `device_type`: only calibrate's CPU path probes the links (`p2p_latency`)
        fields.setdefault("device_type", "cpu" if "p2p_latency" in fields.get("extra", {}) else "cuda")
        return Hardware(**fields)
    except (json.JSONDecodeError, TypeError) as err:
        raise ValueError(f"{path} is not a hardware profile ({err}); re-run `shiftlm calibrate`") from err


def get_hardware(name: str, profile: Path | None = None) -> Hardware:
    """A catalog entry by name (case-insensitive), or "this" from the calibration profile."""
    key = name.lower()
    if key == "this" or profile is not None:
        return load_profile(profile or DEFAULT_PROFILE)
    key = ALIASES.get(key, key)
    if key not in CATALOG:
        known = ", ".join([*CATALOG, "this"])
        raise ValueError(f"unknown GPU {name!r}; choose one of: {known}")
    return CATALOG[key]


def with_links(hardware: Hardware, intra: float, inter: float, name: str) -> Hardware:
    """The same GPU on a cluster with different links (e.g. the vTrain testbed)."""
    return replace(hardware, name=name, intra_node_bandwidth=intra, inter_node_bandwidth=inter)


def power_capped(hardware: Hardware, watts: float, rated_watts: float, name: str) -> Hardware:
    """`hardware` run under a board power limit of `watts` below the `rated_watts` its datasheet
    peaks are stated at: the tensor-core peaks scale as (watts / rated_watts)^(1/3), the dynamic
    power of CMOS logic at a clock f being ~C V^2 f with the voltage scaled along with the clock
    (P ~ f^3, so f ~ P^(1/3)). HBM bandwidth is not scaled: the cap throttles the SM clock, not
    the memory clock. Check against a datasheet of the same die: H100 SXM (132 SMs) is 989 TFLOP/s
    bf16 at 700 W, H100 NVL (the same 132 SMs, NVIDIA H100 NVL product brief: 1,671 TFLOP/s with
    sparsity, 835 dense) is rated 350-400 W; the law gives 989 x (400/700)^(1/3) = 821 (-1.7%)."""
    if not 0 < watts <= rated_watts:
        raise ValueError(f"power limit {watts} W must lie in (0, {rated_watts}] W")
    scale = (watts / rated_watts) ** (1 / 3)
    peaks = {dtype: rate * scale for dtype, rate in hardware.peak_flops.items()}
    return replace(hardware, name=name, peak_flops=peaks)
