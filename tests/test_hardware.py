"""The hardware catalog sits below train and sim: MFU's peak is found from a CUDA device name."""

from shiftlm.hardware import CATALOG, device_peak_flops


def test_device_name_finds_its_catalog_peak_and_pcie_is_not_taken_for_sxm():
    assert device_peak_flops("NVIDIA H100 80GB HBM3", "bf16") == CATALOG["h100-sxm"].peak_flops["bf16"]
    assert device_peak_flops("NVIDIA H100 PCIe", "bf16") == CATALOG["h100-pcie"].peak_flops["bf16"]
    assert device_peak_flops("NVIDIA A100-SXM4-40GB", "bf16") == CATALOG["a100-40gb"].peak_flops["bf16"]


def test_an_unknown_device_has_no_peak_rather_than_a_guess():
    assert device_peak_flops("cpu", "fp32") is None
    assert device_peak_flops("NVIDIA H100 80GB HBM3", "int4") is None
