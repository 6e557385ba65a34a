"""The hardware catalog sits below train and sim: MFU's peak is found from a CUDA device name."""

import pytest

from shiftlm.hardware import CATALOG, device_peak_flops


def test_device_name_finds_its_catalog_peak_and_pcie_is_not_taken_for_sxm():
    assert device_peak_flops("NVIDIA H100 80GB HBM3", "bf16") == CATALOG["h100-sxm"].peak_flops["bf16"]
    assert device_peak_flops("NVIDIA H100 PCIe", "bf16") == CATALOG["h100-pcie"].peak_flops["bf16"]
    assert device_peak_flops("NVIDIA A100-SXM4-40GB", "bf16") == CATALOG["a100-40gb"].peak_flops["bf16"]


def test_an_unknown_device_has_no_peak_rather_than_a_guess():
    assert device_peak_flops("cpu", "fp32") is None
    assert device_peak_flops("NVIDIA H100 80GB HBM3", "int4") is None


def test_hbm_capacity_is_what_the_device_reports():
    # nvidia-smi's totals: our H200 (bench/results/gpu/gpu_env.json) 143,771 MiB, A100 80GB 81,920
    # MiB, H100 SXM 81,559 MiB: the datasheets' GB are binary
    for name, mib in (("h200", 143771), ("a100-80gb", 81920), ("h100-sxm", 81559)):
        assert CATALOG[name].hbm_bytes == pytest.approx(mib * 2**20, rel=0.01), name
